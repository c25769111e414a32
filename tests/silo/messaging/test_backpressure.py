"""Back-pressure: a caller over ``max_in_flight`` waits for a slot within each call's deadline.

The slot rules on the transport twin with a virtual clock (nothing sleeps),
then the whole path on real silos: 20,000 gathered calls on one grain from
one client complete, and a call that cannot get a slot in time gets
GrainTimeoutError without ever reaching the silo.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from silo import errors
from silo.client import ClusterClient
from silo.codec import Codec
from silo.messaging.frame import CANCEL, REQUEST, Frame
from silo.settings import ClientSettings, TransportSettings
from silo.silo import Silo
from silo.testing.clock import VirtualClock
from silo.testing.transport import InMemoryNetwork, InMemoryTransport
from tests.sample_grains import Echo

ClusterFactory = Callable[..., Awaitable[list[Silo]]]


class Holder:
    """Answers nothing until the test releases a request."""

    def __init__(self) -> None:
        self.held: list[tuple[Any, int]] = []

    def __call__(self, conn: Any, frame: Frame) -> None:
        if frame.header[0] != CANCEL:
            self.held.append((conn, frame.header[1]))

    def answer(self, i: int) -> None:
        conn, req_id = self.held[i]
        conn.send_response(req_id, "done")


def call() -> list[Any]:
    return [REQUEST, 0, "Echo", "x", "hold", 5000, [], 0]


@pytest.fixture
async def clock() -> AsyncIterator[VirtualClock]:
    with VirtualClock() as c:
        yield c


async def _pair(max_in_flight: int) -> tuple[Holder, Any, InMemoryTransport]:
    network, holder = InMemoryNetwork(), Holder()
    server = InMemoryTransport(TransportSettings(), Codec(), holder, network=network)
    port = await server.listen("127.0.0.1", 0)
    client = InMemoryTransport(TransportSettings(max_in_flight=max_in_flight), Codec(), network=network)
    return holder, await client.connect(f"127.0.0.1:{port}"), server


async def test_waiters_get_freed_slots_in_arrival_order(clock: VirtualClock) -> None:
    holder, conn, _ = await _pair(max_in_flight=1)
    first = conn.request(call(), [], 10.0)
    assert not conn.has_slot()
    order: list[str] = []

    async def waiter(name: str) -> None:
        await conn.wait_slot(clock.time() + 10.0)
        order.append(name)
        await conn.request(call(), [], 10.0)

    tasks = [asyncio.create_task(waiter(n)) for n in ("a", "b", "c")]
    await clock.settle()
    assert order == [] and len(holder.held) == 1
    for i in range(3):
        holder.answer(i)
        await clock.settle()
        assert order == ["a", "b", "c"][: i + 1]
        assert len(holder.held) == i + 2, "never more than max_in_flight outstanding"
    holder.answer(3)
    await asyncio.gather(*tasks)
    assert await first == "done" and conn.has_slot()


async def test_a_waiter_past_its_deadline_times_out_and_the_next_one_still_gets_the_slot(
    clock: VirtualClock,
) -> None:
    holder, conn, _ = await _pair(max_in_flight=1)
    conn.request(call(), [], 10.0)
    early = asyncio.create_task(conn.wait_slot(clock.time() + 1.0))
    late = asyncio.create_task(conn.wait_slot(clock.time() + 5.0))
    await clock.advance(1.5)
    with pytest.raises(TimeoutError):
        await early
    holder.answer(0)
    await clock.settle()
    assert late.done() and late.exception() is None  # the slot skipped the waiter that gave up
    conn.request(call(), [], 10.0)
    assert not conn.has_slot()


async def test_waiters_on_a_lost_connection_get_silo_unavailable_error(clock: VirtualClock) -> None:
    _, conn, server = await _pair(max_in_flight=1)
    conn.request(call(), [], 10.0)
    waiter = asyncio.create_task(conn.wait_slot(clock.time() + 10.0))
    await clock.settle()
    server.abort_all()
    await clock.settle()
    with pytest.raises(errors.SiloUnavailableError):
        await waiter


async def test_twenty_thousand_gathered_calls_on_one_grain_from_one_client_complete(
    cluster: ClusterFactory, client: ClusterClient
) -> None:
    """Twice the default max_in_flight (10,000): the second half waits for slots."""
    (silo,) = await cluster(1)
    grain = client.get_grain(Echo, "hot")
    await grain.echo(0)
    n = 20_000
    results = await asyncio.gather(*(grain.echo(i) for i in range(n)))
    assert results == list(range(n))
    assert silo.transport.statistics().overloaded == 0
    assert client.transport.statistics().pending_calls == 0


async def test_a_call_that_cannot_get_a_slot_before_its_deadline_gets_grain_timeout_error(
    cluster: ClusterFactory, redis_url: str, cluster_name: str
) -> None:
    (silo,) = await cluster(1)
    settings = ClientSettings(transport=TransportSettings(max_in_flight=2))
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=settings) as c:
        slow = [c.get_grain(Echo, f"slow{i}") for i in range(2)]
        late = c.get_grain(Echo, "late")
        for g in (*slow, late):
            await g.echo(0)
        requests = silo.dispatcher.statistics().requests
        busy = [asyncio.ensure_future(g.sleep(0.6)) for g in slow]
        await asyncio.sleep(0)  # both sent: the connection is at its limit
        with pytest.raises(errors.GrainTimeoutError) as caught:
            await late.with_timeout(0.2).echo("too late")
        assert caught.value.target == "Echo/late" and caught.value.method == "echo"
        assert silo.dispatcher.statistics().requests - requests == 2, "the late call never left the client"
        assert await asyncio.gather(*busy) == ["slept", "slept"]
        assert await late.echo("now") == "now"
