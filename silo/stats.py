"""Per-method call counters with mergeable latency histograms, as a call filter,
and the publisher of a silo's stats record (process figures, GPUs).

Histograms use fixed log-spaced buckets shared by every silo, so the
dashboard can add them up across silos and read p50/p99 from the sum.

GPU figures come from NVML when its binding (``nvidia-ml-py``, module
``pynvml``) is installed, else from torch's CUDA queries, but only when the
process has already imported torch and already uses CUDA: the runtime never
imports torch (``.importlinter``), and a query on a device the silo never used
would create a CUDA context there (hundreds of MB of device memory). With
neither, the record lists no GPUs at all, never zeros.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import importlib
import json
import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import redis.asyncio as aioredis
from pydantic import BaseModel

from silo import errors
from silo.catalog.pipeline import CallContext, CallNext
from silo.keys import Keys
from silo.records.stats import (
    BUCKETS_MS,
    HISTORY_POINTS,
    STATS_TTL_FACTOR,
    WINDOW_S,
    GpuRecord,
    LoadPoint,
    MethodRecord,
    SiloStatsRecord,
)
from silo.redis_util import redis_errors

log = logging.getLogger("redgrain.stats")

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


def _sparse(histogram: list[int] | tuple[int, ...]) -> dict[int, int]:
    return {i: n for i, n in enumerate(histogram) if n}


def _plain(value: Any) -> dict[str, Any]:
    """A component's statistics() as JSON-able fields (dataclass, pydantic model or dict)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, BaseModel):
        value = value.model_dump()
    if not isinstance(value, dict):
        return {"value": str(value)}
    # default=str: an address object or enum among the fields must not stop the record.
    return dict(json.loads(json.dumps(value, default=str)))


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


# --- GPUs ---------------------------------------------------------------------


def _load_nvml() -> Any | None:
    """The initialised ``pynvml`` module, or None (not installed, no driver, no device)."""
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:  # no driver, no device (NVMLError_LibraryNotFound, ...)
        return None
    return nvml


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _visible(spec: str | None) -> list[int | str] | None:
    """CUDA_VISIBLE_DEVICES as indices and UUID prefixes; None: unset (every device).

    As CUDA reads it, the list ends at the first entry that is neither. Indices
    are matched to NVML's, which is CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID.
    """
    if spec is None:
        return None
    out: list[int | str] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.isdigit():
            out.append(int(entry))
        elif entry.startswith(("GPU-", "MIG-")):
            out.append(entry)
        else:
            break
    return out


class GpuProbe:
    """Samples the GPUs this silo uses, once per stats record (see the module docstring).

    ``nvml`` loads the NVML binding (once, at the first sample); ``torch``
    returns the torch module if the process imported it. Both are seams for tests.
    """

    def __init__(
        self,
        *,
        nvml: Callable[[], Any | None] = _load_nvml,
        torch: Callable[[], Any | None] = lambda: sys.modules.get("torch"),
        visible_devices: str | None = None,
    ) -> None:
        self._load_nvml: Callable[[], Any | None] | None = nvml
        self._nvml: Any | None = None
        self._torch = torch
        self._visible = _visible(visible_devices)
        self._failing = False

    def sample(self) -> list[GpuRecord]:
        """This moment's figures; [] without a GPU (or when reading them failed)."""
        if self._load_nvml is not None:
            self._nvml, self._load_nvml = self._load_nvml(), None
        try:
            gpus = self._from_nvml(self._nvml) if self._nvml is not None else self._from_torch()
        except Exception:  # a driver hiccup must not cost the silo its stats record
            if not self._failing:
                log.warning("GPU figures could not be read (will retry each record)", exc_info=True)
            self._failing = True
            return []
        self._failing = False
        return gpus

    def _wanted(self, index: int, uuid: str) -> bool:
        if self._visible is None:
            return True
        return any(
            v == index if isinstance(v, int) else uuid.startswith(v) for v in self._visible
        )

    def _from_nvml(self, nvml: Any) -> list[GpuRecord]:
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            if self._visible is not None and not self._wanted(i, _text(nvml.nvmlDeviceGetUUID(handle))):
                continue
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                utilization: float | None = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except nvml.NVMLError:  # not supported (a MIG slice, some boards): unknown, not 0
                utilization = None
            out.append(GpuRecord(
                index=i, name=_text(nvml.nvmlDeviceGetName(handle)), source="nvml",
                utilization=utilization, memory_used_bytes=int(memory.used),
                memory_total_bytes=int(memory.total),
            ))  # fmt: skip
        return out

    def _from_torch(self) -> list[GpuRecord]:
        torch = self._torch()
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return []
        out = []
        for i in range(cuda.device_count()):
            if not cuda.memory_reserved(i):
                continue  # never used by this process: mem_get_info would make a context there
            free, total = cuda.mem_get_info(i)
            out.append(GpuRecord(
                index=i, name=str(cuda.get_device_name(i)), source="torch",
                memory_used_bytes=int(total - free), memory_total_bytes=int(total),
            ))  # fmt: skip
        return out


