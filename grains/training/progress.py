"""A job's progress as the dashboard's records (grains/training/api/records.py).

The coordinator calls :func:`publish` once a tick: it writes the job's
``JobProgress`` and the points its history gained since the last publish
(:mod:`grains.training.history`): the dashboard's curves are the job's history,
a training point per completed step and an evaluation point at its checkpoint's
step, so training and evaluation figures never share a point (or a curve).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

from grains.training.api.job import TrainingJob
from grains.training.api.messages import HistoryPoint, TrainingStatus
from grains.training.api.records import (
    METRIC_FIELD,
    CheckpointInfo,
    JobPoint,
    JobProgress,
    Placement,
    RecoveryInfo,
    finite_metrics,
)
from grains.workload import Workload


def job_progress(
    st: TrainingStatus,
    spec: TrainingJob | None,
    trainer_keys: list[str],
    shard_keys: list[str],
    *,
    checkpoint_at: Mapping[int, float] | None = None,
) -> JobProgress:
    """The record of ``st``; ``checkpoint_at`` (step -> commit time) dates the checkpoints
    (a step missing from it shows as time unknown, never as the publish time)."""
    now = time.time()
    mode = spec.mode if spec is not None else (st.mode or "sync")
    when = checkpoint_at or {}
    return JobProgress(
        job=st.job,
        status="pending" if st.status in ("idle", "starting") else st.status,
        step=st.step,
        total_steps=st.total_steps or None,
        epoch=st.epoch,
        steps_run=st.steps_run,
        samples_run=st.samples_run,
        loss=st.loss,
        metrics=st.metrics,
        eval_metrics=st.eval_metrics,
        eval_step=st.eval_step,
        accuracy=st.eval_metrics.get("accuracy", st.accuracy),
        samples_per_s=st.samples_per_s,
        bytes_per_step=int(st.bytes_per_step),
        max_staleness=float(st.max_staleness),
        max_gap=float(st.max_gap),
        staleness=float(st.max_gap if mode == "ssp" else st.max_staleness),
        mode=mode,
        trainers=[Placement(key=k, silo=s) for k, s in zip(trainer_keys, st.trainer_silos + [""] * len(trainer_keys))],
        shards=[Placement(key=k, silo=s) for k, s in zip(shard_keys, st.shard_silos + [""] * len(shard_keys))],
        stages=list(st.stages),
        checkpoints=[CheckpointInfo(snapshot=str(c), step=c, at=when.get(c, 0.0)) for c in st.checkpoints],
        recoveries=[
            RecoveryInfo(
                reason=c.reason,
                start_step=c.start_step,
                at=c.at,
                trainers=len(c.ranks),
                back_after_s=(c.first_step_at - c.at) if c.first_step_at is not None else None,
            )
            for c in st.changes
        ],
        updated_at=now,
        error=st.error or None,
    )


def history_point(point: HistoryPoint, bytes_per_step: int | None = None) -> JobPoint:
    """A history point as a curve point of the dashboard's stream (its split: train or eval)."""
    if point.eval_metrics is not None:
        return JobPoint(step=point.step, split="eval", metrics=point.eval_metrics, at=point.at)
    return JobPoint(step=point.step, split="train", loss=point.loss, metrics=point.metrics,
                    samples_per_s=point.samples_per_s, bytes=bytes_per_step, at=point.at)  # fmt: skip


def training_fields(point: HistoryPoint, bytes_per_step: int | None = None) -> dict[str, str]:
    """``history_point(point, bytes_per_step).fields()`` of a training point, field for field,
    without building the ``JobPoint``: a job publishes one a step, and the model's validation
    and dump took 12 µs of the loop a point against 4.5 µs for this (loaded 2-core machine)."""
    out = {"step": str(point.step), "split": "train"}
    if point.loss is not None and math.isfinite(point.loss):
        out["loss"] = repr(point.loss)
    if math.isfinite(point.samples_per_s):
        out["samples_per_s"] = repr(point.samples_per_s)
    if bytes_per_step is not None:
        out["bytes"] = str(bytes_per_step)
    out["at"] = repr(point.at)
    for name, v in finite_metrics(point.metrics).items():
        out[METRIC_FIELD + name] = repr(v)
    return out


async def publish(
    through: Workload,
    st: TrainingStatus,
    spec: TrainingJob | None,
    trainer_keys: list[str],
    shard_keys: list[str],
    *,
    points: Sequence[HistoryPoint] = (),
    restart: bool = False,
    checkpoint_at: Mapping[int, float] | None = None,
) -> bool:
    """Publish the job's progress through a grain's silo (``workload(grain)``), in one round
    trip; True when an admin asked to cancel.

    ``points``: what the job's history gained since the last publish (none: the record alone);
    ``restart``: they are the whole history, which lost points (an early stop, a rollback).
    """
    progress = job_progress(st, spec, trainer_keys, shard_keys, checkpoint_at=checkpoint_at)
    fields = [
        history_point(p, progress.bytes_per_step).fields() if p.eval_metrics is not None
        else training_fields(p, progress.bytes_per_step)
        for p in points
    ]  # fmt: skip
    return await through.publish_progress(progress.job, progress, fields, restart_history=restart)
