"""Streamed results (an async-generator grain method) mean the same at every distance: the
producer on the caller's silo, on another silo, called from a client, and in the in-process
harness (alone, and two silos over the transport twin).

- Items arrive in order, as copies; an error ends the stream and is caught by its type.
- The activation is busy while it streams (an ordinary call waits; an @interleave one does not).
- ``break``, ``aclose()``, a cancelled consumer and a per-item deadline stop the generator
  (its ``finally`` runs: GeneratorExit at a yield, CancelledError inside an await).
- Back-pressure: the producer never runs more than the window ahead of its consumer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from grains import Grain, one_way
from grains.call import Call
from grains.result_stream import ResultStream
from silo import errors
from silo.client import ClusterClient
from silo.codec import Codec
from silo.messaging.frame import CREDIT, ITEM, STREAM
from silo.messaging.router import Router
from silo.testing import InProcessCluster, InProcessSilo
from tests.stream_grains import (
    STOP_CHECKS,
    STREAM_CHECKS,
    Consumer,
    Producer,
    back_pressure,
    stop_checks,
    stream_checks,
)

GRAINS = ("tests.stream_grains",)
CLASSES = [Producer, Consumer]
WINDOW = 16  # TransportSettings.stream_window's default
ITEMS = 10_000


async def _place(two: InProcessCluster, consumer: Any, producer: Any) -> None:
    """``consumer`` on the first in-process silo, ``producer`` on the second."""
    a, b = two.silos
    assert isinstance(a.router, Router)
    await a.router.activate(consumer.grain_id, a.address)
    await a.router.activate(producer.grain_id, b.address)


# --- items, errors, copies, a busy activation ------------------------------------------------------


async def test_a_stream_from_a_grain_on_the_same_silo(cluster, client) -> None:
    (silo,) = await cluster(1, grains=GRAINS)
    assert await client.get_grain(Consumer, "c").run("p") == STREAM_CHECKS
    assert silo.router.statistics().local_calls >= 8


async def test_a_stream_from_a_grain_on_another_silo(cluster, client) -> None:
    a, b = await cluster(2, grains=GRAINS)
    consumer, producer = client.get_grain(Consumer, "c"), client.get_grain(Producer, "p")
    await client.router.activate(consumer.grain_id, a.address)
    await client.router.activate(producer.grain_id, b.address)
    assert await consumer.run("p") == STREAM_CHECKS
    assert a.router.statistics().local_calls == 0


async def test_a_stream_to_a_client(cluster, client) -> None:
    await cluster(1, grains=GRAINS)
    assert await stream_checks(client.get_grain(Producer, "p")) == STREAM_CHECKS


async def test_the_in_process_harness_streams_the_same() -> None:
    async with InProcessSilo(CLASSES) as silo:
        assert await stream_checks(silo.get_grain(Producer, "p")) == STREAM_CHECKS
        assert await silo.get_grain(Consumer, "c").run("q") == STREAM_CHECKS
    async with InProcessCluster(CLASSES, silos=2) as two:
        a = two.silos[0]
        consumer = a.get_grain(Consumer, "c")
        await _place(two, consumer, a.get_grain(Producer, "p"))
        assert await consumer.run("p") == STREAM_CHECKS
        assert await stream_checks(a.get_grain(Producer, "p")) == STREAM_CHECKS


# --- leaving early: break, aclose, cancel, the deadline -------------------------------------------


async def test_leaving_a_stream_stops_the_generator_on_the_same_silo(cluster, client) -> None:
    await cluster(1, grains=GRAINS)
    assert await client.get_grain(Consumer, "c").stop("p", WINDOW) == STOP_CHECKS


async def test_leaving_a_stream_stops_the_generator_on_another_silo(cluster, client) -> None:
    a, b = await cluster(2, grains=GRAINS)
    consumer, producer = client.get_grain(Consumer, "c"), client.get_grain(Producer, "p")
    await client.router.activate(consumer.grain_id, a.address)
    await client.router.activate(producer.grain_id, b.address)
    assert await consumer.stop("p", WINDOW) == STOP_CHECKS


async def test_a_client_leaving_a_stream_stops_the_generator(cluster, client) -> None:
    await cluster(1, grains=GRAINS)
    assert await stop_checks(client.get_grain(Producer, "p"), WINDOW) == STOP_CHECKS


async def test_the_in_process_harness_stops_the_generator_the_same_way() -> None:
    async with InProcessSilo(CLASSES) as silo:
        assert await stop_checks(silo.get_grain(Producer, "p"), WINDOW) == STOP_CHECKS
        assert await silo.get_grain(Consumer, "c").stop("q", WINDOW) == STOP_CHECKS
    async with InProcessCluster(CLASSES, silos=2) as two:
        a = two.silos[0]
        consumer = a.get_grain(Consumer, "c")
        await _place(two, consumer, a.get_grain(Producer, "p"))
        assert await consumer.stop("p", WINDOW) == STOP_CHECKS


# --- back-pressure ------------------------------------------------------------------------------------


async def test_a_slow_client_holds_the_producer_within_the_window(cluster, client) -> None:
    await cluster(1, grains=GRAINS)
    assert client.router.stream_window == WINDOW
    assert await back_pressure(client.get_grain(Producer, "p"), ITEMS, WINDOW) == [ITEMS, WINDOW, WINDOW]


async def test_a_slow_grain_holds_the_producer_within_the_window_across_silos(cluster, client) -> None:
    a, b = await cluster(2, grains=GRAINS)
    consumer, producer = client.get_grain(Consumer, "c"), client.get_grain(Producer, "p")
    await client.router.activate(consumer.grain_id, a.address)
    await client.router.activate(producer.grain_id, b.address)
    assert await consumer.back_pressure("p", ITEMS, WINDOW) == [ITEMS, WINDOW, WINDOW]


async def test_the_in_process_harness_holds_the_producer_within_the_window() -> None:
    async with InProcessSilo(CLASSES) as silo:
        # Same silo: the items are handed over without a connection, under the same credit.
        assert await back_pressure(silo.get_grain(Producer, "p"), ITEMS, WINDOW) == [ITEMS, WINDOW, WINDOW]
    async with InProcessCluster(CLASSES, silos=2) as two:
        a = two.silos[0]
        consumer = a.get_grain(Consumer, "c")
        await _place(two, consumer, a.get_grain(Producer, "p"))
        assert await consumer.back_pressure("p", ITEMS, WINDOW) == [ITEMS, WINDOW, WINDOW]


async def test_a_client_gone_mid_stream_stops_the_generator(cluster, client, redis_url, cluster_name) -> None:
    """Nobody will grant credit again: the generator must not wait for it forever (its activation
    would take no other call)."""
    await cluster(1, grains=GRAINS)
    leaving = await ClusterClient.connect(redis_url, cluster=cluster_name)
    stream = leaving.get_grain(Producer, "p").count(1000)
    assert await anext(stream) == 0
    await leaving.close()
    producer = client.get_grain(Producer, "p")
    assert await producer.with_timeout(10).wait_ended() == "closed"
    assert [x async for x in producer.count(2)] == [0, 1]
    # What came before the close, then its error: the client closed it, not the silo.
    with pytest.raises(errors.SiloClosedError):
        async for _ in stream:
            pass


async def test_a_stream_that_reaches_a_silo_not_owning_the_grain_is_relayed_from_the_owner() -> None:
    """The caller's router still names b; the grain lives on c now: b relays the stream, its
    items under the caller's credit (b's relay holds a window of its own, so the producer runs
    at most two windows ahead), and the caller leaving stops the generator on c."""
    async with InProcessCluster(CLASSES, silos=3) as three:
        a, b, c = three.silos
        producer = a.get_grain(Producer, "p")
        assert isinstance(a.router, Router)
        await a.router.activate(producer.grain_id, b.address)
        assert [x async for x in producer.count(3)] == [0, 1, 2]  # a's router remembers b
        await b.deactivate(producer)
        assert isinstance(c.router, Router)
        await c.router.activate(producer.grain_id, c.address)
        taken = 0
        async for x in producer.count(1000):
            assert x == taken
            taken += 1
            if taken % 50 == 0:
                assert await producer.progress() <= taken + 2 * WINDOW
        assert taken == 1000 and await producer.wait_ended() == "finished"
        assert b.dispatcher.statistics().forwarded >= 1 and three.silo_of(producer) is c
        async for x in producer.count(1000):
            if x == 2:
                break
        assert await producer.wait_ended() == "closed"
        assert [x async for x in producer.count(2)] == [0, 1]


async def test_an_interleaving_generator_lets_other_calls_run_between_its_items() -> None:
    async with InProcessSilo(CLASSES) as silo:
        producer = silo.get_grain(Producer, "p")
        stream = producer.beside(100)
        assert await anext(stream) == 0
        assert await producer.ordinary() == "ok"  # not queued behind the open stream
        assert [x async for x in stream] == list(range(1, 100))


async def test_a_by_name_reference_streams_and_a_mismatched_call_is_refused_clearly(cluster, client) -> None:
    await cluster(1, grains=GRAINS)
    await client.refresh()  # the manifests the silo published after the client connected
    by_name = client.get_grain("Producer", "p")  # methods and stream markers from the manifest
    assert [x async for x in by_name.count(3)] == [0, 1, 2]
    with pytest.raises(TypeError, match="is an async generator: iterate it"):
        await client.router.invoke(Call(by_name.grain_id, "count", (3,)))
    with pytest.raises(TypeError, match="is no async generator: await it"):
        async for _ in ResultStream(client.router, Call(by_name.grain_id, "ordinary", ())):
            pass


async def test_on_the_wire_items_go_only_against_credit_and_a_bad_credit_frame_drops_the_caller() -> None:
    async with InProcessCluster(CLASSES, silos=2) as two:
        a, b = two.silos
        producer = a.get_grain(Producer, "p")
        assert isinstance(a.router, Router)
        await a.router.activate(producer.grain_id, b.address)
        codec = Codec()
        peer = two.network.open_raw(b.address.endpoint)
        peer.write_frame([STREAM, 1, "Producer", "p", "count", 30_000, [], 0], codec.encode([100]).meta)

        def items() -> list[int]:
            return [codec.decode(f.meta) for f in peer.frames if f.header[:2] == [ITEM, 1]]

        for _ in range(10):  # round trips through b's loop: the generator gets no credit
            assert await producer.progress() == 0
        peer.write_frame([CREDIT, 1, 5])
        while len(items()) < 5:
            await producer.progress()
        for _ in range(10):
            assert await producer.progress() == 5
        assert items() == [0, 1, 2, 3, 4]
        peer.write_frame([CREDIT, 1, "many"])  # malformed: that connection is dropped ...
        assert await producer.wait_ended() == "closed"  # ... and with it the stream it opened
        assert peer.closed and [x async for x in producer.count(3)] == [0, 1, 2]
        assert b.dispatcher.statistics().streams == 2


def test_a_generator_cannot_be_one_way() -> None:
    with pytest.raises(TypeError, match="streams its results"):

        class Bad(Grain):
            @one_way
            async def items(self) -> AsyncIterator[int]:
                yield 1
