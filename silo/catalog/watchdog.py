"""Loop watchdog: notices when something holds the event loop too long.

Heartbeat probes, calls and timers all share one loop, so a grain doing CPU
work on it (instead of ``run_in_thread``) delays everyone. The watchdog wakes
every ``interval`` and measures how late it woke; a lag above the threshold
is logged with the turns that were running, and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("redgrain.watchdog")


@dataclass(frozen=True, slots=True)
class WatchdogStatistics:
    slow_ticks: int
    """Times the loop was held longer than the threshold."""
    max_lag_ms: float
    """Longest loop stall seen since start."""
    last_lag_ms: float
    """Lag at the latest tick."""


class LoopWatchdog:
    def __init__(
        self,
        threshold_ms: float,
        running: Callable[[], list[str]],
        *,
        interval_s: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._threshold_s = threshold_ms / 1000.0
        self._running = running
        self._interval_s = interval_s
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._slow = 0
        self._max = 0.0
        self._last = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            before = self._clock()
            await asyncio.sleep(self._interval_s)
            self.observe(self._clock() - before - self._interval_s)

    def observe(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self._last = lag_s
        self._max = max(self._max, lag_s)
        if lag_s > self._threshold_s:
            self._slow += 1
            turns = self._running()
            log.warning(
                "event loop held for %.0f ms (threshold %.0f ms); running turns: %s — "
                "move CPU-heavy work to `await self.run_in_thread(...)`",
                lag_s * 1000,
                self._threshold_s * 1000,
                ", ".join(turns[:5]) or "none (runtime work)",
            )

    def statistics(self) -> WatchdogStatistics:
        return WatchdogStatistics(self._slow, self._max * 1000.0, self._last * 1000.0)
