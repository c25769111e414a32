"""A job's progress as the dashboard's ``JobProgress`` record (grains/training/records.py)."""

from __future__ import annotations

import time

from grains.base import Grain
from grains.training.job import TrainingJob
from grains.training.messages import TrainingStatus
from grains.training.records import (
    CheckpointInfo,
    JobProgress,
    Placement,
    RecoveryInfo,
    job_point,
)


def job_progress(st: TrainingStatus, spec: TrainingJob | None, trainer_keys: list[str], shard_keys: list[str]) -> JobProgress:
    now = time.time()
    return JobProgress(
        job=st.job,
        status="pending" if st.status in ("idle", "starting") else st.status,
        step=st.step,
        total_steps=st.total_steps or None,
        loss=st.loss,
        accuracy=st.accuracy,
        samples_per_s=st.samples_per_s,
        bytes_per_step=int(st.bytes_per_step),
        staleness=float(st.max_gap if spec is not None and spec.mode == "ssp" else st.max_staleness),
        mode=spec.mode if spec is not None else "sync",
        trainers=[Placement(key=k, silo=s) for k, s in zip(trainer_keys, st.trainer_silos + [""] * len(trainer_keys))],
        shards=[Placement(key=k, silo=s) for k, s in zip(shard_keys, st.shard_silos + [""] * len(shard_keys))],
        checkpoints=[CheckpointInfo(snapshot=str(c), step=c, at=now) for c in st.checkpoints],
        recoveries=[
            RecoveryInfo(
                reason=c.reason,
                start_step=c.start_step,
                at=c.at,
                trainers=len(c.slots),
                back_after_s=(c.first_step_at - c.at) if c.first_step_at is not None else None,
            )
            for c in st.changes
        ],
        updated_at=now,
        error=st.error or None,
    )


async def publish(grain: Grain, st: TrainingStatus, spec: TrainingJob | None, trainer_keys: list[str], shard_keys: list[str]) -> bool:
    """Publish the job's progress through the grain's silo; True when an admin asked to cancel."""
    progress = job_progress(st, spec, trainer_keys, shard_keys)
    return await grain.publish_progress(progress.job, progress, job_point(progress).model_dump())
