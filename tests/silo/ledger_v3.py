"""Version 3 of the ``Ledger`` grain type: ``total`` removed, ``audit`` added (v2: ledger_v2.py)."""

from __future__ import annotations

from pydantic import BaseModel

from grains import Grain, grain_type, version


@version(3)
@grain_type("Ledger")
class LedgerV3(Grain):
    class State(BaseModel):
        total: int = 0
        entries: int = 0
        label: str = "unlabelled"

    async def add(self, n: int) -> tuple[int, int]:
        self.state.total += n
        self.state.entries += 1
        await self.write_state()
        return self.state.total, 3

    async def audit(self) -> int:
        """New in v3 (and ``total`` is gone)."""
        return self.state.entries
