"""A snapshot an abandoned run or generation left behind never blocks a new one's checkpoint.

A rolled-back generation (or a run that failed before its coordinator committed
what its holders saved) leaves snapshots at step ids the next one saves again.
The new run's save used to be refused (``StorageError: ... the snapshot is
complete and can no longer change``, or ``... started with members ...``), and
that checkpoint and its evaluation went silently missing.
"""

from __future__ import annotations

import torch

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.state.store import CheckpointStoreGrain
from tests.grains.training.conftest import GRAINS, run_job


async def test_a_resumed_run_saves_its_checkpoint_over_a_leftover_at_the_same_step(cluster, client):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(mode="sync", trainers=2, shards=2, steps=10, batch_size=16, checkpoint_every=5, keep_checkpoints=10)
    first = await run_job(client, "leftover", spec)
    assert first.status == "completed" and first.checkpoints[-2:] == [5, 10], first
    # What an abandoned generation left: a complete snapshot at step 15 nobody committed.
    coord = client.get_grain(CoordinatorGrain, "leftover")
    weights = await coord.state_dict(step=10)
    junk = TrainingSnapshot(step=15, version=15, params={k: torch.zeros_like(v) for k, v in weights.items()}, optimizer={})
    store = client.get_grain(CheckpointStoreGrain, "leftover")
    assert await store.save_whole(first.run, junk, 10) is True
    second = await run_job(client, "leftover", spec.model_copy(update={"steps": 20, "resume": True}))
    assert second.status == "completed", second
    assert second.checkpoints[-3:] == [10, 15, 20], second
    at_15 = await coord.state_dict(step=15)
    assert all(not torch.equal(v, torch.zeros_like(v)) for v in at_15.values() if v.is_floating_point())
