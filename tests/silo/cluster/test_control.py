"""The control inbox hears a command when it is pushed, without polling Redis for it (issue 39)."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from grains.ids import SiloAddress
from silo.cluster.control import ControlInbox
from silo.keys import Keys
from silo.records.control import request_drain


async def test_a_drain_request_reaches_an_idle_inbox_that_polls_only_hourly(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    keys = Keys("control")
    me = SiloAddress("127.0.0.1", 1, 1)
    heard: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    early = keys.control(str(me))
    await redis.rpush(early, '{"command": "drain", "by": "before start"}')  # pushed before the inbox ran
    inbox = ControlInbox(redis, keys, me, {"drain": heard.put_nowait}, poll_s=3600.0)
    inbox.start()
    try:
        assert (await asyncio.wait_for(heard.get(), 10))["by"] == "before start"
        await request_drain(redis, keys, str(me), by="test")
        assert (await asyncio.wait_for(heard.get(), 10))["by"] == "test"
        assert await redis.llen(early) == 0
    finally:
        await inbox.stop()
        await redis.aclose()
