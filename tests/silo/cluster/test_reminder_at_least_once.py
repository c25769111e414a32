"""A reminder tick claimed by a silo that dies before delivering it is delivered by another silo."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from grains.ids import GrainId
from silo.cluster.reminders import ReminderService, ReminderTable
from silo.keys import Keys
from silo.redis_util import close_redis, connect_redis
from silo.settings import RemindersSettings

FAST = RemindersSettings(poll_interval_s=0.05, delivery_timeout_s=0.2)


@pytest.fixture
async def redis(backend_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect_redis(backend_url)
    yield client
    await close_redis(client)


async def test_a_tick_whose_claiming_silo_died_is_delivered_by_another(
    redis: aioredis.Redis, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    grain = GrainId("Reminded", "a")
    # The next tick is a minute away: only a re-delivery of this one can arrive in time.
    await ReminderTable(redis, keys).register(grain, "tick", period_s=60.0, due_s=0.0)

    claimed = asyncio.Event()

    async def never_delivers(g: GrainId, name: str) -> str | None:
        claimed.set()
        await asyncio.get_running_loop().create_future()  # the silo dies before the call goes out
        return None

    doomed = ReminderService(ReminderTable(redis, keys), FAST)
    doomed.start(never_delivers)
    await asyncio.wait_for(claimed.wait(), 10)
    await doomed.stop()  # gone: its poll and its delivery end without a word to Redis

    delivered: asyncio.Queue[tuple[GrainId, str]] = asyncio.Queue()

    async def deliver(g: GrainId, name: str) -> str | None:
        await delivered.put((g, name))
        return "survivor"

    survivor = ReminderService(ReminderTable(redis, keys), FAST)
    survivor.start(deliver)
    try:
        assert await asyncio.wait_for(delivered.get(), 15) == (grain, "tick")
    finally:
        await survivor.stop()
    assert survivor.statistics().delivered == 1


async def test_an_acknowledged_tick_schedules_the_next_one_period_after_it(
    redis: aioredis.Redis, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    table = ReminderTable(redis, keys)
    grain = GrainId("Reminded", "b")
    await table.register(grain, "tick", period_s=60.0, due_s=0.0)
    (claim,) = await table.claim(10, lease_s=5.0)
    assert await redis.zscore(keys.reminders, '["Reminded","b","tick"]') == claim.lease_ms
    assert await table.claim(10, lease_s=5.0) == []  # leased: nobody else takes it
    assert await table.ack(claim)
    assert await redis.zscore(keys.reminders, '["Reminded","b","tick"]') == claim.due_ms + 60_000
    # A late ack of a claim that is no longer the reminder's (registered again) moves nothing.
    await table.register(grain, "tick", period_s=60.0, due_s=0.0)
    (again,) = await table.claim(10, lease_s=5.0)
    await table.register(grain, "tick", period_s=60.0, due_s=30.0)
    assert not await table.ack(again)
    assert not await table.ack(claim)
