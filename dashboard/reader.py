"""Reads what silos publish, and adds it up for the API.

One ``Snapshot`` (membership rows + every silo's latest stats record) is read
in one pipelined round trip and shared by every request for ``cache_s``, so
ten open pages cost Redis what one does, and no silo is ever asked anything.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from pydantic import ValidationError

from dashboard import models as m
from grains.training.api.records import JobPoint, JobProgress
from silo import errors
from silo.keys import Keys
from silo.records.membership import LIVE, MemberRow, SiloStatus, merge_row
from silo.records.stats import LoadPoint, SiloStatsRecord, dense, percentile
from silo.redis_util import redis_errors


@dataclass
class Snapshot:
    at: float
    latency_ms: float
    members: dict[str, MemberRow] = field(default_factory=dict)
    records: dict[str, SiloStatsRecord] = field(default_factory=dict)
    jobs: int = 0

    def live(self) -> list[MemberRow]:
        return sorted(
            (r for r in self.members.values() if r.status in LIVE), key=lambda r: r.address
        )

    def live_records(self) -> list[SiloStatsRecord]:
        return [self.records[r.address] for r in self.live() if r.address in self.records]


class ClusterReader:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, cache_s: float = 0.5) -> None:
        self.redis = redis
        self.keys = keys
        self._cache_s = cache_s
        self._snapshot: Snapshot | None = None
        self._read_at = 0.0
        self._lock = asyncio.Lock()

    async def snapshot(self) -> Snapshot:
        """The cluster as last published; raises StorageError when Redis is unreachable."""
        async with self._lock:
            if self._snapshot is not None and time.monotonic() - self._read_at < self._cache_s:
                return self._snapshot
            self._snapshot = await self._read()
            self._read_at = time.monotonic()
            return self._snapshot

    async def _read(self) -> Snapshot:
        k = self.keys
        t0 = time.perf_counter()
        with redis_errors("read cluster state"):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(k.members)
                pipe.hgetall(k.members_heartbeats)
                pipe.hgetall(k.members_loads)
                pipe.zrange(k.silo_stats_index, 0, -1)
                pipe.scard(k.jobs)
                rows, beats, loads, indexed, jobs = await pipe.execute()
            members: dict[str, MemberRow] = {}
            for addr, raw in rows.items():
                try:
                    row = MemberRow.model_validate_json(raw)
                except ValidationError:
                    continue
                members[row.address] = merge_row(row, beats.get(addr), loads.get(addr))
            names = sorted(
                {*members, *(a.decode() if isinstance(a, bytes) else a for a in indexed)}
            )
            raws = await self.redis.mget([k.silo_stats(a) for a in names]) if names else []
        records: dict[str, SiloStatsRecord] = {}
        for raw in raws:
            if raw is None:
                continue
            try:
                rec = SiloStatsRecord.model_validate_json(raw)
            except ValidationError:
                continue
            records[rec.address] = rec
        return Snapshot(time.time(), (time.perf_counter() - t0) * 1000, members, records, int(jobs))

    async def history(self, address: str) -> list[LoadPoint]:
        with redis_errors("read silo history"):
            raws = await self.redis.lrange(self.keys.silo_stats_history(address), 0, -1)
        out = []
        for raw in reversed(raws):
            try:
                out.append(LoadPoint.model_validate_json(raw))
            except ValidationError:
                continue
        return out


# --- adding up ---------------------------------------------------------------


def _rate(n: int, rec: SiloStatsRecord) -> float:
    return n / rec.window_s if rec.window_s > 0 else 0.0


def silo_summary(row: MemberRow, rec: SiloStatsRecord | None, now: float) -> m.SiloSummary:
    s = m.SiloSummary(
        address=row.address,
        status=row.status.value,
        roles=row.roles,
        hostname=row.hostname,
        pid=row.pid,
        started=row.started,
        uptime_s=max(now - row.started, 0.0) if row.status in LIVE else 0.0,
        heartbeat_age_s=round(max(now - row.heartbeat, 0.0), 3) if row.heartbeat else None,
        published=rec is not None,
        cpu_percent=row.load.cpu_percent,
        memory_percent=row.load.memory_percent,
        activations=row.load.activations,
        grain_types=row.grain_types,
    )
    if rec is None or row.status is SiloStatus.DEAD:
        return s.model_copy(
            update={"published": rec is not None and row.status is not SiloStatus.DEAD}
        )
    transport = rec.components.get("transport", {})
    return s.model_copy(
        update={
            "uptime_s": rec.uptime_s,
            "cpu_percent": rec.cpu_percent,
            "rss_bytes": rec.rss_bytes,
            "memory_percent": rec.memory_percent,
            "activations": rec.activations,
            "calls_total": sum(x.calls for x in rec.methods),
            "errors_total": sum(x.errors for x in rec.methods),
            "calls_per_s": round(_rate(sum(x.window_calls for x in rec.methods), rec), 3),
            "errors_per_s": round(_rate(sum(x.window_errors for x in rec.methods), rec), 3),
            "frames_in": int(transport.get("frames_in", 0)),
            "frames_out": int(transport.get("frames_out", 0)),
            "bytes_in": int(transport.get("bytes_in", 0)),
            "bytes_out": int(transport.get("bytes_out", 0)),
            "connections": int(transport.get("connections", 0)),
        }
    )


def _merge(target: list[int], sparse: dict[int, int]) -> None:
    for i, n in enumerate(dense(sparse)):
        target[i] += n


def overview(cluster: str, snap: Snapshot, redis: m.RedisStatus) -> m.Overview:
    by_status: dict[str, int] = {}
    for row in snap.members.values():
        by_status[row.status.value] = by_status.get(row.status.value, 0) + 1
    live = snap.live()
    recs = snap.live_records()
    window = [0] * len(dense({}))
    total = [0] * len(window)
    calls_per_s = errors_per_s = 0.0
    for rec in recs:
        for meth in rec.methods:
            _merge(window, meth.window_hist)
            _merge(total, meth.hist)
        calls_per_s += _rate(sum(x.window_calls for x in rec.methods), rec)
        errors_per_s += _rate(sum(x.window_errors for x in rec.methods), rec)
    hist = window if sum(window) else total
    transports = [r.components.get("transport", {}) for r in recs]
    message = None
    if not snap.members:
        message = f"No silos have joined cluster '{cluster}' yet."
    elif not live:
        message = (
            f"No live silos in cluster '{cluster}' (all {len(snap.members)} known silos are dead)."
        )
    return m.Overview(
        cluster=cluster,
        at=snap.at,
        redis=redis,
        silos=by_status,
        silos_live=len(live),
        activations=sum(r.activations for r in recs),
        calls_total=sum(x.calls for r in recs for x in r.methods),
        errors_total=sum(x.errors for r in recs for x in r.methods),
        calls_per_s=round(calls_per_s, 3),
        errors_per_s=round(errors_per_s, 3),
        p50_ms=percentile(hist, 0.5),
        p99_ms=percentile(hist, 0.99),
        bytes_in=sum(int(t.get("bytes_in", 0)) for t in transports),
        bytes_out=sum(int(t.get("bytes_out", 0)) for t in transports),
        jobs=snap.jobs,
        message=message,
        warnings=_warnings(recs),
    )


def _warnings(recs: list[SiloStatsRecord]) -> list[str]:
    """What the live silos' records say needs an operator (docs/reliability.md, "WAIT")."""
    out = []
    redis = [r.components.get("redis") or {} for r in recs]
    seeing = sum(1 for red in redis if red.get("replica_less_masters"))
    if seeing:
        short = sum(int(red.get("short_replication") or 0) for red in redis)
        out.append(
            f"{seeing} silo(s) see a Redis master with fewer connected replicas than wait_replicas: writes to it "
            f"are acknowledged before any replica has them ({short} so far; "
            "redgrain_redis_short_replication_total). A failover then loses them: see docs/reliability.md, \"WAIT\"."
        )
    return out


