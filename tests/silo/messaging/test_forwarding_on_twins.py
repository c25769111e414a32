"""Calls between silos on the twins: three in-process silos with real routers and dispatchers
over the transport twin, one directory, membership table and store, and virtual time.

No Redis, no sockets, no sleeps: a call held in flight waits on a ``Gate`` the test opens,
deadlines and the routers' retries move with ``clock.advance``, and a silo's death is a kill
(its endpoint gone) followed by ``declare_dead`` (what the failure detector's vote does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from silo import errors
from silo.codec import Codec
from silo.messaging.frame import ERROR, PREFIX, REQUEST, RESPONSE
from silo.messaging.router import Router
from silo.messaging.wire_errors import error_from_body
from silo.testing.clock import VirtualClock
from silo.testing.harness import InProcessCluster, InProcessSilo
from tests.silo.messaging.grains import Gate, Tally, Where

CALL_TIMEOUT_S = 10.0


@pytest.fixture
async def clock() -> AsyncIterator[VirtualClock]:
    with VirtualClock() as c:
        yield c


@pytest.fixture
async def cluster(clock: VirtualClock) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster([Where, Gate, Tally], silos=3, clock=clock, call_timeout_s=CALL_TIMEOUT_S) as c:
        yield c


def router(silo: InProcessSilo) -> Router:
    """The silo's real router (on a network, an in-process silo has one)."""
    assert isinstance(silo.router, Router)
    return silo.router


async def placed(ref: Any, silo: InProcessSilo, via: InProcessSilo) -> None:
    """Activate ``ref``'s grain on ``silo`` (asked through ``via``'s router, as a move would)."""
    assert await router(via).activate(ref.grain_id, silo.address) == str(silo.address)


def start(coro: Any) -> asyncio.Task[Any]:
    return asyncio.ensure_future(coro)


async def test_a_call_to_a_grain_on_another_silo_goes_over_the_network_and_returns(
    cluster: InProcessCluster, clock: VirtualClock
) -> None:
    a, b, _ = cluster.silos
    ref = a.get_grain(Where, "w")
    await placed(ref, b, via=a)
    assert await ref.where() == str(b.address)
    sent = [1]
    assert await ref.keep(sent) == [1, 1] and sent == [1]  # the callee changed its own copy
    assert router(a).statistics().local_calls == 0 and b.dispatcher.statistics().requests == 3
    assert a.transport is not None and a.transport.statistics().frames_out >= 3
    assert cluster.silo_of(ref) is b


async def test_a_call_that_reaches_a_silo_not_owning_the_grain_is_forwarded_to_the_owner(
    cluster: InProcessCluster, clock: VirtualClock
) -> None:
    a, b, c = cluster.silos
    ref = a.get_grain(Where, "w")
    await placed(ref, b, via=a)
    assert await ref.where() == str(b.address)  # a's router now remembers b
    await b.deactivate(ref)
    await placed(ref, c, via=c)  # meanwhile someone else activated it on c
    assert await ref.where() == str(c.address)  # a sent it to b, b forwarded it to c
    assert b.dispatcher.statistics().forwarded == 1 and b.activation(ref) is None
    assert cluster.silo_of(ref) is c


async def _forwarded_by_b(cluster: InProcessCluster, clock: VirtualClock) -> tuple[Any, Gate]:
    """A reference on a whose router still names b, while the grain lives on c: b forwards."""
    a, b, c = cluster.silos
    ref = a.get_grain(Gate, "g")
    await placed(ref, b, via=a)
    warm = start(ref.hold("warm"))
    await clock.settle()
    b.instance(ref).open("warm")
    assert await warm == f"warm@{b.address}"  # a's router now remembers b
    await b.deactivate(ref)
    await placed(ref, c, via=c)
    return ref, c.instance(ref)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_a_callers_cancellation_reaches_the_callee_through_a_forwarding_silo(
    cluster: InProcessCluster, clock: VirtualClock, how: str
) -> None:
    """a -> b (not the owner) -> c: the CANCEL that reaches b (a cancelled caller, or a's
    deadline) cancels b's forwarding call, which sends c its own CANCEL: the running turn is
    cancelled and the queued call dropped, as when a calls c directly."""
    _, b, c = cluster.silos
    ref, gate = await _forwarded_by_b(cluster, clock)
    if how == "deadline":
        ref = ref.with_timeout(2.0)
    running, queued = start(ref.hold("running")), start(ref.hold("queued"))
    await clock.settle()
    try:
        assert gate.started == ["running"] and b.dispatcher.statistics().forwarded == 2
        if how == "cancel":
            running.cancel()
            queued.cancel()
            await clock.settle()
            for call in (running, queued):
                with pytest.raises(asyncio.CancelledError):
                    await call
        else:
            await clock.advance(2.1)
            for call in (running, queued):
                with pytest.raises(errors.GrainTimeoutError):
                    await call
        assert gate.cancelled == ["running"]  # b's CANCEL reached c and stopped the running turn
        gate.open("queued")
        after = start(ref.with_timeout(CALL_TIMEOUT_S).hold("after"))
        await clock.settle()
        assert gate.started == ["running", "after"]  # the queued call was dropped unrun
        gate.open("after")
        assert await after == f"after@{c.address}"
        assert b.dispatcher.statistics().in_flight == 0
    finally:
        gate.open("running", "queued", "after")  # nothing held when the cluster stops


