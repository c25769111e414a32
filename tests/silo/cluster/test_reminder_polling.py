"""A silo claims reminders when one falls due or it is woken, not every poll interval (issue 39)."""

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


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect_redis(redis_url)
    yield client
    await close_redis(client)


async def test_a_claim_says_when_the_next_reminder_falls_due(redis: aioredis.Redis, cluster_name: str) -> None:
    table = ReminderTable(redis, Keys(cluster_name))
    assert await table.claim_due(10, lease_s=5.0) == ([], None)
    await table.register(GrainId("Reminded", "a"), "hourly", period_s=3600.0)
    await table.register(GrainId("Reminded", "b"), "minutely", period_s=60.0)
    claims, next_s = await table.claim_due(10, lease_s=5.0)
    assert claims == [] and next_s is not None and 55.0 < next_s <= 60.0


async def test_an_idle_poller_sleeps_until_a_registration_wakes_it_and_then_until_the_next_tick(
    redis: aioredis.Redis, cluster_name: str
) -> None:
    service = ReminderService(
        ReminderTable(redis, Keys(cluster_name)), RemindersSettings(poll_interval_s=0.05, idle_poll_s=3600.0)
    )
    ticked = asyncio.Event()

    async def deliver(grain: GrainId, name: str) -> str | None:
        ticked.set()
        return None

    service.start(deliver)
    try:
        await service.register(GrainId("Reminded", "a"), "tick", period_s=3600.0, due_s=0.0)
        await asyncio.wait_for(ticked.wait(), 10)
        # Six poll intervals: a poller by the interval would claim about six more times; this one
        # claimed at start, when woken by the registration and after the ack, and sleeps an hour.
        await asyncio.sleep(0.3)
        stats = service.statistics()
        assert stats.claimed == 1 and stats.delivered == 1
        assert stats.polls <= 3
    finally:
        await service.stop()
