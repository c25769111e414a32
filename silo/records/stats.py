"""Silo stats: the record each silo publishes once an interval under ``keys.silo_stats``.

Silos write one small JSON record a second (silo/stats.py); the dashboard
reads only these, so it never adds work to a call path. Per-method latency
histograms share fixed buckets (:data:`BUCKETS_MS`), so readers can add them
up across silos, and travel sparse ({bucket index: count}) because most of
the 37 buckets of a method are empty.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

# Upper bounds in milliseconds: 0.05 ms .. ~100 s, 4 buckets per doubling-ish.
BUCKETS_MS: tuple[float, ...] = tuple(round(0.05 * 1.5**i, 4) for i in range(36))


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


STATS_TTL_FACTOR = 5
"""A stats record expires after this many publish intervals (a dead silo's fades)."""
HISTORY_POINTS = 300
"""Load points kept per silo (5 minutes at the default interval)."""
WINDOW_S = 10.0
"""Span of the 'recent' rates and latency histograms."""


class MethodRecord(BaseModel):
    """One method's counters in a silo's record."""

    grain_type: str
    method: str
    calls: int = Field(description="Calls completed since the silo started.")
    errors: int = Field(description="Calls that raised since the silo started.")
    total_ms: float = Field(description="Sum of call durations since start.")
    hist: dict[int, int] = Field(
        default_factory=dict, description="Sparse BUCKETS_MS histogram since start."
    )
    window_calls: int = Field(default=0, description="Calls completed in the last window_s.")
    window_errors: int = Field(default=0, description="Calls that raised in the last window_s.")
    window_hist: dict[int, int] = Field(
        default_factory=dict, description="Sparse histogram of the last window_s."
    )


class LoadPoint(BaseModel):
    """One point of a silo's load history."""

    at: float
    cpu_percent: float
    rss_bytes: int
    activations: int
    calls_per_s: float


class GpuRecord(BaseModel):
    """One GPU as a silo sees it, in its stats record (absent when the silo has no GPU)."""

    index: int = Field(description="Device index (NVML's, or CUDA's under torch's figures).")
    name: str = ""
    source: str = Field(description="Where the figures come from: 'nvml' (the whole device) or 'torch'.")
    utilization: float | None = Field(
        default=None, description="Busy fraction of the last sample period, 0..1 (None: unknown, e.g. torch)."
    )
    memory_used_bytes: int = Field(description="Device memory in use (all processes; torch: total - free).")
    memory_total_bytes: int


class SiloStatsRecord(BaseModel):
    """What a silo publishes each interval under ``keys.silo_stats(address)``."""

    address: str
    status: str = Field(description="The silo object's own status: active, stopping, ...")
    at: float = Field(description="Publish time (unix seconds).")
    started: float
    uptime_s: float
    pid: int
    cpu_percent: float = Field(description="Process CPU since the last record (100 = one core).")
    rss_bytes: int
    memory_percent: float
    activations: int
    by_type: dict[str, int] = Field(
        default_factory=dict, description="Live activations per grain type."
    )
    keys_sample: dict[str, list[str]] = Field(
        default_factory=dict, description="Some live keys per type."
    )
    window_s: float = Field(description="Span the window_* counters of the methods cover.")
    methods: list[MethodRecord] = Field(default_factory=list)
    components: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Every other component's statistics(), as plain fields."
    )
    gpus: list[GpuRecord] = Field(
        default_factory=list,
        description="The GPUs this silo uses (NVML, else torch's CUDA figures); empty without one. "
        "Records from before this field parse with none.",
    )


def dense(sparse: dict[int, int]) -> list[int]:
    """A sparse histogram back to one count per bucket of BUCKETS_MS (+ overflow)."""
    out = [0] * (len(BUCKETS_MS) + 1)
    for i, n in sparse.items():
        if 0 <= int(i) < len(out):
            out[int(i)] += n
    return out

