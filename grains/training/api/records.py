"""What training jobs publish for the dashboard and ``redgrain train --status``; no torch.

A coordinator publishes its job's :class:`JobProgress` (the latest figures,
placements, checkpoints and recoveries) and points for the curves
(:class:`JobPoint`) through the grain facility ``workload(grain).publish_progress``; readers
(the dashboard) import only this module of the training package.

Training and evaluation figures are never mixed: a point is of one
``split``. Each tick writes a ``train`` point (the training loss and the
step function's metrics, mean over trainers); a tick at which an evaluation
finished writes an ``eval`` point as well (the evaluation's metrics on the
test split, by name). Named metrics travel in the capped stream as fields
``m.<name>``, beside the fixed ones, so a stream entry stays flat.

Records written before metrics had names still parse: missing fields take
their defaults, an entry without ``split`` is a training point, and its
``accuracy`` field (then the latest evaluation accuracy, repeated) is kept
as it was.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import redis.asyncio as aioredis
from pydantic import (
    AliasChoices,
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from silo.keys import Keys
from silo.records.progress import publish_progress
from silo.redis_util import redis_errors

Split = Literal["train", "eval"]
METRIC_FIELD = "m."
"""Prefix of a named metric's field in a history stream entry (``m.accuracy``)."""


def finite_metrics(values: Mapping[str, float] | None) -> dict[str, float]:
    """The finite values of ``values`` as floats: JSON has no NaN (pydantic writes null, which
    a ``dict[str, float]`` would then refuse, losing the whole record)."""
    out: dict[str, float] = {}
    for name, v in (values or {}).items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[str(name)] = f
    return out


def _finite_or_none(v: float | None) -> float | None:
    return None if v is not None and not math.isfinite(v) else v


class Placement(BaseModel):
    """Where one trainer or parameter shard of a job lives."""

    key: str
    silo: str = ""


class MicroBatchSpan(BaseModel):
    """One micro-batch's forward (``F``) or backward (``B``) on one pipeline stage."""

    mb: int
    kind: str = Field(description="F (forward) or B (backward).")
    start: float = Field(description="Unix seconds.")
    end: float


class StageInfo(BaseModel):
    """A pipeline stage of a job (mode pipeline): where it runs, what a micro-batch costs there,
    and its spans in the job's latest step (the micro-batch timeline)."""

    key: str
    silo: str = ""
    rank: int = Field(  # read under its old name, replica, too (records in Redis)
        default=0,
        validation_alias=AliasChoices("rank", "replica"),
        description="The trainer (one copy of the whole pipeline, hybrid parallelism) the stage belongs to.",
    )
    index: int = 0
    forward_ms: float = Field(default=0.0, description="Mean compute time of one micro-batch's forward.")
    backward_ms: float = Field(default=0.0, description="Mean compute time of one micro-batch's backward.")
    param_bytes: int = Field(default=0, description="Bytes of the parameters the stage holds.")
    timeline: list[MicroBatchSpan] = Field(default_factory=list)


class CheckpointInfo(BaseModel):
    snapshot: str
    step: int
    at: float = Field(default=0.0, description="When the checkpoint was committed (unix seconds); 0: unknown.")


class RecoveryInfo(BaseModel):
    """One recovery or resize of a training job (a trainer restarted, a rollback to a
    checkpoint, an all-reduce group re-formed, a trainer added)."""

    reason: str
    start_step: int = Field(description="The step training restarted from.")
    at: float = Field(description="When the coordinator decided it (unix seconds).")
    back_after_s: float | None = Field(
        default=None, description="From the decision to the first step committed after it; None: not yet."
    )
    trainers: int = Field(default=0, description="Trainers restarted (0: every trainer).")


