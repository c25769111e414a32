"""The in-process harness with a Redis client runs reminders and stream delivery as a silo does.

On redis-server and on the simulator's command-level twin alike (the
simulator's ``services`` scenario is this wiring on the twin).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from grains import Grain, subscribes
from silo.keys import Keys
from silo.redis_util import close_redis, connect_redis
from silo.settings import RemindersSettings, StreamSettings
from silo.testing.harness import InProcessSilo


class Ticker(Grain):
    async def on_activate(self) -> None:
        self.ticks = 0
        self.ticked = asyncio.Event()

    async def start(self) -> None:
        await self.register_reminder("beat", 0.05, due_s=0)

    async def receive_reminder(self, name: str) -> None:
        self.ticks += 1
        if self.ticks >= 3:
            self.ticked.set()


@subscribes("feed")
class Feed(Grain):
    async def on_activate(self) -> None:
        self.items: list[tuple[int, str]] = []
        self.got = asyncio.Event()

    async def ready(self) -> None:
        pass

    async def on_stream_item(self, item: int, token: str) -> None:
        self.items.append((item, token))
        if len(self.items) == 3:
            self.got.set()


@pytest.fixture(params=["redis", "twin"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "redis":
        client = connect_redis(request.getfixturevalue("redis_url"))
    else:
        from silo.testing.sim import redis_twin

        client = redis_twin.client(redis_twin.new_server(), "harness", linked=False)
    try:
        yield client
    finally:
        await close_redis(client)


def _silo(redis: Any) -> InProcessSilo:
    return InProcessSilo(
        [Ticker, Feed], redis=redis, keys=Keys("harness"),
        reminders=RemindersSettings(poll_interval_s=0.01, idle_poll_s=0.2, delivery_timeout_s=5.0),
        streams=StreamSettings(maxlen=None, discover_interval_s=0.05, block_ms=100, delivery_timeout_s=5.0),
    )  # fmt: skip


async def test_a_reminder_registered_by_a_grain_ticks_through_the_harness(redis: Any) -> None:
    async with _silo(redis) as silo:
        ticker = silo.get_grain(Ticker, "t")
        await ticker.start()
        await asyncio.wait_for(silo.instance(ticker).ticked.wait(), 10)
        assert silo.reminders is not None and silo.reminders.statistics().delivered >= 3


async def test_an_implicit_subscriber_gets_every_published_item_in_order(redis: Any) -> None:
    async with _silo(redis) as silo:
        feed = silo.get_grain(Feed, "k")
        await feed.ready()
        assert silo.streams is not None
        tokens = [await silo.streams.stream("feed", "k").publish(n) for n in range(3)]
        await asyncio.wait_for(silo.instance(feed).got.wait(), 10)
        assert silo.instance(feed).items == list(zip(range(3), tokens, strict=True))
        (agent,) = silo.stream_agents
        assert agent.statistics().keys_held == 1
    assert silo.stream_agents == []  # stopped with the silo, leases released
    assert await redis.exists(Keys("harness").stream_lease("feed", "k", "Feed")) == 0
