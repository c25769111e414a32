"""Grains of the partition scenarios: a counter that applies operation ids once and says who wrote.

Every accepted state write appends ``(grain, activation, silo, seq)`` to an
activation log (a Redis stream), and a write the store refused appends a
``refused`` entry, when the silo can still reach Redis. The state itself also
keeps the run of activations that wrote it, so a zombie's write that reached
Redis without anyone logging it would still show in the final state (or as
lost acknowledged operations). The silo finds the log through
``REDGRAIN_NETNS_LOG_REDIS`` (URL) and ``REDGRAIN_NETNS_LOG_KEY`` (stream key).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, Field

from grains import Grain, random_placement
from silo import errors
from silo.keys import Keys
from tests.activation_log import ActivationLog, add_once


def log_key(cluster: str) -> str:
    """The stream the scenario grains log accepted and refused writes to."""
    return Keys(cluster).prefix + "test:netns-log"


# Cut from Redis: the entry is lost, the call is not.
_Log = ActivationLog("REDGRAIN_NETNS_LOG_REDIS", "REDGRAIN_NETNS_LOG_KEY", timeout_s=1)


@random_placement
class NetCounter(Grain):
    """Operation ids applied at most once; answers with where it ran."""

    class State(BaseModel):
        seq: int = 0
        ops: list[str] = Field(default_factory=list)
        writers: list[str] = Field(default_factory=list)
        """Activation ids in the order they first wrote (a new entry per change of writer)."""

    async def add(self, op: str) -> list[Any]:
        await add_once(self.state.ops, op, self._write)
        return [str(self.silo), self.activation_id, len(self.state.ops)]

    async def slow_add(self, op: str, seconds: float) -> list[Any]:
        await asyncio.sleep(seconds)
        return await self.add(op)

    async def add_via(self, other: str, op: str, timeout_s: float) -> list[Any]:
        """Add ``op`` to counter ``other`` from here: a call between silos."""
        ref: Any = self.get_grain(NetCounter, other)
        there = await ref.with_timeout(timeout_s).add(op)
        return [str(self.silo), *there]

    async def snapshot(self) -> dict[str, list[str]]:
        """The applied operations and the run of activations that wrote them."""
        return {"ops": list(self.state.ops), "writers": list(self.state.writers)}

    async def where(self) -> list[str]:
        return [str(self.silo), self.activation_id]

    async def _write(self) -> None:
        s = self.state
        s.seq += 1
        new_writer = not s.writers or s.writers[-1] != self.activation_id
        if new_writer:
            s.writers.append(self.activation_id)
        try:
            await self.write_state()
        except errors.StateConflictError:
            await _Log.append(self, "refused", s.seq)
            self._undo(new_writer)
            raise
        except BaseException:
            self._undo(new_writer)
            raise
        await _Log.append(self, "write", s.seq)

    def _undo(self, new_writer: bool) -> None:
        self.state.seq -= 1
        if new_writer:
            self.state.writers.pop()
