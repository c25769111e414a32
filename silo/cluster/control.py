"""Admin commands for one silo, through Redis: the dashboard's and ``redgrain drain``'s inbox.

A command is JSON ``{"command": "drain", ...}`` pushed onto
``keys.control(silo)`` (``silo.records.control.request_drain`` writes it, with a TTL
so a command for a silo that never reads it goes away) and announced on
``keys.control_channel(silo)``. The inbox reads the list when the channel
says so, when its subscription is (re)made, and every ``poll_s`` (30 s: a
message lost to a dropped subscription): commands are rare and must survive
a silo that was busy when one was pushed, and an idle silo must not ask Redis
four times a second for them (issue 39: it did, 4 of its 41 commands/s). Each
command goes to the handler registered for its name (the silo wires ``drain``
to :class:`silo.cluster.drain.DrainRequests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis

from grains.ids import SiloAddress
from silo import errors
from silo.cluster.failure_detector import wait_event
from silo.keys import Keys
from silo.redis_util import redis_errors
from silo.shutdown import raise_if_cancelled

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
        poll_s: float = 30.0,
    ) -> None:
        self._redis = redis
        self._key = keys.control(str(me))
        self._channel = keys.control_channel(str(me))
        self._wake = asyncio.Event()
        self._listener: asyncio.Task[None] | None = None
        self._handlers = dict(handlers)
        self._poll_s = poll_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.received = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self._listener = loop.create_task(self._listen())

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        tasks = [t for t in (self._task, self._listener) if t is not None and t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._listener = None

    async def _listen(self) -> None:
        """Wake the inbox on each message of its channel, and once per (re)subscription (a
        command pushed while we were not subscribed)."""
        while not self._stopping:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
                self._wake.set()
                while not self._stopping:
                    # Not a blocking get_message: cancelling a blocked read in redis-py can hang a
                    # stopping silo (see MembershipView._listen_forever). Polls the socket, not Redis.
                    msg = await pubsub.get_message(timeout=0)
                    raise_if_cancelled()
                    if msg is not None:
                        self._wake.set()
                    else:
                        await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever broke it, subscribe again
                log.debug("control subscription dropped: %s", exc)
                raise_if_cancelled()
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pubsub.aclose(), 1.0)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                with redis_errors("control inbox"):
                    raw = await self._redis.lpop(self._key)
            except errors.StorageError as exc:
                log.warning("%s", exc)
                raw = None
            if raw is None:
                await wait_event(self._wake, self._poll_s)
                self._wake.clear()
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
