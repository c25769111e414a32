"""Streams without silent loss: an item no turn takes goes to the namespace's dead-letter stream
after ``max_attempts`` (and its key goes on), trimming that overtakes a subscriber is counted and
told to it, retention by age runs on the silos' timer, stale namespace entries are pruned."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from grains import Grain, subscribes
from silo import errors
from silo.client import ClusterClient
from silo.keys import Keys
from silo.settings import ClientSettings, StreamSettings
from tests.silo.streams.grains import Filtered, Gappy, Picky, Stuck

GRAINS = ("tests.silo.streams.grains",)
FAST = StreamSettings(lease_s=1.5, discover_interval_s=0.1, block_ms=100)


async def _eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.05)


def _text(fields: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in fields.items() if k != b"v"}


async def test_a_slow_item_goes_to_the_dead_letters_after_its_attempts_and_its_key_goes_on(
    cluster: Any, client: ClusterClient, cluster_name: str
) -> None:
    settings = FAST.model_copy(update={"delivery_timeout_s": 0.3, "max_attempts": 3})
    (silo,) = await cluster(1, grains=GRAINS, streams=settings)
    stream = client.stream("slow", "s")
    tokens = [await stream.publish(i) for i in range(5)]
    stuck = client.get_grain(Stuck, "s")

    async def the_rest() -> bool:
        return list(await stuck.seen()) == [0, 2, 3, 4]

    await _eventually(the_rest)
    (stats,) = [a.statistics() for a in silo.stream_agents if a.namespace == "slow"]
    assert (stats.delivered, stats.failed, stats.dead_lettered, stats.retries) == (4, 1, 1, 2)
    dead = await client.redis.xrange(Keys(cluster_name).stream_dead_letters("slow"))
    assert len(dead) == 1
    fields = dead[0][1]
    assert client.codec.loads(fields[b"v"]) == 1  # the item itself is kept
    shown = _text(fields)
    assert (shown["key"], shown["group"], shown["token"], shown["attempts"]) == ("s", "Stuck", tokens[1], "3")
    assert shown["error"].startswith("GrainTimeoutError")
    # Acknowledged: the group has nothing pending, so no silo delivers it again.
    groups = await client.redis.xinfo_groups(Keys(cluster_name).stream("slow", "s"))
    assert [(g["name"], g["pending"]) for g in groups] == [(b"Stuck", 0)]


async def test_an_item_the_grain_raises_on_is_retried_then_kept_as_a_dead_letter(
    cluster: Any, client: ClusterClient, cluster_name: str
) -> None:
    settings = FAST.model_copy(update={"max_attempts": 2})
    (silo,) = await cluster(1, grains=GRAINS, streams=settings)
    stream = client.stream("poison", "q")
    for i in range(4):
        await stream.publish(i)

    async def all_dead() -> bool:
        return int(await client.redis.xlen(Keys(cluster_name).stream_dead_letters("poison"))) == 2

    await _eventually(all_dead)
    assert list(await client.get_grain(Picky, "q").seen()) == [0, 2]
    dead = await client.redis.xrange(Keys(cluster_name).stream_dead_letters("poison"))
    assert [client.codec.loads(f[b"v"]) for _, f in dead] == [1, 3]
    assert [_text(f)["error"] for _, f in dead] == ["ValueError: odd item 1", "ValueError: odd item 3"]
    (stats,) = [a.statistics() for a in silo.stream_agents if a.namespace == "poison"]
    assert (stats.failed, stats.dead_lettered, stats.retries) == (2, 2, 2)


async def test_trimming_that_overtakes_a_subscriber_is_counted_and_told_to_its_grain(
    cluster: Any, redis_url: str, cluster_name: str
) -> None:
    retention = FAST.model_copy(update={"maxlen": 5, "approximate_trim": False})
    settings = ClientSettings(redis_url=redis_url, cluster=cluster_name, streams=retention)
    async with await ClusterClient.connect(settings=settings) as client:
        stream = client.stream("gappy", "g")
        gappy = client.get_grain(Gappy, "g")
        (first,) = await cluster(1, grains=GRAINS, streams=retention)
        tokens = [await stream.publish(i) for i in range(3)]

        async def log_is(expected: list[str]) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return list(await gappy.log()) == expected

            return check

        await _eventually(await log_is(["0", "1", "2"]))
        await first.stop()  # nobody delivers while 17 more are published, 12 of them trimmed unread
        tokens += [await stream.publish(i) for i in range(3, 20)]
        # And a key whose burst overran maxlen before any silo delivered it.
        late = [await client.stream("gappy", "late").publish(i) for i in range(8)]
        (second,) = await cluster(1, grains=GRAINS, streams=retention)
        gap = f"gap gappy/g after={tokens[2]} before={tokens[15]} lost=12"
        await _eventually(await log_is(["0", "1", "2", gap, "15", "16", "17", "18", "19"]))
        (stats,) = [a.statistics() for a in second.stream_agents if a.namespace == "gappy"]
        expected = [f"gap gappy/late after=0-0 before={late[3]} lost=3", "3", "4", "5", "6", "7"]

        async def late_log() -> bool:
            return list(await client.get_grain(Gappy, "late").log()) == expected

        await _eventually(late_log)
        (stats,) = [a.statistics() for a in second.stream_agents if a.namespace == "gappy"]
        assert (stats.trimmed, stats.gaps, stats.delivered) == (12 + 3, 2, 5 + 5)


async def test_incoming_filters_see_stream_deliveries(cluster: Any, client: ClusterClient, cluster_name: str) -> None:
    await cluster(1, grains=GRAINS, streams=FAST.model_copy(update={"max_attempts": 1}))
    stream = client.stream("filtered", "f")
    for i in (12, 13, 14):
        await stream.publish(i)
    grain = client.get_grain(Filtered, "f")

    async def dead() -> bool:
        return int(await client.redis.xlen(Keys(cluster_name).stream_dead_letters("filtered"))) == 1

    async def the_others() -> bool:
        return list(await grain.seen()) == [12, 14]

    await _eventually(dead)
    await _eventually(the_others)
    (_, fields), = await client.redis.xrange(Keys(cluster_name).stream_dead_letters("filtered"))
    assert _text(fields)["error"] == "PermissionError: 13 is refused by the filter"
    assert list(await grain.methods())[:3] == ["__stream__"] * 3


def test_a_subscribes_handler_with_the_wrong_signature_is_refused_at_class_definition() -> None:
    with pytest.raises(TypeError, match=r"Bad\.on_stream_item must be `async def on_stream_item\(self, item, token\)`: too many positional"):

        @subscribes("x")
        class Bad(Grain):
            async def on_stream_item(self, item: int) -> None: ...

    with pytest.raises(TypeError, match=r"Sync\.on_stream_item must be `async def.*not a coroutine function"):

        @subscribes("x")
        class Sync(Grain):
            def on_stream_item(self, item: int, token: str) -> None: ...  # type: ignore[override]

    with pytest.raises(TypeError, match=r"Keyword\.on_stream_item must be.*missing a required argument: .extra."):

        @subscribes("x")
        class Keyword(Grain):
            async def on_stream_item(self, item: int, token: str, *, extra: int) -> None: ...  # type: ignore[override]

    with pytest.raises(TypeError, match=r"GapBad\.on_stream_gap must be `async def on_stream_gap\(self, gap\)`"):

        @subscribes("x")
        class GapBad(Grain):
            async def on_stream_item(self, item: int, token: str) -> None: ...

            async def on_stream_gap(self) -> None: ...  # type: ignore[override]

    @subscribes("x")
    class Fine(Grain):  # defaults and *args are fine: the runtime passes two positionals
        async def on_stream_item(self, item: int, *rest: Any, flag: bool = False) -> None: ...

    assert Fine.__rg_subscribes__ == ("x",)  # type: ignore[attr-defined]


async def test_silos_trim_by_age_on_a_timer_and_prune_what_streams_leave_behind(
    cluster: Any, client: ClusterClient, cluster_name: str
) -> None:
    k = Keys(cluster_name)
    now_ms = int(time.time() * 1000)

    async def published(ns: str, key: str, *ages_ms: int) -> None:
        """Items written as a publish would have written them that long ago (nobody publishes since)."""
        await client.redis.sadd(k.stream_namespaces, ns)
        await client.redis.sadd(k.stream_keys(ns), key)
        for age in ages_ms:
            await client.redis.xadd(k.stream(ns, key), {"v": client.codec.dumps(age)}, id=f"{now_ms - age}-0")

    await published("metrics", "old", 180_000, 120_000)  # every item too old: the stream goes
    await published("metrics", "mixed", 180_000, 1_000)  # one item kept
    await published("quiet", "a", 300_000)  # the namespace's only key goes, and the namespace
    await client.redis.sadd(k.stream_keys("metrics"), "never-written")  # a set entry with no stream
    # A subscriber's group that has not read its stream keeps it (its gap is still owed to it).
    await published("owed", "o", 200_000)
    await client.redis.xgroup_create(k.stream("owed", "o"), "Someone", id="0", entries_read=0)

    settings = FAST.model_copy(update={"max_age_s": 60.0, "retention_interval_s": 0.1})
    (silo,) = await cluster(1, grains=GRAINS, streams=settings)

    async def swept() -> bool:
        return silo.stream_retention.statistics().sweeps >= 2

    await _eventually(swept)
    assert await client.redis.smembers(k.stream_namespaces) == {b"metrics", b"owed"}
    assert await client.redis.smembers(k.stream_keys("metrics")) == {b"mixed"}
    assert not await client.redis.exists(k.stream("metrics", "old"), k.stream("quiet", "a"))
    # Approximate trimming (the default) drops whole nodes: an old item beside a young one may stay.
    kept = await client.redis.xrange(k.stream("metrics", "mixed"))
    assert [client.codec.loads(f[b"v"]) for _, f in kept] == [180_000, 1_000]
    assert await client.redis.xlen(k.stream("owed", "o")) == 0 and await client.redis.exists(k.stream("owed", "o"))
    stats = silo.stream_retention.statistics()
    assert (stats.trimmed, stats.streams_deleted, stats.keys_pruned, stats.namespaces_pruned) == (4, 2, 3, 1)
    # A publish after the sweep finds its stream again: sets and stream come back together.
    await client.stream("quiet", "a").publish("again")
    assert await client.redis.smembers(k.stream_keys("quiet")) == {b"a"}


async def test_trimming_that_overtakes_an_explicit_subscription_raises_the_gap_and_it_goes_on(
    redis_url: str, cluster_name: str
) -> None:
    retention = StreamSettings(maxlen=5, approximate_trim=False, block_ms=100)
    settings = ClientSettings(redis_url=redis_url, cluster=cluster_name, streams=retention)
    async with await ClusterClient.connect(settings=settings) as client:
        stream = client.stream("feed", "fast")
        tokens = [await stream.publish(i) for i in range(3)]
        sub = stream.subscribe(from_start=True)
        assert [(await anext(sub)).item for _ in range(3)] == [0, 1, 2]
        tokens += [await stream.publish(i) for i in range(3, 13)]  # keeps 8..12: 3..7 trimmed unread
        with pytest.raises(errors.StreamGapError) as caught:
            await anext(sub)
        gap = caught.value
        assert (gap.after, gap.before, gap.lost) == (tokens[2], tokens[8], 5)
        assert str(gap) == f"stream feed/fast: 5 items after {tokens[2]} and before {tokens[8]} were trimmed unread"
        assert [(await anext(sub)).item for _ in range(5)] == [8, 9, 10, 11, 12]  # and it goes on
        # A subscription "from now" counts from its pin; "from the start" is owed only what is kept.
        async with stream.subscribe() as later:
            for i in range(13, 20):
                await stream.publish(i)  # keeps 15..19
            with pytest.raises(errors.StreamGapError, match="2 items after"):
                await anext(later)
            assert (await anext(later)).item == 15
        fresh = stream.subscribe(from_start=True)
        assert [(await anext(fresh)).item for _ in range(5)] == [15, 16, 17, 18, 19]