# --- the publisher ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublisherStatistics:
    published: int
    """Records written since start."""
    failures: int
    """Publishes that failed (Redis unreachable); the silo keeps serving."""
    last_bytes: int
    """Size of the last record."""


def activity(rec: SiloStatsRecord) -> tuple[Any, ...]:
    """What makes a stats record news: status, activations per type, calls and errors (lifetime and
    in the window, so a record goes out as a burst drains). Not CPU, memory or the components'
    counters, which tick on an idle silo too (probes, heartbeats)."""
    return (
        rec.status,
        rec.activations,
        tuple(sorted(rec.by_type.items())),
        sum(m.calls for m in rec.methods),
        sum(m.errors for m in rec.methods),
        sum(m.window_calls for m in rec.methods),
    )


class StatsPublisher:
    """Writes the silo's stats record to Redis once per interval while it works, with a TTL.

    A record is built every ``interval_s``; it is written when its activity
    (:func:`activity`: status, activations, calls) differs from the last one
    written, else only every ``idle_interval_s``: an idle silo costs Redis 5
    commands each ``idle_interval_s`` instead of each second (issue 39), and
    the first record after a change is still at most ``interval_s`` late.

    ``source`` returns ``Silo.statistics()``; everything else is read here
    (process CPU, RSS, uptime; the GPUs from ``gpus``, by default a
    :class:`GpuProbe` honouring CUDA_VISIBLE_DEVICES). A failed publish is
    logged once and retried next interval: Redis being down must never stop a silo.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        address: str,
        source: Callable[[], dict[str, Any]],
        *,
        status: Callable[[], str],
        started: float,
        interval_s: float = 1.0,
        idle_interval_s: float | None = None,
        clock: Callable[[], float] = time.time,
        gpus: Callable[[], list[GpuRecord]] | None = None,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._address = address
        self._source = source
        self._status = status
        self._started = started
        self._interval_s = interval_s
        self._idle_interval_s = max(interval_s, idle_interval_s if idle_interval_s is not None else interval_s)
        self._clock = clock
        self._written: tuple[float, tuple[Any, ...]] | None = None
        """(time, activity) of the last record written."""
        self._gpus = gpus or GpuProbe(visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES")).sample
        self._process = psutil.Process()  # own instance: cpu_percent() is per instance
        self._process.cpu_percent(None)
        # (time, {method key: (calls, errors, histogram)}) snapshots spanning WINDOW_S
        self._snapshots: deque[
            tuple[float, dict[tuple[str, str], tuple[int, int, tuple[int, ...]]]]
        ] = deque()
        self._task: asyncio.Task[None] | None = None
        self._published = self._failures = self._last_bytes = 0
        self._failing = False
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"stats-{self._address}"
        )

    async def stop(self) -> None:
        """Stop publishing (the last record expires by its TTL)."""
        # A flag as well as cancel(): redis-py may turn a cancel that lands
        # mid-command into a ConnectionError, which the loop below survives.
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def stop_nowait(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.publish_if_changed()
            except errors.StorageError as exc:
                self._failures += 1
                if not self._failing:
                    log.warning("stats publish failed (will retry each interval): %s", exc)
                self._failing = True
            except Exception:  # a bug in one statistics() must not end publishing
                self._failures += 1
                if not self._failing:
                    log.exception("stats record could not be built (will retry each interval)")
                self._failing = True
            else:
                if self._failing:
                    log.info("stats publish works again")
                self._failing = False
            if self._stopping:  # a cancel redis-py turned into an error above: no sleep
                return
            await asyncio.sleep(self._interval_s)

    def record(self) -> SiloStatsRecord:
        """Build the record now (also used by tests)."""
        now = self._clock()
        stats = self._source()
        methods: list[MethodStatistics] = stats.get("methods", [])
        current = {(m.grain_type, m.method): (m.calls, m.errors, m.histogram) for m in methods}
        self._snapshots.append((now, current))
        while len(self._snapshots) > 1 and now - self._snapshots[1][0] >= WINDOW_S:
            self._snapshots.popleft()
        t0, old = self._snapshots[0]
        window_s = max(now - t0, 0.0)
        records = []
        for m in methods:
            c0, e0, h0 = old.get((m.grain_type, m.method), (0, 0, ()))
            if window_s == 0.0:
                c0, e0, h0 = m.calls, m.errors, m.histogram
            records.append(
                MethodRecord(
                    grain_type=m.grain_type,
                    method=m.method,
                    calls=m.calls,
                    errors=m.errors,
                    total_ms=round(m.total_ms, 3),
                    hist=_sparse(m.histogram),
                    window_calls=m.calls - c0,
                    window_errors=m.errors - e0,
                    window_hist={
                        i: n - (h0[i] if i < len(h0) else 0)
                        for i, n in enumerate(m.histogram)
                        if n - (h0[i] if i < len(h0) else 0)
                    },
                )
            )
        catalog = stats.get("catalog")
        with self._process.oneshot():
            cpu = self._process.cpu_percent(None)
            rss = self._process.memory_info().rss
            mem = self._process.memory_percent()
        components = {
            name: _plain(value)
            for name, value in stats.items()
            if name not in ("methods", "catalog")
        }
        if catalog is not None:
            components["catalog"] = {
                k: v
                for k, v in dataclasses.asdict(catalog).items()
                if k not in ("by_type", "by_type_keys")
            }
        return SiloStatsRecord(
            address=self._address,
            status=self._status(),
            at=now,
            started=self._started,
            uptime_s=max(now - self._started, 0.0),
            pid=os.getpid(),
            cpu_percent=round(cpu, 2),
            rss_bytes=rss,
            memory_percent=round(mem, 3),
            activations=catalog.activations if catalog is not None else 0,
            by_type=dict(catalog.by_type) if catalog is not None else {},
            keys_sample=dict(catalog.by_type_keys) if catalog is not None else {},
            window_s=round(window_s, 3),
            methods=records,
            components=components,
            gpus=self._gpus(),
        )

    async def publish_if_changed(self) -> SiloStatsRecord | None:
        """Build a record; write it if its activity changed or ``idle_interval_s`` passed since the
        last write (None: not written)."""
        rec = self.record()
        if self._written is not None:
            at, last = self._written
            if activity(rec) == last and rec.at - at < self._idle_interval_s:
                return None
        await self._write(rec)
        return rec

    async def publish(self) -> SiloStatsRecord:
        """Build a record and write it, changed or not."""
        rec = self.record()
        await self._write(rec)
        return rec

    async def _write(self, rec: SiloStatsRecord) -> None:
        body = rec.model_dump_json()
        calls_per_s = (
            sum(m.window_calls for m in rec.methods) / rec.window_s if rec.window_s else 0.0
        )
        point = LoadPoint(
            at=rec.at,
            cpu_percent=rec.cpu_percent,
            rss_bytes=rec.rss_bytes,
            activations=rec.activations,
            calls_per_s=round(calls_per_s, 3),
        ).model_dump_json()
        # Outlives the idle cadence: a quiet silo's record must not expire between writes.
        ttl = max(1, math.ceil(self._idle_interval_s * STATS_TTL_FACTOR))
        k = self._keys
        history = k.silo_stats_history(self._address)
        with redis_errors("publish silo stats"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(k.silo_stats(self._address), body, ex=ttl)
                pipe.zadd(k.silo_stats_index, {self._address: rec.at})
                pipe.lpush(history, point)
                pipe.ltrim(history, 0, HISTORY_POINTS - 1)
                pipe.expire(history, max(ttl, 600))
                await pipe.execute()
        self._published += 1
        self._last_bytes = len(body)
        self._written = (rec.at, activity(rec))

    def statistics(self) -> PublisherStatistics:
        return PublisherStatistics(self._published, self._failures, self._last_bytes)
