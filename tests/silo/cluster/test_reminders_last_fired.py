"""A reminder's last tick (when, on which silo) is recorded only while it is registered."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from grains.ids import GrainId
from silo.cluster.reminders import Reminder, ReminderTable
from silo.keys import Keys
from silo.records.reminders import read_reminders
from silo.redis_util import close_redis, connect_redis


@pytest.fixture
async def redis(backend_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect_redis(backend_url)
    yield client
    await close_redis(client)


async def test_a_tick_is_recorded_with_its_silo_and_forgotten_on_unregister(
    redis: aioredis.Redis, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    table = ReminderTable(redis, keys)
    grain = GrainId("Reminded", "a")
    await table.register(grain, "tick", 5.0)
    (before,) = await read_reminders(redis, keys)
    assert (before.last_fired, before.last_silo) == (None, None)

    await table.fired(Reminder(grain, "tick", 5.0), "10.0.0.1:1111@3")
    (after,) = await read_reminders(redis, keys)
    assert after.last_silo == "10.0.0.1:1111@3"
    assert after.last_fired is not None and abs(after.last_fired - time.time()) < 5
    assert after.next_due is not None and 4 < after.next_due - time.time() < 6

    assert await table.unregister(grain, "tick")
    assert await redis.hlen(keys.reminder_fired) == 0
    # A tick that was in flight as it was unregistered writes nothing back.
    await table.fired(Reminder(grain, "tick", 5.0), "10.0.0.1:1111@3")
    assert await redis.hlen(keys.reminder_fired) == 0
    assert await read_reminders(redis, keys) == []