@pytest.mark.parametrize("how", ["cancel", "deadline"])
@pytest.mark.parametrize("items", [0, 1])
async def test_a_callers_cancellation_stops_a_stream_relayed_by_a_forwarding_silo(
    cluster: InProcessCluster, clock: VirtualClock, how: str, items: int
) -> None:
    """The same for a streamed result, before its first item (b still opening it on c) and
    after it (b relaying items): the generator on c is stopped, and the grain serves again."""
    _, b, c = cluster.silos
    ref, gate = await _forwarded_by_b(cluster, clock)
    if how == "deadline":
        ref = ref.with_timeout(2.0)
    got: list[str] = []

    async def consume() -> None:
        async for item in ref.flow("s"):
            got.append(item)

    consumer = start(consume())
    await clock.settle()
    try:
        if items:
            gate.open("s")
            await clock.settle()
        assert gate.started == ["s"] and got == ["s"] * items and b.dispatcher.statistics().forwarded == 1
        if how == "cancel":
            consumer.cancel()
            await clock.settle()
            with pytest.raises(asyncio.CancelledError):
                await consumer
        else:
            await clock.advance(2.1)
            with pytest.raises(errors.GrainTimeoutError):
                await consumer
        assert gate.cancelled == ["s"]  # the generator on c was stopped
        after = start(ref.with_timeout(CALL_TIMEOUT_S).hold("after"))
        await clock.settle()
        gate.open("after")
        assert await after == f"after@{c.address}"
        assert b.dispatcher.statistics().in_flight == 0
    finally:
        gate.open("s", "s+", "after")


async def test_calls_queued_on_a_grain_deactivated_on_b_are_rerouted_never_dropped(
    cluster: InProcessCluster, clock: VirtualClock
) -> None:
    a, b, _ = cluster.silos
    ref = a.get_grain(Gate, "g")
    await placed(ref, b, via=a)
    old = b.instance(ref)
    first, second, third = start(ref.hold("one")), start(ref.hold("two")), start(ref.hold("three"))
    await clock.settle()
    assert old.started == ["one"]  # two and three wait in the mailbox on b
    deactivation = start(b.deactivate(ref))
    await clock.settle()
    old.open("one")
    await clock.settle()
    assert deactivation.done() and await first == f"one@{b.address}"
    new = b.instance(ref)  # the re-routed calls activated the grain again
    assert new is not old and new.started == ["two"]
    new.open("two", "three")
    assert [await second, await third] == [f"two@{b.address}", f"three@{b.address}"]
    assert b.dispatcher.statistics().rerouted == 2


async def test_calls_queued_on_a_stopping_silo_are_rerouted_to_another(
    cluster: InProcessCluster, clock: VirtualClock
) -> None:
    a, b, _ = cluster.silos
    ref = a.get_grain(Gate, "g")
    await placed(ref, b, via=a)
    gate = b.instance(ref)
    first, second = start(ref.hold("one")), start(ref.hold("two"))
    await clock.settle()
    stopping = start(b.stop())
    await clock.settle()
    gate.open("one")
    await clock.settle()
    assert await first == f"one@{b.address}"
    # b turned "two" away (draining); a's router retries until its view stops placing on b.
    await clock.advance(3.0)
    assert stopping.done() and not second.done()
    assert b.dispatcher.statistics().rerouted == 1 and b.dispatcher.statistics().errors == 1
    owner = cluster.silo_of(ref)
    assert owner is not None and owner is not b
    owner.instance(ref).open("two")
    assert await second == f"two@{owner.address}"
    assert router(a).statistics().retries >= 1


