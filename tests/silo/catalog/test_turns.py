"""Turns on the twins: order, reentrancy, @interleave, @read_only, deadlocks. Nothing sleeps;
each test parks calls on gates and opens them in the order it wants to see."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from silo import errors
from silo.settings import CatalogSettings
from silo.testing.clock import VirtualClock
from silo.testing.harness import InProcessSilo
from tests.silo.catalog.grains import Latch, PingPong, ReentrantLatch, ReentrantPingPong


def _spawn(*coros: Coroutine[Any, Any, Any]) -> list[asyncio.Future[Any]]:
    return [asyncio.ensure_future(c) for c in coros]


async def test_calls_run_one_at_a_time_in_arrival_order(silo: InProcessSilo) -> None:
    latch = silo.get_grain(Latch, "l")
    assert await latch.step(-1) == -1  # activated: arrival order is send order from here
    results = await asyncio.gather(*(latch.step(i) for i in range(1000)))
    assert results == list(range(1000))
    grain = silo.instance(latch)
    assert grain.log == ["-1", *map(str, range(1000))]
    assert grain.most_running == 1


async def test_calls_that_arrive_while_the_grain_activates_keep_their_order(silo: InProcessSilo) -> None:
    latch = silo.get_grain(Latch, "fresh")
    results = await asyncio.gather(*(latch.step(i) for i in range(100)))
    assert results == list(range(100))
    assert silo.instance(latch).log == list(map(str, range(100)))


async def test_a_call_waits_for_the_running_turn(silo: InProcessSilo, clock: VirtualClock) -> None:
    latch = silo.get_grain(Latch, "l")
    a, b = _spawn(latch.hold("a"), latch.hold("b"))
    await clock.settle()
    grain = silo.instance(latch)
    assert grain.log == ["start a"]
    grain.open("b")  # b's gate opening lets nothing run: b has not started
    await clock.settle()
    assert grain.log == ["start a"] and not b.done()
    grain.open("a")
    assert await asyncio.gather(a, b) == ["a", "b"]
    assert grain.log == ["start a", "end a", "start b", "end b"]


async def test_reentrant_grain_interleaves_its_calls(silo: InProcessSilo, clock: VirtualClock) -> None:
    latch = silo.get_grain(ReentrantLatch, "r")
    a, b = _spawn(latch.hold("a"), latch.hold("b"))
    await clock.settle()
    grain = silo.instance(latch)
    assert grain.log == ["start a", "start b"]
    grain.open("b")
    assert await b == "b"
    assert not a.done()
    grain.open("a")
    assert await a == "a"
    assert grain.log == ["start a", "start b", "end b", "end a"]
    assert grain.most_running == 2


async def test_interleave_method_runs_while_a_turn_waits(silo: InProcessSilo, clock: VirtualClock) -> None:
    latch = silo.get_grain(Latch, "g")
    held, queued = _spawn(latch.hold("h"), latch.hold("q"))
    await clock.settle()
    grain = silo.instance(latch)
    grain.open("p")
    assert await latch.poke("p") == "p"  # got in beside the running turn, ahead of the queued one
    assert grain.log == ["start h", "start p", "end p"]
    assert not held.done() and not queued.done()
    grain.open("h", "q")
    assert await asyncio.gather(held, queued) == ["h", "q"]


async def test_read_only_calls_run_together_but_never_beside_a_writer(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    latch = silo.get_grain(Latch, "ro")
    await latch.step(0)
    grain = silo.instance(latch)
    grain.log.clear()
    calls = _spawn(latch.peek("r1"), latch.peek("r2"), latch.hold("w"), latch.peek("r3"), latch.peek("r4"))
    await clock.settle()
    assert grain.log == ["start r1", "start r2"]  # consecutive readers share one turn
    grain.open("w")
    await clock.settle()
    assert grain.log == ["start r1", "start r2"]  # the writer waits for both readers
    grain.open("r2")
    await clock.settle()
    assert grain.log == ["start r1", "start r2", "end r2"]
    grain.open("r1")
    assert await asyncio.gather(*calls[:3]) == ["r1", "r2", "w"]
    await clock.settle()
    assert grain.log == [
        "start r1", "start r2", "end r2", "end r1",
        "start w", "end w",
        "start r3", "start r4",
    ]  # fmt: skip
    grain.open("r3", "r4")
    assert await asyncio.gather(*calls[3:]) == ["r3", "r4"]


async def test_call_cycle_on_non_reentrant_grains_raises_deadlock_error(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    clock.autojump = True  # a hang would time out at once instead of blocking the test
    with pytest.raises(errors.DeadlockError) as info:
        await asyncio.wait_for(silo.get_grain(PingPong, "a").ping("b", 3), 10)
    assert "PingPong/a -> PingPong/b -> PingPong/a" in str(info.value)
    assert info.value.chain == ["PingPong/a", "PingPong/b"]
    with pytest.raises(errors.DeadlockError):
        await asyncio.wait_for(silo.get_grain(PingPong, "s").call_self(), 10)
    # Both grains still serve: the refused call never queued behind the turn it waited on.
    assert await silo.get_grain(PingPong, "a").ping("b", 0) == 0
    assert await silo.get_grain(PingPong, "b").ping("a", 1) == 1


async def test_call_cycle_on_reentrant_grains_completes(silo: InProcessSilo) -> None:
    assert await silo.get_grain(ReentrantPingPong, "a").ping("b", 5) == 5


async def test_a_two_way_call_shed_by_a_full_mailbox_is_sent_again_until_it_fits(
    make_silo: Callable[..., InProcessSilo], clock: VirtualClock
) -> None:
    # The in-process harness keeps the router's rule: shed unrun, backed off, sent again.
    silo = await make_silo(CatalogSettings(max_queue=2)).start()
    latch = silo.get_grain(Latch, "full")
    held = asyncio.ensure_future(latch.hold("h"))
    names = [f"q{i}" for i in range(5)]
    queued = [asyncio.ensure_future(latch.hold(name)) for name in names]  # two fit, three are shed
    try:
        await clock.advance(1.0)
        assert not any(q.done() for q in queued)  # shed ones wait (sent again), none failed
    finally:
        silo.instance(latch).open("h", *names)  # else stopping the silo would wait on the turn
    await clock.advance(2.0)
    assert await held == "h" and sorted(await asyncio.gather(*queued)) == names
