"""Grains of the chaos soak: bank accounts, a saga transfer, an idempotent counter, a probe.

Every activation appends to an activation log (a Redis stream) when it
activates, after each state write Redis accepted, and when it deactivates.
Each write entry carries the state's own write sequence number, so the soak
can order accepted writes by the state itself rather than by when the log
entry happened to arrive (a silo may be SIGSTOPped between the two).

The silo process finds the log through two environment variables the soak
sets: ``REDGRAIN_CHAOS_REDIS`` (URL) and ``REDGRAIN_CHAOS_LOG`` (stream key).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from grains import Grain
from silo.keys import Keys
from tests.activation_log import ActivationLog, add_once

INITIAL_BALANCE = 1_000
LOG_MAXLEN = 2_000_000


def activation_log_key(cluster: str) -> str:
    """The stream the soak's grains log activations and accepted writes to."""
    return Keys(cluster).prefix + "test:activation-log"


_Log = ActivationLog("REDGRAIN_CHAOS_REDIS", "REDGRAIN_CHAOS_LOG", timeout_s=2, maxlen=LOG_MAXLEN)


class _Logged(Grain):
    async def on_activate(self) -> None:
        await _Log.append(self, "activate")

    async def on_deactivate(self, reason: object) -> None:
        await _Log.append(self, "deactivate")

    async def _write(self) -> None:
        self.state.seq += 1
        try:
            await self.write_state()
        except BaseException:
            self.state.seq -= 1
            raise
        await _Log.append(self, "write", self.state.seq)


class ChaosAccount(_Logged):
    class State(BaseModel):
        seq: int = 0
        balance: int = INITIAL_BALANCE
        applied: dict[str, int] = Field(default_factory=dict)
        """Transaction id -> signed amount applied (makes a re-run saga step harmless)."""

    async def withdraw(self, tx: str, amount: int) -> bool:
        if tx in self.state.applied:
            return self.state.applied[tx] != 0
        ok = self.state.balance >= amount
        self.state.applied[tx] = -amount if ok else 0
        if ok:
            self.state.balance -= amount
        try:
            await self._write()
        except BaseException:
            await self._undo(tx, ok, amount)
            raise
        return ok

    async def deposit(self, tx: str, amount: int) -> None:
        if tx in self.state.applied:
            return
        self.state.applied[tx] = amount
        self.state.balance += amount
        try:
            await self._write()
        except BaseException:
            del self.state.applied[tx]
            self.state.balance -= amount
            raise

    async def _undo(self, tx: str, ok: bool, amount: int) -> None:
        # The write was refused: memory must match what Redis holds.
        del self.state.applied[tx]
        if ok:
            self.state.balance += amount

    async def balance(self) -> int:
        return self.state.balance

    async def applied(self) -> dict[str, int]:
        return dict(self.state.applied)


class ChaosTransfer(_Logged):
    """One transfer saga; ``run`` is safe to call again after any failure."""

    class State(BaseModel):
        seq: int = 0
        source: str = ""
        target: str = ""
        amount: int = 0
        stage: str = "new"  # new -> withdrawn | rejected -> done

    async def run(self, source: str, target: str, amount: int) -> str:
        s = self.state
        if s.stage == "new":
            ok = (
                await self.get_grain(ChaosAccount, source)
                .with_timeout(3)
                .withdraw(self.key, amount)
            )
            s.source, s.target, s.amount = source, target, amount
            s.stage = "withdrawn" if ok else "rejected"
            try:
                await self._write()
            except BaseException:
                s.stage = "new"
                raise
        if s.stage == "withdrawn":
            await self.get_grain(ChaosAccount, s.target).with_timeout(3).deposit(self.key, s.amount)
            s.stage = "done"
            try:
                await self._write()
            except BaseException:
                s.stage = "withdrawn"
                raise
        return s.stage


class OpCounter(_Logged):
    """A counter whose increments carry an operation id, applied at most once."""

    class State(BaseModel):
        seq: int = 0
        ops: list[str] = Field(default_factory=list)

    async def add(self, op: str) -> int:
        await add_once(self.state.ops, op, self._write)
        return len(self.state.ops)

    async def ops(self) -> list[str]:
        return list(self.state.ops)


class ChaosProbe(Grain):
    """Answers only if its silo still serves (the soak sends it straight to a silo it suspects)."""

    async def ping(self) -> str:
        return str(self.silo)
