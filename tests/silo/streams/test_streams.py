"""Streams on Redis Streams: explicit subscriptions, resuming from a token, retention, bad items,
and delivery to ``@subscribes`` grains on silos in this process (the silo kill is in
test_stream_failover.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from grains import StreamItem, subscribes
from grains.base import Grain
from silo import errors
from silo.client import ClusterClient
from silo.keys import Keys
from silo.settings import ClientSettings, StreamSettings
from tests.silo.streams.grains import OrderLog, Picky, Publisher, Tick

GRAINS = ("tests.silo.streams.grains",)
FAST = StreamSettings(lease_s=1.5, discover_interval_s=0.1, block_ms=100)


@pytest.fixture
async def typed_client(redis_url: str, cluster_name: str) -> AsyncIterator[ClusterClient]:
    """A client whose codec knows the test's item type."""
    c = await ClusterClient.connect(redis_url, cluster=cluster_name, types=[Tick])
    yield c
    await c.close()


async def _eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.05)


async def test_100_items_published_arrive_in_order_at_an_explicit_subscriber(client: ClusterClient) -> None:
    stream = client.stream("feed", "room-1")
    got: list[StreamItem] = []
    async with stream.subscribe() as sub:  # from now: pinned here, before the first publish

        async def read() -> None:
            async for ev in sub:
                got.append(ev)
                if len(got) == 100:
                    break

        reader = asyncio.create_task(read())
        tokens = [await stream.publish({"n": i, "text": f"message {i}"}) for i in range(100)]
        await asyncio.wait_for(reader, 20)
    assert [ev.item["n"] for ev in got] == list(range(100))
    assert [ev.token for ev in got] == tokens
    # Tokens are Redis entry ids: they grow with each item.
    as_pairs = [tuple(map(int, t.split("-"))) for t in tokens]
    assert as_pairs == sorted(as_pairs) and len(set(as_pairs)) == 100


async def test_a_subscription_from_a_token_resumes_after_it(client: ClusterClient) -> None:
    stream = client.stream("feed", 42)  # an int key, as a grain key would be
    assert stream.key == "42"
    tokens = [await stream.publish(i) for i in range(10)]
    resumed: list[StreamItem] = []
    async for ev in stream.subscribe(from_token=tokens[4]):
        resumed.append(ev)
        if len(resumed) == 5:
            break
    assert [ev.item for ev in resumed] == [5, 6, 7, 8, 9]
    assert [ev.token for ev in resumed] == tokens[5:]
    everything = []
    async with stream.subscribe(from_start=True) as sub:
        async for ev in sub:
            everything.append(ev.item)
            if len(everything) == 10:
                await sub.close()  # the clean stop from inside: the loop ends at the next step
    assert everything == list(range(10))


async def test_closing_a_subscription_from_another_task_ends_its_loop(client: ClusterClient) -> None:
    sub = client.stream("feed", "quiet").subscribe()
    ended = asyncio.Event()

    async def read() -> None:
        async for _ in sub:
            pass
        ended.set()

    reader = asyncio.create_task(read())
    await asyncio.sleep(0)  # the reader is blocked in its first read (nothing is published)
    await sub.close()
    await asyncio.wait_for(ended.wait(), 5)
    await reader


async def test_retention_trims_to_maxlen_and_to_max_age(redis_url: str, cluster_name: str) -> None:
    settings = ClientSettings(
        redis_url=redis_url, cluster=cluster_name,
        streams=StreamSettings(maxlen=10, max_age_s=60, approximate_trim=False),
    )  # fmt: skip
    async with await ClusterClient.connect(settings=settings) as client:
        stream = client.stream("metrics", "cpu")
        for i in range(30):
            await stream.publish(i)
        assert await stream.length() == 10
        kept = []
        async for ev in stream.subscribe(from_start=True):
            kept.append(ev.item)
            if len(kept) == 10:
                break
        assert kept == list(range(20, 30))  # the oldest went first
        # Items from two and three minutes ago (written as a publish would have, with the ids
        # Redis gave them then), and one now: the max age of a minute trims the old ones.
        aged = client.stream("metrics", "disk")
        now_ms = int(time.time() * 1000)
        for ago_ms in (180_000, 120_000):
            await client.redis.xadd(client.keys.stream("metrics", "disk"), {"v": client.codec.dumps(ago_ms)}, id=f"{now_ms - ago_ms}-0")
        assert await aged.length() == 2
        token = await aged.publish("now")
        assert await aged.length() == 1
        async for ev in aged.subscribe(from_start=True):
            assert (ev.item, ev.token) == ("now", token)
            break


async def test_an_unencodable_item_is_refused_with_a_clear_error(client: ClusterClient, redis_url: str) -> None:
    stream = client.stream("feed", "bad")

    class NotRegistered:
        pass

    with pytest.raises(errors.CodecError, match=r"cannot publish to stream feed/bad: .*NotRegistered"):
        await stream.publish(NotRegistered())
    with pytest.raises(errors.CodecError, match="cannot publish to stream feed/bad"):
        await stream.publish({"fn": print})
    assert await stream.length() == 0  # nothing half-written
    with pytest.raises(ValueError, match="namespace"):
        client.stream("a:b", "k")
    with pytest.raises(ValueError, match="stream key"):
        client.stream("feed", 1.5)
    with pytest.raises(ValueError, match="not both"):
        stream.subscribe(from_start=True, from_token="1-0")
    with pytest.raises(ValueError, match="entry id"):
        stream.subscribe(from_token="yesterday")


