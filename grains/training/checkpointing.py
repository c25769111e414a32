"""Checkpoint storage for parameter shards, on the silo's snapshot API (silo/checkpoint.py).

Every shard of a job saves its part of snapshot ``(training.{job}.r{run}, step)``
with the same member list, so the snapshot becomes complete (and listed)
only when all shards have saved that step; the store keeps the newest
``keep_checkpoints`` complete ones. The coordinator tracks the same thing
from the shards' reports and restores only complete steps.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from grains.base import Grain
from silo import errors


class ShardSnapshot(BaseModel):
    """Everything a shard needs to resume exactly: fp32 parameters and optimizer state."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    step: int
    version: int
    params: dict[str, torch.Tensor]
    """In model order (the optimizer state is indexed by it)."""
    optimizer: dict[str, Any]
    """``torch.optim.Optimizer.state_dict()`` of the shard's optimizer."""


class SnapshotState(BaseModel):
    """A shard's state: empty, except while a snapshot is being saved or loaded."""

    snapshot: ShardSnapshot | None = None


def group(job: str, run: int) -> str:
    return f"training.{job}.r{run}"


def member(shard_key: str) -> str:
    return f"ParamShardGrain/{shard_key}"


async def save(
    shard: Grain, job: str, run: int, snapshot: ShardSnapshot, shard_keys: list[str], keep: int
) -> bool:
    """Save this shard's part of the job's snapshot at ``snapshot.step``; True if it completed it."""
    shard.state.snapshot = snapshot
    try:
        # save_snapshot encodes the state before its first await, so saves of
        # two steps may overlap safely.
        return await shard.save_snapshot(group(job, run), snapshot.step, [member(k) for k in shard_keys], keep=keep)
    finally:
        shard.state.snapshot = None


async def load(shard: Grain, job: str, run: int, step: int) -> ShardSnapshot:
    await shard.load_snapshot(group(job, run), step, write=False)
    snap, shard.state.snapshot = shard.state.snapshot, None
    if snap is None:
        raise errors.StorageError(f"snapshot {group(job, run)}/{step} holds no shard data for {shard.key}")
    return snap  # type: ignore[no-any-return]
