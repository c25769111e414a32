"""Live logs: the records silos write to ``keys.logs`` (silo/logstream.py), read back."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from silo import errors
from silo.keys import Keys
from silo.records._decode import text
from silo.redis_util import redis_errors

LOG_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


class LogEntry(BaseModel):
    """One record of the log stream (``keys.logs``, written by silo/logstream.py)."""

    id: str = Field(description="Stream entry id (milliseconds-sequence); pass it as `since` to tail.")
    time: float = Field(description="When it was logged (unix seconds, the silo's clock).")
    level: str
    logger: str
    message: str
    silo: str = Field(description="The silo whose work logged it.")
    exc: str = Field(default="", description="Formatted exception (traceback), if any.")

    @classmethod
    def from_entry(cls, entry_id: Any, fields: dict[Any, Any]) -> LogEntry:
        f = {text(k): text(v) for k, v in fields.items()}
        try:
            at = float(f.get("time", "0"))
        except ValueError:
            at = 0.0
        return cls(id=text(entry_id), time=at, level=f.get("level", "?"), logger=f.get("logger", ""),
                   message=f.get("message", ""), silo=f.get("silo", ""), exc=f.get("exc", ""))  # fmt: skip


_LOG_SCAN_MAX = 20_000
"""Entries one read looks through at most to find ``limit`` that match its filters."""


async def read_logs(
    redis: aioredis.Redis,
    keys: Keys,
    *,
    since: str | None = None,
    silo: str | None = None,
    level: str | None = None,
    limit: int = 200,
) -> tuple[list[LogEntry], str | None]:
    """Log records, oldest first, and the id of the last entry looked at (the next ``since``).

    ``since`` is a stream id (entries after it) or unix milliseconds (entries
    from then on). With it, the oldest ``limit`` matching entries after it
    come back, so a tail that passes the returned id misses nothing; without
    it, the newest ``limit``. ``level`` keeps that level and above.
    """
    floor = 0
    if level is not None:
        if level.upper() not in LOG_LEVELS:
            raise errors.ConfigError(f"unknown log level {level!r}; one of {', '.join(LOG_LEVELS)}")
        floor = LOG_LEVELS[level.upper()]

    def keep(e: LogEntry) -> bool:
        return (silo is None or e.silo == silo) and LOG_LEVELS.get(e.level, 0) >= floor

    found: list[LogEntry] = []
    last: str | None = since if since and "-" in since else None
    chunk = max(limit, 100)
    scanned = 0
    with redis_errors("read logs"):
        if since:
            cursor = f"({since}" if "-" in since else since
            while len(found) < limit and scanned < _LOG_SCAN_MAX:
                entries = await redis.xrange(keys.logs, min=cursor, max="+", count=chunk) or []
                for i, f in entries:
                    last = text(i)
                    e = LogEntry.from_entry(i, f or {})
                    if keep(e):
                        found.append(e)
                        if len(found) == limit:
                            break
                scanned += len(entries)
                if len(entries) < chunk:
                    break
                cursor = f"({last}"
            return found, last
        top = "+"
        while len(found) < limit and scanned < _LOG_SCAN_MAX:
            entries = await redis.xrevrange(keys.logs, max=top, min="-", count=chunk) or []
            for i, f in entries:
                if last is None:
                    last = text(i)  # the newest entry: a tail goes on from there
                e = LogEntry.from_entry(i, f or {})
                if keep(e):
                    found.append(e)
                    if len(found) == limit:
                        break
            scanned += len(entries)
            if len(entries) < chunk:
                break
            top = f"({text(entries[-1][0])}"
    found.reverse()
    return found, last