async def test_an_item_the_subscriber_cannot_decode_names_its_token(
    typed_client: ClusterClient, client: ClusterClient
) -> None:
    token = await typed_client.stream("feed", "typed").publish(Tick(n=1))
    with pytest.raises(errors.CodecError, match=f"feed/typed item {token}: unknown wire type 'Tick'"):
        async for _ in client.stream("feed", "typed").subscribe(from_start=True):
            pass


def test_subscribes_needs_a_handler_and_a_good_namespace() -> None:
    with pytest.raises(TypeError, match="no on_stream_item"):

        @subscribes("x")
        class NoHandler(Grain):
            pass

    with pytest.raises(ValueError, match="namespace"):
        subscribes("a:b")


async def _seen(client: ClusterClient, key: str) -> list[int]:
    return list(await client.get_grain(OrderLog, key).seen())


async def test_an_implicit_subscriber_gets_every_item_in_order_per_key(
    cluster: Any, typed_client: ClusterClient, redis_url: str, cluster_name: str
) -> None:
    silos = await cluster(2, grains=GRAINS, streams=FAST)
    await typed_client.refresh()
    keys = [f"acct-{i}" for i in range(4)]
    streams = {k: typed_client.stream("orders", k) for k in keys}
    for n in range(25):  # interleaved across keys
        for k in keys:
            await streams[k].publish(Tick(n=n))

    async def all_seen() -> bool:
        return all([await _seen(typed_client, k) == list(range(25)) for k in keys])

    await _eventually(all_seen)
    tokens = [await typed_client.get_grain(OrderLog, k).tokens() for k in keys]
    assert all(t == sorted(t, key=lambda x: tuple(map(int, x.split("-")))) for t in tokens)
    stats = [a.statistics() for s in silos for a in s.stream_agents]
    assert sum(st.delivered for st in stats) == 100 and sum(st.failed for st in stats) == 0
    # Rendezvous spread the keys: each is held by exactly one silo (its lease says which).
    held = sum(st.keys_held for st in stats)
    assert held == 4
    k = Keys(cluster_name)
    holders = {await silos[0].redis.get(k.stream_lease("orders", key, "OrderLog")) for key in keys}
    assert holders <= {str(s.address).encode() for s in silos}
    # Everything acknowledged: the group has nothing pending.
    for key in keys:
        groups = await silos[0].redis.xinfo_groups(k.stream("orders", key))
        assert [(g["name"], g["pending"], g["lag"]) for g in groups] == [(b"OrderLog", 0, 0)]


async def test_an_item_the_grain_fails_on_is_skipped_and_the_key_goes_on(
    cluster: Any, client: ClusterClient, caplog: pytest.LogCaptureFixture
) -> None:
    (silo,) = await cluster(1, grains=GRAINS, streams=FAST)
    stream = client.stream("poison", "p")
    for i in range(6):
        await stream.publish(i)
    picky = client.get_grain(Picky, "p")

    async def evens() -> bool:
        return list(await picky.seen()) == [0, 2, 4]

    await _eventually(evens)

    async def counted() -> bool:
        return sum(a.statistics().failed for a in silo.stream_agents) == 3

    await _eventually(counted)
    assert "odd item 3" in caplog.text


async def test_a_grain_publishes_and_subscribes_through_self_stream(
    cluster: Any, typed_client: ClusterClient
) -> None:
    await cluster(2, grains=GRAINS, streams=FAST)
    await typed_client.refresh()
    pub = typed_client.get_grain(Publisher, "p")
    tokens = [await pub.publish("orders", "from-grain", n) for n in range(5)]
    assert await pub.read("orders", "from-grain", 5) == list(range(5))

    async def delivered() -> bool:
        return await typed_client.get_grain(OrderLog, "from-grain").tokens() == tokens

    await _eventually(delivered)  # a grain's publish reaches the implicit subscriber too


async def test_keys_move_to_a_joining_silo_and_back_without_losing_order(
    cluster: Any, typed_client: ClusterClient
) -> None:
    (first,) = await cluster(1, grains=GRAINS, streams=FAST)
    keys = [f"k{i}" for i in range(12)]
    streams = [typed_client.stream("orders", k) for k in keys]

    async def publish(numbers: range) -> None:
        for n in numbers:
            for s in streams:
                await s.publish(Tick(n=n))

    async def caught_up(count: int) -> bool:
        return all([len(await _seen(typed_client, k)) >= count for k in keys])

    await publish(range(10))
    (second,) = await cluster(1, grains=GRAINS, streams=FAST)  # while the first still delivers
    await publish(range(10, 20))
    await _eventually(lambda: caught_up(20))

    def held(silo: Any) -> int:
        return sum(a.statistics().keys_held for a in silo.stream_agents)

    async def balanced() -> bool:  # rendezvous gave the newcomer some keys, and it took them
        return held(first) + held(second) == 12 and held(second) > 0

    await _eventually(balanced)
    # A handed-over key was released only after its delivery in progress was acknowledged:
    # every item exactly once, in order.
    for k in keys:
        assert await _seen(typed_client, k) == list(range(20)), k

    await second.stop()  # graceful: its leases are handed back at once
    await publish(range(20, 30))
    await _eventually(lambda: caught_up(30))
    assert held(first) == 12
    for k in keys:
        seen = await _seen(typed_client, k)
        assert list(dict.fromkeys(seen)) == list(range(30)), (k, seen)
        assert all(b <= a + 1 for a, b in zip(seen, seen[1:], strict=False)), (k, seen)
