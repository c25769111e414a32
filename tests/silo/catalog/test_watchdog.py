"""The loop watchdog counts and names stalls, without sleeping in the test."""

from __future__ import annotations

import asyncio
import logging

import pytest

from silo.catalog.watchdog import LoopWatchdog


def test_lag_above_threshold_is_counted_and_logged_with_running_turns(caplog: pytest.LogCaptureFixture) -> None:
    dog = LoopWatchdog(100, lambda: ["Trainer/job-1.step"])
    with caplog.at_level(logging.WARNING, logger="redgrain.watchdog"):
        dog.observe(0.01)
        dog.observe(0.35)
    stats = dog.statistics()
    assert stats.slow_ticks == 1
    assert stats.max_lag_ms == pytest.approx(350)
    assert "Trainer/job-1.step" in caplog.text and "run_in_thread" in caplog.text


async def test_a_turn_that_blocks_the_loop_is_caught_by_the_silo_watchdog(cluster, client) -> None:  # type: ignore[no-untyped-def]
    from tests.sample_grains import Echo

    (silo,) = await cluster(1)
    assert silo.watchdog.statistics().slow_ticks == 0
    await client.get_grain(Echo, "w").block_loop(0.3)
    while silo.watchdog.statistics().slow_ticks == 0:  # the watchdog's next tick reports it
        await asyncio.sleep(0.01)
    assert silo.watchdog.statistics().max_lag_ms >= 200
