"""What replicas publish about themselves, for the dashboard and ``/metrics``; no torch.

Every replica of a served model writes one :class:`ReplicaRecord` a second
into the model's hash (field: the replica's activation id), and adds the
model's name to the set of served models; both keys hang under the cluster's
workload prefix ``keys.rendezvous("serving", 0)`` (the grain API's shared
store: ``workload(grain).rendezvous_prefix``), so they are built in ``silo/keys.py``.
A record older than :data:`STALE_S` is a replica that went away (its silo
died, it was collected) and is left out and deleted by readers.

Histograms travel sparse, as the silos' method records do: latencies over
``silo.records.stats.BUCKETS_MS``, batch sizes over :data:`BATCH_BUCKETS`.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from silo.records.stats import BUCKETS_MS, dense, percentile
from silo.redis_util import redis_errors

BATCH_BUCKETS: tuple[int, ...] = tuple(2**i for i in range(11))
"""Upper bounds (rows) of the batch-size histogram: 1, 2, 4 ... 1024, then overflow."""
STALE_S = 10.0
"""A replica record older than this is gone."""
RECORD_TTL_S = 60
WORKLOAD = "serving"




def models_key(prefix: str) -> str:
    """Set: names of served models (``prefix`` = ``keys.rendezvous("serving", 0)``)."""
    return prefix + "models"


def replicas_key(prefix: str, name: str) -> str:
    """Hash: replica (activation id) -> JSON ReplicaRecord of one model."""
    return prefix + f"model:{name}"


def batch_bucket(rows: int) -> int:
    """Index of the first bound >= rows (len(BATCH_BUCKETS): overflow)."""
    return bisect_left(BATCH_BUCKETS, rows)


def latency_bucket(ms: float) -> int:
    """Index of the first ``BUCKETS_MS`` bound >= ms (len(BUCKETS_MS): overflow)."""
    return bisect_left(BUCKETS_MS, ms)


class ReplicaRecord(BaseModel):
    """One replica (an activation of the model's grain on one silo)."""

    model: str
    replica: str = Field(description="Activation id.")
    silo: str
    grain_type: str = "ModelGrain"
    ready: bool
    version: str = Field("", description="Weights version served (`<job> step <n>`, or the file and its time).")
    step: int = 0
    error: str = Field("", description="Why the last load failed, if it did.")
    loaded_at: float = 0.0
    reloads: int = Field(0, description="Weight swaps since the replica started.")
    at: float = Field(description="Publish time (unix seconds).")
    started: float
    requests: int = Field(0, description="Requests answered since the replica started (errors included).")
    errors: int = 0
    rows: int = 0
    batches: int = 0
    passes: int = Field(0, description="Forward passes run: more than batches when failed batches ran again request by request.")
    requests_per_s: float = Field(0.0, description="Over the last publish interval.")
    batch_rows: dict[int, int] = Field(default_factory=dict, description="Sparse BATCH_BUCKETS histogram of rows per batch.")
    queue_ms: dict[int, int] = Field(default_factory=dict, description="Sparse BUCKETS_MS histogram: wait for a batch.")
    compute_ms: dict[int, int] = Field(default_factory=dict, description="Sparse BUCKETS_MS histogram: forward pass of the request's batch.")
    latency_ms: dict[int, int] = Field(default_factory=dict, description="Sparse BUCKETS_MS histogram: queue + compute.")
    queue_ms_sum: float = 0.0
    compute_ms_sum: float = 0.0
    latency_ms_sum: float = 0.0
    window_latency_ms: dict[int, int] = Field(default_factory=dict, description="The latency histogram of the last window_s.")
    window_s: float = 10.0


class ModelSummary(BaseModel):
    """One served model, its live replicas merged (the dashboard's Models page)."""

    name: str
    replicas: list[ReplicaRecord]
    ready_replicas: int
    versions: list[str]
    requests: int
    errors: int
    requests_per_s: float
    p50_ms: float = Field(description="Queue + compute, over the replicas' last window.")
    p99_ms: float
    mean_batch_rows: float
    batch_rows: list[int] = Field(description="Dense BATCH_BUCKETS histogram (+ overflow), all replicas.")


def summarize(name: str, replicas: list[ReplicaRecord]) -> ModelSummary:
    window = [0] * (len(BUCKETS_MS) + 1)
    batches = [0] * (len(BATCH_BUCKETS) + 1)
    for r in replicas:
        window = [a + b for a, b in zip(window, dense(r.window_latency_ms), strict=True)]
        for i, n in r.batch_rows.items():
            if 0 <= int(i) < len(batches):
                batches[int(i)] += n
    total_batches = sum(r.batches for r in replicas)
    return ModelSummary(
        name=name,
        replicas=sorted(replicas, key=lambda r: (r.silo, r.replica)),
        ready_replicas=sum(r.ready for r in replicas),
        versions=sorted({r.version for r in replicas if r.version}),
        requests=sum(r.requests for r in replicas),
        errors=sum(r.errors for r in replicas),
        requests_per_s=sum(r.requests_per_s for r in replicas),
        p50_ms=percentile(window, 0.5),
        p99_ms=percentile(window, 0.99),
        mean_batch_rows=sum(r.rows for r in replicas) / total_batches if total_batches else 0.0,
        batch_rows=batches,
    )


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def read_models(redis: Any, prefix: str, now: float | None = None) -> list[ModelSummary]:
    """Every served model with its live replicas; stale records are deleted on the way."""
    now = time.time() if now is None else now
    with redis_errors("read served models"):
        names = sorted(_text(n) for n in await redis.smembers(models_key(prefix)))
        out = []
        for name in names:
            raw = await redis.hgetall(replicas_key(prefix, name))
            live: list[ReplicaRecord] = []
            stale: list[Any] = []
            for field, value in raw.items():
                try:
                    rec = ReplicaRecord.model_validate_json(value)
                except ValidationError:
                    stale.append(field)
                    continue
                if now - rec.at <= STALE_S:
                    live.append(rec)
                else:
                    stale.append(field)
            if stale:
                await redis.hdel(replicas_key(prefix, name), *stale)
            if not live and not raw:
                await redis.srem(models_key(prefix), name)
                continue
            out.append(summarize(name, live))
    return out
