"""Version 1 of the ``Ledger`` grain type, for the rolling-upgrade test (v2: ledger_v2.py)."""

from __future__ import annotations

from pydantic import BaseModel

from grains import Grain, grain_type


@grain_type("Ledger")
class LedgerV1(Grain):
    class State(BaseModel):
        total: int = 0
        entries: int = 0

    async def add(self, n: int) -> tuple[int, int]:
        """The new total, and the version that served the call."""
        self.state.total += n
        self.state.entries += 1
        await self.write_state()
        return self.state.total, 1

    async def total(self) -> int:
        return self.state.total