METHOD_SORTS = tuple(m.MethodRow.model_fields)


@dataclass
class _MethodSum:
    calls: int = 0
    errors: int = 0
    total_ms: float = 0.0
    calls_per_s: float = 0.0
    errors_per_s: float = 0.0
    hist: list[int] = field(default_factory=lambda: dense({}))
    window: list[int] = field(default_factory=lambda: dense({}))


def methods(
    snap: Snapshot,
    sort: str = "calls",
    order: str = "desc",
    *,
    grain_type: str | None = None,
    silo: str | None = None,
) -> list[m.MethodRow]:
    """Per-method rows merged over live silos (or only ``silo``'s), of every grain type (or only
    ``grain_type``'s), sorted by the column ``sort`` itself."""
    if sort not in METHOD_SORTS:
        raise errors.ConfigError(f"cannot sort by {sort!r}; one of {', '.join(METHOD_SORTS)}")
    merged: dict[tuple[str, str], _MethodSum] = {}
    for rec in snap.live_records():
        if silo is not None and rec.address != silo:
            continue
        for x in rec.methods:
            if grain_type is not None and x.grain_type != grain_type:
                continue
            acc = merged.setdefault((x.grain_type, x.method), _MethodSum())
            acc.calls += x.calls
            acc.errors += x.errors
            acc.total_ms += x.total_ms
            acc.calls_per_s += _rate(x.window_calls, rec)
            acc.errors_per_s += _rate(x.window_errors, rec)
            _merge(acc.hist, x.hist)
            _merge(acc.window, x.window_hist)
    rows = []
    for (t, meth), a in merged.items():
        hist = a.window if sum(a.window) else a.hist
        rows.append(
            m.MethodRow(
                grain_type=t,
                method=meth,
                calls=a.calls,
                errors=a.errors,
                calls_per_s=round(a.calls_per_s, 3),
                errors_per_s=round(a.errors_per_s, 3),
                error_percent=round(100.0 * a.errors / a.calls, 3) if a.calls else 0.0,
                mean_ms=round(a.total_ms / a.calls, 4) if a.calls else 0.0,
                p50_ms=percentile(hist, 0.5),
                p99_ms=percentile(hist, 0.99),
            )
        )
    rows.sort(key=lambda r: (getattr(r, sort), r.grain_type, r.method), reverse=order == "desc")
    return rows


