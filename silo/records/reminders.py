"""Registered reminders as the dashboard shows them: rows, next due times, last ticks.

silo/cluster/reminders.py writes the three keys (``keys.reminder_rows``,
``keys.reminders``, ``keys.reminder_fired``); :func:`read_reminders` joins them.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from silo.keys import Keys
from silo.records._decode import text
from silo.redis_util import redis_errors


class ReminderInfo(BaseModel):
    """One registered reminder, as the dashboard shows it (silo/cluster/reminders.py writes the keys)."""

    type: str = Field(description="Grain type.")
    key: str = Field(description="Grain key.")
    name: str
    period_s: float
    next_due: float | None = Field(
        default=None, description="When the next tick is due (unix seconds, Redis clock)."
    )
    last_fired: float | None = Field(
        default=None, description="When its last delivered tick ran (unix seconds, Redis clock)."
    )
    last_silo: str | None = Field(default=None, description="The silo that tick's turn ran on.")


async def read_reminders(
    redis: aioredis.Redis, keys: Keys, type_name: str | None = None
) -> list[ReminderInfo]:
    """Every reminder of the cluster (or of one grain type), by type, key and name."""
    with redis_errors("read reminders"):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.reminder_rows)
            pipe.zrange(keys.reminders, 0, -1, withscores=True)
            pipe.hgetall(keys.reminder_fired)
            rows, due, fired = await pipe.execute()
    due_at = {text(rid): score / 1000.0 for rid, score in due}
    last = {text(rid): raw for rid, raw in fired.items()}
    out = []
    for rid_raw, raw in rows.items():
        rid = text(rid_raw)
        try:
            row = json.loads(raw)
            info = ReminderInfo(type=row["type"], key=row["key"], name=row["name"],
                                period_s=row["period_ms"] / 1000.0, next_due=due_at.get(rid))  # fmt: skip
            if rid in last:
                tick = json.loads(last[rid])
                info = info.model_copy(update={"last_fired": float(tick["at"]), "last_silo": str(tick["silo"])})
        except (ValueError, KeyError, TypeError):
            continue  # a row from another version: not ours to show
        if type_name is None or info.type == type_name:
            out.append(info)
    return sorted(out, key=lambda r: (r.type, r.key, r.name))

