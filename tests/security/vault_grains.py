"""A grain type only some silos host (the allow-list tests start silos with or without it)."""

from __future__ import annotations

from grains import Grain


class Vault(Grain):
    async def open(self) -> str:
        return f"opened on {self.silo}"