def grains(snap: Snapshot, persisted_types: set[str]) -> m.Grains:
    by_type: dict[str, dict[str, int]] = {}
    by_silo = []
    for row in snap.live():
        rec = snap.records.get(row.address)
        counts = dict(rec.by_type) if rec else {}
        by_silo.append(
            m.GrainsBySiloRow(
                silo=row.address,
                status=row.status.value,
                activations=sum(counts.values()),
                by_type=counts,
            )
        )
        for t, n in counts.items():
            by_type.setdefault(t, {})[row.address] = n
    for t in persisted_types:
        by_type.setdefault(t, {})
    rows = [
        m.GrainsByTypeRow(
            type=t, activations=sum(s.values()), by_silo=s, persisted=t in persisted_types
        )
        for t, s in by_type.items()
    ]
    rows.sort(key=lambda r: (-r.activations, r.type))
    return m.Grains(by_type=rows, by_silo=by_silo)


def job_metric_names(progress: JobProgress, history: list[JobPoint]) -> dict[str, list[str]]:
    """Every metric name of a job per split, the loss first: one curve each."""
    seen: dict[str, set[str]] = {
        "train": {*progress.metrics, *(["loss"] if progress.loss is not None else [])},
        "eval": set(progress.eval_metrics),
    }
    for p in history:
        seen[p.split].update(p.metrics)
        if p.loss is not None and p.split == "train":
            seen["train"].add("loss")
        if p.accuracy is not None:  # an entry from before splits: an evaluation figure
            seen["eval"].add("accuracy")
    return {split: sorted(names, key=lambda n: (n != "loss", n)) for split, names in seen.items()}


def redis_down(exc: errors.RedgrainError) -> m.RedisStatus:
    return m.RedisStatus(ok=False, error=str(exc), latency_ms=None)
