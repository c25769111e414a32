"""The activation log the chaos soak and the partition scenarios check their invariants on.

Test grains append ``(grain, activation, silo, event, seq)`` entries to a Redis
stream when they activate, write state, or have a write refused. The silo
process finds the stream through two environment variables the test sets; a
failed append (Redis down or cut off) loses only that entry, never the call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from grains import Grain


class ActivationLog:
    def __init__(self, url_env: str, key_env: str, *, timeout_s: float, maxlen: int | None = None) -> None:
        self._url_env, self._key_env = url_env, key_env
        self._timeout_s = timeout_s
        self._maxlen = maxlen
        self._client: Any = None
        self.failures = 0

    async def append(self, grain: Grain, event: str, seq: int = -1) -> None:
        url, key = os.environ.get(self._url_env), os.environ.get(self._key_env)
        if not url or not key:
            return
        if self._client is None:  # opened lazily, on the silo's own loop
            self._client = aioredis.Redis.from_url(
                url, socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s
            )
        fields = {
            "grain": str(grain.grain_id),
            "act": grain.activation_id,
            "silo": str(grain.silo),
            "event": event,
            "seq": seq,
            "t": time.time(),
        }
        try:
            await self._client.xadd(key, fields, maxlen=self._maxlen, approximate=self._maxlen is not None)
        except Exception:  # noqa: BLE001 - the entry is lost, the call is not
            self.failures += 1


async def add_once(ops: list[str], op: str, write: Callable[[], Awaitable[None]]) -> None:
    """Apply operation ``op`` at most once: record it and write; a failed write forgets it
    again, so the caller's retry applies it (an acknowledged op is in the state exactly once)."""
    if op in ops:
        return
    ops.append(op)
    try:
        await write()
    except BaseException:
        ops.remove(op)
        raise
