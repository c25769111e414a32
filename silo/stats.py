"""Per-method call counters with mergeable latency histograms, as a call filter.

Histograms use fixed log-spaced buckets shared by every silo, so the
dashboard can add them up across silos and read p50/p99 from the sum.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

from silo.catalog import CallContext, CallNext

# Upper bounds in milliseconds: 0.05 ms .. ~100 s, 4 buckets per doubling-ish.
BUCKETS_MS: tuple[float, ...] = tuple(round(0.05 * 1.5**i, 4) for i in range(36))


@dataclass(slots=True)
class MethodCounters:
    calls: int = 0
    errors: int = 0
    total_ms: float = 0.0
    histogram: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_MS) + 1))

    def record(self, ms: float, failed: bool) -> None:
        self.calls += 1
        self.errors += failed
        self.total_ms += ms
        self.histogram[bisect.bisect_left(BUCKETS_MS, ms)] += 1


@dataclass(frozen=True, slots=True)
class MethodStatistics:
    grain_type: str
    method: str
    calls: int
    """Calls completed since start."""
    errors: int
    """Calls that raised."""
    total_ms: float
    """Sum of call durations (queueing included)."""
    histogram: tuple[int, ...]
    """Counts per bucket of BUCKETS_MS (the last bucket is everything slower)."""


def percentile(histogram: list[int] | tuple[int, ...], q: float) -> float:
    """The bucket bound under which a fraction ``q`` of calls finished (ms)."""
    total = sum(histogram)
    if total == 0:
        return 0.0
    rank = q * total
    seen = 0
    for i, n in enumerate(histogram):
        seen += n
        if seen >= rank:
            return BUCKETS_MS[i] if i < len(BUCKETS_MS) else BUCKETS_MS[-1] * 1.5
    return BUCKETS_MS[-1] * 1.5


class CallStats:
    """The stats call filter: wrap it into the catalog's pipeline."""

    def __init__(self) -> None:
        self._methods: dict[tuple[str, str], MethodCounters] = {}

    async def __call__(self, ctx: CallContext, call_next: CallNext) -> Any:
        start = time.perf_counter()
        failed = True
        try:
            result = await call_next(ctx)
            failed = False
            return result
        finally:
            key = (ctx.grain_id.type_name, ctx.method)
            counters = self._methods.get(key)
            if counters is None:
                counters = self._methods[key] = MethodCounters()
            counters.record((time.perf_counter() - start) * 1000.0, failed)

    def statistics(self) -> list[MethodStatistics]:
        return [
            MethodStatistics(t, m, c.calls, c.errors, c.total_ms, tuple(c.histogram))
            for (t, m), c in sorted(self._methods.items())
        ]
