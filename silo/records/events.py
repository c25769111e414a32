"""Cluster events: joins, deaths, drains, rebalances, as one capped stream (``keys.events``).

Any component that sees something worth a line in the dashboard's event log
calls ``events.emit(kind, **data)`` on the :class:`EventLog`: it returns at
once and the XADD runs in the background, so a hook on a hot path (a
membership change, a move) never waits on Redis. ``await events.write(kind,
**data)`` does the same and waits. The stream keeps about the last 10,000
events (MAXLEN ~). Kinds in use: join, leave, suspect, dead, rebalance,
failover, drain, cancel. :func:`read_events` is the reader.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from silo import errors
from silo.keys import Keys
from silo.records._decode import text
from silo.redis_util import redis_errors

# The logger's name from before the split: logging configurations name it.
log = logging.getLogger("redgrain.records")


class ClusterEvent(BaseModel):
    """One entry of the event stream."""

    id: str = Field(default="", description="Stream entry id (milliseconds-sequence).")
    at: float = Field(description="Unix time the event was emitted.")
    kind: str
    silo: str = Field(default="", description="Who emitted it (a silo address, 'dashboard', ...).")
    data: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_entry(cls, entry_id: Any, fields: dict[Any, Any]) -> ClusterEvent:
        f = {text(k): text(v) for k, v in fields.items()}
        try:
            data = json.loads(f.get("data", "{}"))
        except ValueError:
            data = {"raw": f.get("data", "")}
        try:
            at = float(f.get("at", "0"))
        except ValueError:
            at = 0.0
        return cls(id=text(entry_id), at=at, kind=f.get("kind", "?"), silo=f.get("silo", ""),
                   data=data if isinstance(data, dict) else {"value": data})  # fmt: skip


async def read_events(
    redis: aioredis.Redis, keys: Keys, *, count: int = 200, before: str | None = None
) -> list[ClusterEvent]:
    """The newest ``count`` events (newest first), optionally older than stream id ``before``."""
    with redis_errors("read events"):
        entries = await redis.xrevrange(
            keys.events, max=f"({before}" if before else "+", min="-", count=count
        )
    return [ClusterEvent.from_entry(i, f or {}) for i, f in entries or []]


EVENTS_MAXLEN = 10_000
_MAX_PENDING = 1000  # unwritten events kept (Redis slow or down); the oldest go first


@dataclass(frozen=True, slots=True)
class EventLogStatistics:
    written: int
    """Events written to the stream."""
    dropped: int
    """Events lost because Redis was unreachable or too many were pending."""
    pending: int
    """Events emitted and waiting to be written."""


class EventLog:
    """Writes cluster events to ``keys.events``; ``emit`` is the hook other components call.

    Emitted events wait in a bounded queue that one background task drains,
    in order, a pipelined batch at a time.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        source: str,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._source = source
        self._clock = clock
        self._queue: deque[dict[Any, Any]] = deque()
        self._writer: asyncio.Task[None] | None = None
        self._written = self._dropped = 0

    def _fields(self, kind: str, data: dict[str, Any]) -> dict[Any, Any]:
        return {
            "at": repr(self._clock()),
            "kind": kind,
            "silo": self._source,
            "data": json.dumps(data, default=str),
        }

    def emit(self, kind: str, **data: Any) -> None:
        """Record an event without waiting (safe from sync callbacks inside the event loop)."""
        if len(self._queue) >= _MAX_PENDING:
            self._queue.popleft()  # keep the newest: they say what the cluster is doing now
            self._dropped += 1
        self._queue.append(self._fields(kind, data))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(
                self._drain(), name="events-writer"
            )

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        """``emit`` with the data as one dict, for components that take an ``on_event`` hook."""
        self.emit(kind, **data)

    async def write(self, kind: str, **data: Any) -> str:
        """Record an event and wait for Redis; returns the stream id. Raises StorageError."""
        with redis_errors(f"write {kind} event"):
            entry = await self._redis.xadd(
                self._keys.events, self._fields(kind, data), maxlen=EVENTS_MAXLEN, approximate=True
            )
        self._written += 1
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    async def _drain(self) -> None:
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), 100))]
            try:
                with redis_errors("write events"):
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for fields in batch:
                            pipe.xadd(
                                self._keys.events, fields, maxlen=EVENTS_MAXLEN, approximate=True
                            )
                        await pipe.execute()
                self._written += len(batch)
            except errors.StorageError as exc:
                self._dropped += len(batch)
                log.debug("%d events not recorded: %s", len(batch), exc)

    async def flush(self) -> None:
        """Wait until every emitted event is written (or dropped)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.wait({self._writer})  # never raises, even if the writer was cancelled

    def cancel_pending(self) -> None:
        """Drop unwritten events (a silo declared dead touches nothing in Redis)."""
        self._dropped += len(self._queue)
        self._queue.clear()
        if self._writer is not None:
            self._writer.cancel()

    def statistics(self) -> EventLogStatistics:
        return EventLogStatistics(self._written, self._dropped, len(self._queue))

