"""Deactivation on the twins: queued calls are re-routed (never dropped, never hung), idle
activations are collected by virtual time, state survives. Nothing sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from grains.base import DeactivationReason
from silo import errors
from silo.settings import CatalogSettings
from silo.testing.clock import VirtualClock
from silo.testing.harness import InProcessSilo
from tests.silo.catalog.grains import Brief, Latch, Lifecycle, Resident


async def test_calls_queued_behind_a_deactivation_are_rerouted_to_a_new_activation(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    clock.autojump = True  # a dropped call would time out at once instead of hanging the test
    latch = silo.get_grain(Latch, "q")
    held = asyncio.ensure_future(latch.hold("h"))
    queued = [asyncio.ensure_future(latch.step(i)) for i in range(50)]
    await clock.settle()
    old, old_grain = silo.activation(latch), silo.instance(latch)
    assert old is not None and old.queue_length == 50
    leaving = asyncio.ensure_future(silo.catalog.deactivate(old, DeactivationReason.REQUESTED))
    await clock.settle()
    # Calls that arrive while it deactivates wait for it to go, then follow the queued ones.
    late = [asyncio.ensure_future(latch.step(i)) for i in range(50, 60)]
    await clock.settle()
    assert not leaving.done() and old.queue_length == 0  # handed back, waiting for the running turn
    old_grain.open("h")
    assert await asyncio.wait_for(held, 10) == "h"  # the running turn finishes on the old activation
    results = await asyncio.wait_for(asyncio.gather(*queued, *late), 10)
    assert results == list(range(60))
    await leaving
    new, new_grain = silo.activation(latch), silo.instance(latch)
    assert new is not None and new is not old and new.activation_id != old.activation_id
    assert old_grain.log == ["start h", "end h"]  # nothing else ran on the leaving activation
    assert sorted(new_grain.log, key=int) == list(map(str, range(60)))
    # Each group keeps its order (the late ones may go first: they waited for the old one to go,
    # and that wakes them before the queued ones are handed back).
    log = [int(x) for x in new_grain.log]
    assert [i for i in log if i < 50] == list(range(50))
    assert [i for i in log if i >= 50] == list(range(50, 60))
    assert silo.dispatcher.statistics().rerouted >= 50


async def test_idle_activation_is_collected_after_its_timeout_and_reactivated_with_its_state(
    make_silo: Callable[..., InProcessSilo], clock: VirtualClock
) -> None:
    silo = await make_silo(CatalogSettings(idle_timeout_s=60, collection_interval_s=3600)).start()
    life = silo.get_grain(Lifecycle, "x")
    assert await life.counts() == (1, 0)
    act = silo.activation(life)
    assert act is not None
    await clock.advance(59.9)
    assert silo.catalog.collect_idle() == 0
    assert await life.counts() == (1, 0)  # a call is a use: the 60 s start again
    await clock.advance(59.9)
    assert silo.catalog.collect_idle() == 0
    # 0.2 past, not 0.1: the clock's base varies per run, and 59.9 + 0.1 in floats can land a
    # hair under 60 s after the last use (seen once in a full run).
    await clock.advance(0.2)
    assert silo.catalog.collect_idle() == 1
    await act.deactivated.wait()
    assert silo.activation(life) is None
    assert await life.counts() == (2, 1)  # on_deactivate wrote its count; a new activation read it


async def test_the_collector_sweeps_on_its_interval_and_spares_keep_alive_grains(
    make_silo: Callable[..., InProcessSilo], clock: VirtualClock
) -> None:
    silo = await make_silo(CatalogSettings(idle_timeout_s=30, collection_interval_s=10)).start()
    brief, life, resident = silo.get_grain(Brief, "b"), silo.get_grain(Lifecycle, "l"), silo.get_grain(Resident, "r")
    await asyncio.gather(brief.ping(), life.counts(), resident.ping())
    await clock.advance(9.9)
    assert silo.activation(brief) is not None
    await clock.advance(0.1)  # first sweep at 10 s: Brief's own 5 s timeout has passed
    assert silo.activation(brief) is None
    assert silo.activation(life) is not None
    await clock.advance(20)  # sweep at 30 s: Lifecycle idle for 30 s
    assert silo.activation(life) is None
    await clock.advance(3600)
    assert silo.activation(resident) is not None  # @keep_alive: never collected
    assert silo.catalog.statistics().deactivated_total == 2


async def test_busy_activation_is_not_collected(
    make_silo: Callable[..., InProcessSilo], clock: VirtualClock
) -> None:
    silo = await make_silo(CatalogSettings(idle_timeout_s=30, collection_interval_s=3600)).start()
    latch = silo.get_grain(Latch, "busy")
    # Its deadline outlasts the virtual 120 s: an in-process call's deadline holds, as a remote one's.
    held = asyncio.ensure_future(latch.with_timeout(600).hold("h"))
    await clock.advance(120)
    assert silo.catalog.collect_idle() == 0
    silo.instance(latch).open("h")
    assert await held == "h"
    await clock.advance(30)
    assert silo.catalog.collect_idle() == 1


async def test_a_deactivation_in_flight_when_the_silo_is_declared_dead_ends_with_the_silos_stop(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    # The simulator's seed 144 of `silo`: a zombie's refused write started a deactivation, the
    # silo learnt it was dead, and the deactivation (its unregister in Redis) outlived the stop.
    clock.autojump = True
    latch = silo.get_grain(Latch, "d")
    held = asyncio.ensure_future(latch.hold("h"))
    queued = [asyncio.ensure_future(latch.step(i)) for i in range(3)]
    await clock.settle()
    act = silo.activation(latch)
    assert act is not None and act.queue_length == 3
    silo.catalog.schedule_deactivation(act, DeactivationReason.REQUESTED)
    await clock.settle()
    leaving = [t for t in asyncio.all_tasks() if "Catalog.deactivate" in repr(t.get_coro())]
    assert len(leaving) == 1 and not act.deactivated.is_set()  # waiting for the running turn
    silo.catalog.drop_all_nowait()  # declared dead: stop serving, touch nothing in Redis
    await silo.catalog.stop()
    assert leaving[0].done() and act.deactivated.is_set()
    # The calls it had taken from the mailbox end too (failed here; a caller may retry elsewhere).
    _, pending = await asyncio.wait([held, *queued], timeout=60)
    assert not pending


async def test_a_turn_still_running_when_the_deactivation_times_out_is_cancelled_and_its_caller_told(
    make_silo: Callable[..., InProcessSilo], clock: VirtualClock
) -> None:
    # A CI run: a serving grain's timer tick still awaited a call when its silo stopped; the
    # deactivation went on "anyway", the turn outlived the silo and the test's loop, and a later
    # test's garbage collection closed its coroutine (an unraisable error there).
    silo = await make_silo(CatalogSettings(deactivation_timeout_s=5)).start()
    latch = silo.get_grain(Latch, "stuck")
    held = asyncio.ensure_future(latch.with_timeout(600).hold("never"))
    read = asyncio.ensure_future(latch.with_timeout(600).peek("never"))  # a turn in a task of its own
    await clock.settle()
    act, grain = silo.activation(latch), silo.instance(latch)
    assert act is not None and grain.running == 1
    leaving = asyncio.ensure_future(silo.catalog.deactivate(act, DeactivationReason.REQUESTED))
    await clock.advance(4.9)
    assert not leaving.done() and not held.done()  # the turn has its deactivation_timeout_s
    await clock.advance(0.2)
    assert leaving.done() and held.done()
    await leaving
    with pytest.raises(errors.GrainDeactivatedError, match="ran past 5s"):
        await held
    assert grain.running == 0 and grain.log == ["start never"]  # cancelled: its finally ran, no end
    assert act.deactivated.is_set() and not act.busy
    # The read-only call queued behind it never started: re-routed to a new activation, where it waits.
    assert not read.done() and silo.activation(latch) not in (None, act)
    silo.instance(latch).open("never")
    await clock.settle()
    assert read.done() and read.result() == "never"


async def test_the_turns_of_a_silo_declared_dead_end_before_its_stop_does(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    latch = silo.get_grain(Latch, "dead")
    held = [asyncio.ensure_future(latch.with_timeout(600).peek(f"p{i}")) for i in range(3)]
    await clock.settle()
    act, grain = silo.activation(latch), silo.instance(latch)
    assert act is not None and grain.running == 3
    turns = [t for t in asyncio.all_tasks() if "Activation._turn" in repr(t.get_coro())]
    assert len(turns) == 3
    silo.catalog.drop_all_nowait()
    await clock.settle()
    assert all(call.done() for call in held)  # told at once, not at their 600 s deadline
    for call in held:
        with pytest.raises(errors.GrainDeactivatedError, match="declared dead"):
            await call
    await silo.catalog.stop()
    assert all(t.done() for t in turns) and grain.running == 0
