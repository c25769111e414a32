"""The virtual clock itself: loop timers, sleeps and deadlines follow it, and no real time passes."""

from __future__ import annotations

import asyncio
import time

import pytest

from silo.testing.clock import VirtualClock


async def test_advance_runs_each_callback_at_its_own_time_without_real_waiting(clock: VirtualClock) -> None:
    loop = asyncio.get_running_loop()
    t0 = clock()
    seen: list[tuple[str, float]] = []

    def timer() -> None:
        seen.append(("timer", clock() - t0))

    for at in (1.0, 2.5, 2.5, 7.0):
        loop.call_later(at, timer)

    async def sleeper() -> None:
        await asyncio.sleep(3)
        seen.append(("slept", clock() - t0))
        await asyncio.sleep(1)  # scheduled at 3 s, due at 4 s: inside the same advance
        seen.append(("slept again", clock() - t0))

    task = asyncio.ensure_future(sleeper())
    real = time.monotonic()
    await clock.advance(5)
    assert time.monotonic() - real < 1.0
    assert clock() - t0 == pytest.approx(5.0)
    assert loop.time() == clock()
    assert seen == [("timer", 1.0), ("timer", 2.5), ("timer", 2.5), ("slept", 3.0), ("slept again", 4.0)]
    assert task.done()
    await clock.advance(2)
    assert seen[-1] == ("timer", 7.0)


async def test_jump_moves_time_and_runs_nothing_until_the_loop_looks(clock: VirtualClock) -> None:
    fired = asyncio.Event()
    asyncio.get_running_loop().call_later(10, fired.set)
    clock.jump(10)
    assert not fired.is_set()
    await clock.settle()
    assert fired.is_set()


async def test_autojump_makes_a_timeout_instant(clock: VirtualClock) -> None:
    clock.autojump = True
    t0, real = clock(), time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.Event().wait(), 3600)
    assert clock() - t0 == pytest.approx(3600)
    assert time.monotonic() - real < 1.0


async def test_settle_runs_what_is_ready_and_keeps_the_time(clock: VirtualClock) -> None:
    t0 = clock()
    steps: list[int] = []

    async def chain(n: int) -> None:
        for i in range(n):
            steps.append(i)
            await asyncio.sleep(0)

    task = asyncio.ensure_future(chain(100))
    await clock.settle()
    assert task.done() and steps == list(range(100))
    assert clock() == t0


async def test_misuse_is_refused(clock: VirtualClock) -> None:
    with pytest.raises(ValueError):
        clock.jump(-1)
    with pytest.raises(ValueError):
        await clock.advance(-1)
    first = asyncio.ensure_future(clock.advance(1))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        await clock.advance(1)
    await first
    with pytest.raises(RuntimeError):
        clock.install()


async def test_uninstall_gives_the_loop_its_own_time_back() -> None:
    loop = asyncio.get_running_loop()
    with VirtualClock(start=5.0) as clock:
        assert loop.time() == 5.0
        await clock.advance(1)
        assert loop.time() == 6.0
    assert abs(loop.time() - time.monotonic()) < 1.0
    assert clock() == 6.0


def test_a_clock_not_installed_is_a_plain_settable_clock() -> None:
    clock = VirtualClock(start=1000.0)
    assert clock() == 1000.0
    clock.jump(2.5)
    assert clock() == clock.time() == 1002.5
