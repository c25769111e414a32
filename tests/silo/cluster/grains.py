"""Grains for the cluster tests (also loaded by silo subprocesses: no torch import here)."""

from __future__ import annotations

import asyncio

from grains import (
    Grain,
    activation_count_placement,
    hash_placement,
    immovable,
    keep_alive,
    prefer_local,
    random_placement,
    silo_role,
)


@random_placement
class Tracked(Grain):
    """Answers with where it runs and which activation answered."""

    async def hit(self) -> list[str]:
        return [str(self.silo), self.activation_id]

    async def slow(self, seconds: float) -> list[str]:
        await asyncio.sleep(seconds)
        return [str(self.silo), self.activation_id]


@keep_alive
@random_placement
class Resident(Tracked):
    """Keep-alive: re-activated proactively after its silo dies."""


@immovable
@random_placement
class Pinned(Tracked):
    """Never moved by the rebalancer."""


@hash_placement
class Hashed(Tracked):
    pass


@silo_role("gpu")
class OnGpu(Tracked):
    pass


@prefer_local
class Local(Tracked):
    async def via(self, other: str) -> list[str]:
        """Call a prefer-local grain from here: it should land on this silo."""
        return await self.get_grain(Local, other).hit()


@activation_count_placement
class Counted(Tracked):
    pass
