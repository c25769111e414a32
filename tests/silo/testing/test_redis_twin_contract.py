"""The simulator's command-level Redis twin (fakeredis, silo/testing/sim/redis_twin.py) against redis-server.

Each test runs the runtime's own Redis code (the reminder table's scripts, the
stream agent's lease and read scripts, publishing and subscribing, the
commands a takeover sends) on a real redis-server and on the twin, and asserts
the same outcome on both: what the ``services`` simulation scenario shows is
then what these services do on Redis. The membership table's contract runs on
the twin too (tests/silo/cluster/test_membership_contract.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from grains.ids import GrainId
from silo.cluster.reminders import ReminderTable
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.redis_util import close_redis, connect_redis
from silo.settings import StreamSettings
from silo.streams.agent import _READ_NEW, _RELEASE, _RENEW
from silo.streams.stream import Streams
from silo.testing.sim import redis_twin  # after the skips: fakeredis is a dev dependency

KEYS = Keys("contract")
G = GrainId("Ticker", "a")


@pytest.fixture(params=["redis", "twin"])
async def redis(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "redis":
        client = connect_redis(request.getfixturevalue("redis_url"))
    else:
        client = redis_twin.client(redis_twin.new_server(), "contract", linked=False)
    try:
        yield client
    finally:
        await close_redis(client)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- reminders (silo/cluster/reminders.py) ---------------------------------------------------


async def test_a_due_reminder_is_claimed_once_under_its_lease_and_acked_to_its_next_period(redis: Any) -> None:
    table = ReminderTable(redis, KEYS)
    await table.register(G, "tick", period_s=60.0, due_s=0)
    claims, next_s = await table.claim_due(10, lease_s=30.0)
    assert [c.reminder.name for c in claims] == ["tick"] and claims[0].reminder.period_s == 60.0
    assert next_s is not None and 29.0 < next_s <= 30.0  # the lease's end is the next score
    claim = claims[0]
    assert claim.lease_ms - claim.due_ms >= 30_000 - 50
    # Leased: no one else claims it meanwhile.
    again, _ = await table.claim_due(10, lease_s=30.0)
    assert again == []
    assert await table.ack(claim)
    # The next tick is one period after this one was due (Redis' clock).
    score = await redis.zscore(KEYS.reminders, '["Ticker","a","tick"]')
    assert score == claim.due_ms + 60_000
    # An ack whose lease is no longer the score (acked already, or claimed again) is refused.
    assert not await table.ack(claim)


async def test_a_tick_is_recorded_only_while_registered_and_unregister_removes_every_trace(redis: Any) -> None:
    table = ReminderTable(redis, KEYS)
    await table.register(G, "tick", period_s=1.0, due_s=0)
    (claim,) = await table.claim(10, lease_s=5.0)
    await table.fired(claim.reminder, "127.0.0.1:1@1")
    fired = await redis.hgetall(KEYS.reminder_fired)
    assert list(map(_text, fired)) == ['["Ticker","a","tick"]']
    assert '"silo":"127.0.0.1:1@1"' in _text(next(iter(fired.values())))
    assert [r.name for r in await table.list(G)] == ["tick"]
    assert await table.unregister(G, "tick")
    assert await redis.exists(KEYS.reminders, KEYS.reminder_rows, KEYS.reminder_fired) == 0
    await table.fired(claim.reminder, "127.0.0.1:1@1")  # after unregister: nothing written
    assert await redis.exists(KEYS.reminder_fired) == 0
    assert not await table.ack(claim)


async def test_a_claim_drops_a_due_id_whose_row_is_gone_and_says_when_the_next_falls_due(redis: Any) -> None:
    table = ReminderTable(redis, KEYS)
    await redis.zadd(KEYS.reminders, {"orphan": 0})
    await table.register(G, "later", period_s=10.0, due_s=5.0)
    claims, next_s = await table.claim_due(10, lease_s=1.0)
    assert claims == [] and await redis.zscore(KEYS.reminders, "orphan") is None
    assert next_s is not None and 4.5 < next_s <= 5.0
    await table.unregister(G, "later")
    assert (await table.claim_due(10, lease_s=1.0))[1] is None


# --- stream leases (silo/streams/agent.py) -----------------------------------------------------


async def test_a_stream_lease_is_renewed_and_released_only_by_its_holder(redis: Any) -> None:
    renew, release = redis.register_script(_RENEW), redis.register_script(_RELEASE)
    a, b = "lease:a", "lease:b"
    assert await redis.set(a, "s1", nx=True, px=3000)
    assert not await redis.set(a, "s2", nx=True, px=3000)
    assert await redis.set(b, "s2", nx=True, px=3000)
    assert await renew(keys=[a, b], args=["s1", 60_000]) == [1, 0]
    assert 59_000 < await redis.pttl(a) <= 60_000 and await redis.pttl(b) <= 3000
    assert await release(keys=[a], args=["s2"]) == 0 and await redis.get(a) is not None
    assert await release(keys=[a], args=["s1"]) == 1 and await redis.get(a) is None


# --- stream delivery: the agent's read script, takeover, the shared wait -------------------------


def _streams(redis: Any, **settings: Any) -> Streams:
    return Streams(redis, KEYS, Codec(TypeRegistry()), StreamSettings(**settings))


async def test_the_agents_read_counts_what_trimming_took_before_the_group_read_it(redis: Any) -> None:
    stream = _streams(redis, maxlen=3, approximate_trim=False).stream("feed", "k")
    tokens = [await stream.publish(i) for i in range(5)]
    name = KEYS.stream("feed", "k")
    await redis.xgroup_create(name, "G", id="0", mkstream=True, entries_read=0)
    read = redis.register_script(_READ_NEW)
    lost, last, reply = await read(keys=[name], args=["G", "s1", 10])
    # Two items trimmed unread: told once, then the entries the stream keeps, in Redis' nested shape.
    assert lost == 2 and _text(last) == "0-0"
    ((stream_name, entries),) = reply
    assert _text(stream_name) == name
    assert [_text(e[0]) for e in entries] == tokens[2:]
    lost, last, reply = await read(keys=[name], args=["G", "s1", 10])
    assert lost == 0 and _text(last) == tokens[-1] and not reply
    info = {_text(g["name"]): g for g in await redis.xinfo_groups(name)}
    assert info["G"]["entries-read"] == 5 and info["G"]["pending"] == 3


async def test_a_takeover_claims_the_pending_entries_and_drops_the_dead_consumer(redis: Any) -> None:
    stream = _streams(redis, maxlen=None).stream("feed", "k")
    tokens = [await stream.publish(i) for i in range(3)]
    name = KEYS.stream("feed", "k")
    await redis.xgroup_create(name, "G", id="0", mkstream=True, entries_read=0)
    await redis.xreadgroup("G", "dead", {name: ">"}, count=10)
    start, claimed, *deleted = await redis.xautoclaim(name, "G", "s2", min_idle_time=0, start_id="0-0", count=10)
    assert _text(start) == "0-0" and [_text(e) for e, _ in claimed] == tokens and deleted in ([], [[]])
    consumers = {_text(c["name"]): c["pending"] for c in await redis.xinfo_consumers(name, "G")}
    assert consumers == {"dead": 0, "s2": 3}
    await redis.xgroup_delconsumer(name, "G", "dead")
    pending = await redis.xreadgroup("G", "s2", {name: "0-0"}, count=10)
    assert [_text(e) for _, es in pending for e, _ in es] == tokens
    assert await redis.xack(name, "G", *tokens) == 3
    assert (await redis.xpending(name, "G"))["pending"] == 0


async def test_the_shared_blocking_read_wakes_when_an_item_is_published(redis: Any) -> None:
    stream = _streams(redis, maxlen=None).stream("feed", "k")
    first = await stream.publish(0)
    name = KEYS.stream("feed", "k")
    waiting = asyncio.ensure_future(redis.xread({name: first}, count=1, block=5_000))
    # No event tells that the XREAD reached the server (the twin has no INFO clients); if the
    # publish overtook it, it returns the item all the same, so this wait only makes the test
    # exercise the wake-up, never decides it.
    await asyncio.sleep(0.05)
    assert not waiting.done()
    second = await _streams(redis, maxlen=None).stream("feed", "k").publish(1)
    ((got_name, entries),) = await asyncio.wait_for(waiting, 5)
    assert _text(got_name) == name and [_text(e) for e, _ in entries] == [second]


async def test_a_subscription_reads_from_the_start_and_counts_a_gap(redis: Any) -> None:
    stream = _streams(redis, maxlen=2, approximate_trim=False).stream("feed", "k")
    for i in range(4):
        await stream.publish(i)
    sub = stream.subscribe(from_start=True)
    items = []
    async for item in sub:
        items.append(item.item)
        if len(items) == 2:
            break
    assert items == [2, 3]
    await sub.close()
    assert await stream.length() == 2


async def test_the_namespace_sets_and_the_dead_letter_stream_are_plain_commands_on_both(redis: Any) -> None:
    await _streams(redis, maxlen=None).stream("feed", "k").publish("x")
    assert {_text(k) for k in await redis.smembers(KEYS.stream_keys("feed"))} == {"k"}
    dead = KEYS.stream_dead_letters("feed")
    await redis.xadd(dead, {"key": "k", "token": "1-0", "error": "boom", "attempts": 5}, maxlen=10, approximate=True)
    ((_, fields),) = await redis.xrange(dead)
    assert _text(fields[b"token"]) == "1-0" and _text(fields[b"attempts"]) == "5"
