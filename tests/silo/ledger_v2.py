"""Version 2 of the ``Ledger`` grain type: one method and one state field more than ledger_v1.py."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from grains import Grain, grain_type, one_way, version


@version(2)
@grain_type("Ledger")
class LedgerV2(Grain):
    class State(BaseModel):
        total: int = 0
        entries: int = 0
        label: str = "unlabelled"  # new in v2: state written by v1 loads with this default

    async def add(self, n: int) -> tuple[int, int]:
        self.state.total += n
        self.state.entries += 1
        await self.write_state()
        return self.state.total, 2

    async def total(self) -> int:
        return self.state.total

    async def summary(self) -> dict[str, Any]:
        """New in v2."""
        return {**self.state.model_dump(), "version": 2}

    @one_way
    async def relabel(self, label: str) -> None:
        """New in v2, and one-way: its caller is gone by the time a silo turns it away."""
        self.state.label = label
        await self.write_state()