class JobProgress(BaseModel):
    """A training job's latest progress, JSON under ``keys.job_progress(job)``."""

    job: str
    status: str = Field(
        default="running", description="pending, running, completed, failed or cancelled."
    )
    step: int = 0
    total_steps: int | None = None
    epoch: float = Field(
        default=0.0, description="Passes over the training set so far (0 for a dataset without a length)."
    )
    loss: float | None = Field(
        default=None, description="Training loss: the mean of the trainers' latest steps."
    )
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="Training metrics by name, beside the loss (what the step function returns; "
        "latest, mean over trainers).",
    )
    eval_metrics: dict[str, float] = Field(
        default_factory=dict,
        description="The latest evaluation on the test split, by name (the default: loss, accuracy).",
    )
    eval_step: int | None = Field(default=None, description="The step the latest evaluation ran at.")
    accuracy: float | None = Field(
        default=None,
        description="Evaluation (test split) accuracy: eval_metrics['accuracy'] when the evaluation "
        "reports one.",
    )
    steps_run: float = Field(
        default=0.0,
        description="Global steps executed by this start of the job, redone ones included: a counter "
        "(a rollback re-runs steps and counts them again, so it never goes back while the job runs).",
    )
    samples_run: int = Field(
        default=0, description="Training samples processed by this start of the job, redone steps included."
    )
    samples_per_s: float = 0.0
    bytes_per_step: int = Field(
        default=0, description="Bytes on the wire per step, all trainers and shards."
    )
    max_staleness: float = Field(
        default=0.0,
        description="Largest gradient staleness seen (async / ssp): updates a shard applied between "
        "the version a trainer computed on and the apply of its push, in steps.",
    )
    max_gap: float = Field(
        default=0.0, description="ssp: how far ahead of the slowest trainer one was released, in steps (max)."
    )
    staleness: float = Field(
        default=0.0,
        description="Deprecated, for readers of earlier records: max_gap in ssp mode, else "
        "max_staleness (a maximum, whatever earlier descriptions said).",
    )
    mode: str = Field(default="sync", description="sync, async, ssp, allreduce or pipeline.")
    trainers: list[Placement] = Field(default_factory=list)
    shards: list[Placement] = Field(default_factory=list)
    stages: list[StageInfo] = Field(default_factory=list, description="Pipeline mode: the stages, by rank then index.")
    checkpoints: list[CheckpointInfo] = Field(default_factory=list)
    recoveries: list[RecoveryInfo] = Field(default_factory=list)
    updated_at: float = 0.0
    error: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _earlier_staleness(cls, data: Any) -> Any:
        # A record from before max_staleness / max_gap carries one figure, ``staleness``:
        # the gap in ssp mode, else the staleness. Put it under its own name.
        if isinstance(data, dict) and "staleness" in data and not {"max_staleness", "max_gap"} & data.keys():
            name = "max_gap" if data.get("mode") == "ssp" else "max_staleness"
            data = {**data, name: data["staleness"]}
        return data

    @field_validator("metrics", "eval_metrics", mode="before")
    @classmethod
    def _finite_metrics(cls, v: Any) -> Any:
        return finite_metrics(v) if isinstance(v, Mapping) else v

    @field_validator("loss", "accuracy", mode="after")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        return _finite_or_none(v)


