"""Admin commands for one silo, through Redis: the dashboard's and ``redgrain drain``'s inbox.

A command is JSON ``{"command": "drain", ...}`` pushed onto
``keys.control(silo)`` (``silo.records.request_drain`` writes it, with a TTL
so a command for a silo that never reads it goes away). The inbox polls the
list, since commands are rare and must survive a silo that was busy when one
was pushed; each command goes to the handler registered for its name (the
silo wires ``drain`` to :class:`silo.cluster.drain.DrainRequests`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis

from grains.ids import SiloAddress
from silo import errors
from silo.keys import Keys
from silo.redis_util import redis_errors

log = logging.getLogger("redgrain.rebalancer")

ControlHandler = Callable[[dict[str, Any]], Any]


class ControlInbox:
    """Polls ``keys.control(silo)`` and runs each command's handler."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        me: SiloAddress,
        handlers: Mapping[str, ControlHandler],
        poll_s: float = 0.25,
    ) -> None:
        self._redis = redis
        self._key = keys.control(str(me))
        self._handlers = dict(handlers)
        self._poll_s = poll_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.received = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        while not self._stopping:
            try:
                with redis_errors("control inbox"):
                    raw = await self._redis.lpop(self._key)
            except errors.StorageError as exc:
                log.warning("%s", exc)
                raw = None
            if raw is None:
                await asyncio.sleep(self._poll_s)
                continue
            try:
                cmd = json.loads(raw if isinstance(raw, (bytes, str)) else b"")
                handler = self._handlers[str(cmd["command"])]
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring unknown control command %r", raw)
                continue
            self.received += 1
            try:
                handler(cmd)
            except Exception:
                log.exception("control command %r failed", raw)
