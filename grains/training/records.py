"""What training jobs publish for the dashboard and ``redgrain train --status``; no torch.

A coordinator publishes its job's :class:`JobProgress` (the latest figures,
placements, checkpoints and recoveries) and one :class:`JobPoint` per step
through the public grain facility ``Grain.publish_progress``; readers (the
dashboard) import only this module of the training package.
"""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from silo.keys import Keys
from silo.records import publish_progress


class Placement(BaseModel):
    """Where one trainer or parameter shard of a job lives."""

    key: str
    silo: str = ""


class CheckpointInfo(BaseModel):
    snapshot: str
    step: int
    at: float


class RecoveryInfo(BaseModel):
    """One recovery or resize of a training job (a trainer slot restarted, a rollback to a
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
    epoch: int = 0
    loss: float | None = None
    accuracy: float | None = None
    samples_per_s: float = 0.0
    bytes_per_step: int = Field(
        default=0, description="Bytes on the wire per step, all trainers and shards."
    )
    staleness: float = Field(
        default=0.0, description="Mean gradient staleness in steps (async / ssp)."
    )
    mode: str = Field(default="sync", description="sync, async or ssp.")
    trainers: list[Placement] = Field(default_factory=list)
    shards: list[Placement] = Field(default_factory=list)
    checkpoints: list[CheckpointInfo] = Field(default_factory=list)
    recoveries: list[RecoveryInfo] = Field(default_factory=list)
    updated_at: float = 0.0
    error: str | None = None


class JobPoint(BaseModel):
    """One step's metrics in ``keys.job_history(job)`` (a capped stream)."""

    step: int
    loss: float | None = None
    accuracy: float | None = None
    samples_per_s: float | None = None
    bytes: int | None = None
    at: float = 0.0

    def fields(self) -> dict[str, str]:
        return {
            k: repr(v) if isinstance(v, float) else str(v)
            for k, v in self.model_dump().items()
            if v is not None
        }

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> JobPoint:
        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        return cls.model_validate({text(k): text(v) for k, v in fields.items()})


def job_point(progress: JobProgress) -> JobPoint:
    """The history point of a progress record (its step's figures)."""
    return JobPoint(
        step=progress.step,
        loss=progress.loss,
        accuracy=progress.accuracy,
        samples_per_s=progress.samples_per_s,
        bytes=progress.bytes_per_step,
        at=progress.updated_at or time.time(),
    )


async def publish_job_progress(
    redis: aioredis.Redis, keys: Keys, progress: JobProgress, *, point: JobPoint | None | bool = True
) -> bool:
    """Publish a job's progress from outside a grain (tests, tools); True if a cancel was asked.

    Grains publish with ``Grain.publish_progress``; both write the same records
    (``silo.records.publish_progress``). ``point=True`` derives the point from
    ``progress``; pass a JobPoint to write another, or False to write none.
    """
    if not progress.updated_at:
        progress = progress.model_copy(update={"updated_at": time.time()})
    if point is True:
        point = job_point(progress)
    fields = point.fields() if isinstance(point, JobPoint) else None
    return await publish_progress(redis, keys, progress.job, progress.model_dump_json(), fields)
