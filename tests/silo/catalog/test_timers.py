"""Grain timers on virtual time: due and period fire as turns when the clock advances."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from silo.settings import CatalogSettings
from silo.testing.clock import VirtualClock
from silo.testing.harness import InProcessSilo
from tests.silo.catalog.grains import Ticker


async def test_timer_fires_at_due_then_every_period(silo: InProcessSilo, clock: VirtualClock) -> None:
    ticker = silo.get_grain(Ticker, "t")
    t0 = clock()
    await ticker.start(2.0, 1.0)
    await clock.advance(1.999)
    assert await ticker.count() == 0
    await clock.advance(0.001)
    assert await ticker.count() == 1
    await clock.advance(3.5)
    assert [round(t - t0, 6) for t in silo.instance(ticker).ticks] == [2.0, 3.0, 4.0, 5.0]


async def test_one_shot_timer_fires_once(silo: InProcessSilo, clock: VirtualClock) -> None:
    ticker = silo.get_grain(Ticker, "once")
    await ticker.start(0.5, None)
    await clock.advance(100)
    assert await ticker.count() == 1


async def test_timer_tick_is_a_turn_and_waits_for_the_running_one(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    ticker = silo.get_grain(Ticker, "busy")
    t0 = clock()
    await ticker.start(1.0, 1.0)
    held = asyncio.ensure_future(ticker.hold())
    await clock.advance(5)
    assert await ticker.count() == 0  # due at 1 s, queued behind the turn that holds
    await ticker.release()
    await held
    await clock.settle()
    # The held-off tick runs as soon as the turn ends; the period counts from its end.
    await clock.advance(2)
    assert [round(t - t0, 6) for t in silo.instance(ticker).ticks] == [5.0, 6.0, 7.0]


async def test_interleaving_timer_ticks_beside_a_running_turn(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    ticker = silo.get_grain(Ticker, "free")
    await ticker.start(1.0, 1.0, True)
    held = asyncio.ensure_future(ticker.hold())
    await clock.advance(3)
    assert await ticker.count() == 3
    await ticker.release()
    await held


async def test_cancelled_timer_and_deactivated_grain_tick_no_more(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    a, b = silo.get_grain(Ticker, "a"), silo.get_grain(Ticker, "b")
    await asyncio.gather(a.start(1.0, 1.0), b.start(1.0, 1.0))
    await clock.advance(2)
    grain_b = silo.instance(b)
    await a.stop()
    await silo.deactivate(b)
    await clock.advance(10)
    assert await a.count() == 2
    assert len(grain_b.ticks) == 2


async def test_a_periodic_timer_does_not_keep_an_idle_grain_alive(
    make_silo: Callable[..., InProcessSilo], clock: VirtualClock
) -> None:
    # As in Orleans: a tick is no use of the activation, so idle collection goes by calls only.
    silo = await make_silo(CatalogSettings(idle_timeout_s=60, collection_interval_s=10)).start()
    ticker = silo.get_grain(Ticker, "idle")
    await ticker.start(0.5, 1.0)  # ticks between the sweeps (a tick running at a sweep puts it off)
    act, grain = silo.activation(ticker), silo.instance(ticker)
    assert act is not None
    await clock.advance(59.9)
    assert silo.activation(ticker) is act and len(grain.ticks) == 60  # ticking, not yet idle long enough
    await clock.advance(15.0)  # the sweep at 70 s finds 70 s without a call
    assert act.deactivated.is_set()
    assert silo.activation(ticker) is None
    ticks = len(grain.ticks)
    await clock.advance(10.0)
    assert len(grain.ticks) == ticks  # its timer went with it