class JobPoint(BaseModel):
    """One point of a job's curves in ``keys.job_history(job)`` (a capped stream), of one split."""

    step: int
    split: Split = Field(
        default="train",
        description="train: the training loss and metrics at this step; eval: an evaluation on the "
        "test split that finished at this step (entries written before splits: train).",
    )
    loss: float | None = Field(default=None, description="Training loss (train points).")
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="This split's metrics by name: train, beside the loss; eval, everything the "
        "evaluation reported (its loss included). Stream fields m.<name>.",
    )
    accuracy: float | None = Field(
        default=None,
        description="Only in entries written before splits: the latest evaluation accuracy at that "
        "step (newer entries have it as metrics['accuracy'] of an eval point).",
    )
    samples_per_s: float | None = None
    bytes: int | None = None
    at: float = 0.0

    @field_validator("metrics", mode="before")
    @classmethod
    def _finite_metrics(cls, v: Any) -> Any:
        return finite_metrics(v) if isinstance(v, Mapping) else v

    @field_validator("loss", "accuracy", "samples_per_s", mode="after")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        return _finite_or_none(v)

    def fields(self) -> dict[str, str]:
        """The flat stream entry: fixed fields (None left out) and ``m.<name>`` per metric."""
        out = {
            k: repr(v) if isinstance(v, float) else str(v)
            for k, v in self.model_dump(exclude={"metrics"}).items()
            if v is not None
        }
        out.update({METRIC_FIELD + name: repr(v) for name, v in self.metrics.items()})
        return out

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> JobPoint:
        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        flat: dict[str, Any] = {}
        metrics: dict[str, str] = {}
        for k, v in fields.items():
            key = text(k)
            if key.startswith(METRIC_FIELD):
                metrics[key[len(METRIC_FIELD):]] = text(v)
            else:
                flat[key] = text(v)
        return cls.model_validate({**flat, "metrics": metrics})


def job_point(progress: JobProgress) -> JobPoint:
    """The training point of a progress record (its step's training figures)."""
    return JobPoint(
        step=progress.step,
        split="train",
        loss=progress.loss,
        metrics=progress.metrics,
        samples_per_s=progress.samples_per_s,
        bytes=progress.bytes_per_step,
        at=progress.updated_at or time.time(),
    )


def eval_point(progress: JobProgress) -> JobPoint | None:
    """The evaluation point of a progress record (None: it holds no evaluation)."""
    if not progress.eval_metrics:
        return None
    return JobPoint(
        step=progress.step if progress.eval_step is None else progress.eval_step,
        split="eval",
        metrics=progress.eval_metrics,
        at=progress.updated_at or time.time(),
    )


def job_points(progress: JobProgress, *, evaluated: bool = False) -> list[JobPoint]:
    """This tick's points: the training one, and the evaluation one when an evaluation
    finished at this tick (``evaluated``; the record's eval figures are otherwise older)."""
    points = [job_point(progress)]
    ev = eval_point(progress) if evaluated else None
    if ev is not None:
        points.append(ev)
    return points


async def publish_job_progress(
    redis: aioredis.Redis,
    keys: Keys,
    progress: JobProgress,
    *,
    point: JobPoint | Sequence[JobPoint] | None | bool = True,
    evaluated: bool = False,
) -> bool:
    """Publish a job's progress from outside a grain (tests, tools); True if a cancel was asked.

    Grains publish with ``workload(grain).publish_progress`` (``grains.training.progress.publish``);
    both write the same records (``silo.records.progress.publish_progress``). ``point=True``
    derives this tick's points from ``progress`` (:func:`job_points`, the eval one
    when ``evaluated``); pass JobPoints to write others, or False to write none.
    """
    if not progress.updated_at:
        progress = progress.model_copy(update={"updated_at": time.time()})
    if point is True:
        points = job_points(progress, evaluated=evaluated)
    elif isinstance(point, JobPoint):
        points = [point]
    elif point is None or isinstance(point, bool):
        points = []
    else:
        points = list(point)
    record = progress.model_dump_json()
    if not points:
        return await publish_progress(redis, keys, progress.job, record, None)
    cancel = False
    # One round trip per point: a tick has one, two when an evaluation finished.
    for p in points:
        cancel = await publish_progress(redis, keys, progress.job, record, p.fields()) or cancel
    return cancel


async def read_jobs(redis: aioredis.Redis, keys: Keys) -> list[JobProgress]:
    """Every job's latest progress record, sorted by job id (unreadable records skipped)."""
    with redis_errors("read jobs"):
        names = sorted(j.decode() if isinstance(j, bytes) else j for j in await redis.smembers(keys.jobs))
        raws = await redis.mget([keys.job_progress(j) for j in names]) if names else []
    out = []
    for raw in raws:
        if raw is not None:
            try:
                out.append(JobProgress.model_validate_json(raw))
            except ValidationError:
                continue
    return out