async def test_a_call_past_its_deadline_times_out_at_the_caller_and_is_cancelled_at_the_callee(
    cluster: InProcessCluster, clock: VirtualClock
) -> None:
    a, b, _ = cluster.silos
    ref = a.get_grain(Gate, "g")
    await placed(ref, b, via=a)
    gate = b.instance(ref)
    call = start(ref.with_timeout(2.0).hold("slow"))
    await clock.advance(1.9)
    assert not call.done() and gate.started == ["slow"]
    await clock.advance(0.2)
    with pytest.raises(errors.GrainTimeoutError):
        await call
    assert gate.cancelled == ["slow"]  # the CANCEL reached b and stopped the running turn
    nxt = start(ref.hold("next"))
    await clock.settle()
    gate.open("next")
    assert await nxt == f"next@{b.address}"


async def test_a_killed_silo_fails_calls_in_flight_and_its_grains_come_back_on_a_survivor(
    cluster: InProcessCluster, clock: VirtualClock
) -> None:
    a, b, _ = cluster.silos
    tally, gate = a.get_grain(Tally, "t"), a.get_grain(Gate, "g")
    await placed(tally, b, via=a)
    await placed(gate, b, via=a)
    assert await tally.add(1) == 1
    held = start(gate.hold("x"))
    await clock.settle()
    assert b.instance(gate).started == ["x"]
    await cluster.kill(b)
    await clock.settle()
    with pytest.raises(errors.SiloUnavailableError):
        await held  # delivered, then lost: not retried (the method may have run)
    await cluster.declare_dead(b)
    assert await tally.add(1) == 2  # re-activated with the state b wrote
    assert await tally.where() != str(b.address)
    assert cluster.silo_of(tally) not in (None, b)


async def test_a_call_to_a_killed_silo_is_retried_until_it_is_declared_dead(
    cluster: InProcessCluster, clock: VirtualClock
) -> None:
    a, b, _ = cluster.silos
    ref = a.get_grain(Where, "w")
    await placed(ref, b, via=a)
    await cluster.kill(b)
    call = start(ref.where())
    await clock.advance(1.0)
    assert not call.done()  # refused each time: never delivered, so a keeps trying
    await cluster.declare_dead(b)
    await clock.advance(0.5)
    assert await call != str(b.address)
    assert router(a).statistics().retries >= 2


async def test_a_dead_silos_cached_locations_are_skipped_not_swept_and_its_grains_come_back(
    cluster: InProcessCluster, clock: VirtualClock
) -> None:
    a, b, _ = cluster.silos
    refs = [a.get_grain(Where, f"w{i}") for i in range(3)]
    for ref in refs:
        await placed(ref, b, via=a)
        assert await ref.where() == str(b.address)
    cached = router(a).statistics().cached_locations
    assert cached >= len(refs)
    await cluster.kill(b)
    await cluster.declare_dead(b)
    # A death costs the survivors' loops nothing: the cache (up to a million grains) is not walked.
    assert router(a).statistics().cached_locations == cached
    for ref in refs:
        assert await ref.where() != str(b.address)  # the stale location is skipped, then replaced
    assert router(a).statistics().cached_locations == cached


async def test_bad_requests_get_a_codec_error_answer_and_the_silo_keeps_serving(
    cluster: InProcessCluster, clock: VirtualClock
) -> None:
    a, b, _ = cluster.silos
    ref = a.get_grain(Where, "w")
    await placed(ref, b, via=a)
    assert b.transport is not None
    codec = Codec()
    no_args = codec.encode([]).meta
    fields = ["Where", "w", "where", 5000, [], 0]
    peer = cluster.network.open_raw(b.address.endpoint)
    peer.write_frame([REQUEST, 1, "Where", "w", "where", "soon", [], 0], no_args)  # timeout not a number
    peer.write_frame([REQUEST, 2, "Where"], no_args)  # fields missing
    peer.write_frame([REQUEST, 3, *fields], codec.encode(42).meta)  # body not an argument tuple
    peer.write_frame([REQUEST, 4, *fields], b"\xc1")  # body not msgpack
    peer.write_frame([REQUEST, 5, *fields], no_args)  # and a good one, on the same connection
    await clock.settle()
    answers = {f.header[1]: (f.header[0], codec.decode(f.meta)) for f in peer.frames[1:]}  # [0]: HELLO
    for req_id in (1, 2, 3, 4):
        kind, body = answers[req_id]
        assert kind == ERROR and isinstance(error_from_body(body), errors.CodecError)
    assert answers[5] == (RESPONSE, str(b.address)) and not peer.closed
    assert b.dispatcher.statistics().errors == 4
    peer.write(PREFIX.pack(3, 0, 0) + b"\xc1\xc1\xc1")  # a header that is no msgpack: not a frame at all
    await clock.settle()
    assert peer.closed and b.transport.statistics().bad_frames == 1  # that one connection is dropped
    assert await ref.where() == str(b.address)  # every other caller is served as before
