"""Control requests: drain a silo (``keys.control``), cancel a job (``keys.job_cancel``).

:func:`request_drain` and :func:`request_cancel` are the only writers, shared
by the ``redgrain`` command and the dashboard; a silo's control inbox
(silo/cluster/control.py) reads the drains, a job's owner sees its cancel on
its next progress publish (:mod:`silo.records.progress`).
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from silo.keys import Keys
from silo.redis_util import redis_errors

CONTROL_TTL_S = 3600
"""How long an unread control request waits for its silo (a busy or restarting one)."""
CANCEL_TTL_S = 7 * 24 * 3600
"""How long a cancel request stands (a job may be paused for days)."""


class ControlRequest(BaseModel):
    """One admin command in a silo's control list (``keys.control(silo)``)."""

    command: str = Field(description="What to do: 'drain'.")
    at: float = Field(default_factory=time.time, description="When it was asked (unix seconds).")
    by: str = Field(default="", description="Who asked: 'dashboard', 'redgrain drain', ...")


async def request_drain(redis: aioredis.Redis, keys: Keys, address: str, *, by: str) -> None:
    """Ask silo ``address`` to drain itself (hand its activations off, then stop)."""
    body = ControlRequest(command="drain", by=by).model_dump_json()
    with redis_errors("send drain"):
        async with redis.pipeline(transaction=True) as pipe:
            pipe.rpush(keys.control(address), body)
            pipe.expire(keys.control(address), CONTROL_TTL_S)
            await pipe.execute()
        # Outside the transaction: a channel has no slot on a Redis Cluster. A lost message only
        # delays the command to the inbox's next poll (silo/cluster/control.py).
        await redis.publish(keys.control_channel(address), "1")


async def request_cancel(redis: aioredis.Redis, keys: Keys, job: str, reason: str = "") -> None:
    """Ask a job's owner to cancel it; the owner sees it on its next progress publish."""
    with redis_errors(f"cancel job {job}"):
        await redis.set(keys.job_cancel(job), reason or "cancel", ex=CANCEL_TTL_S)

