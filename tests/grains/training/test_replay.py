"""A rollback replays exactly: after a shard's silo is lost, the job goes back to the last
committed checkpoint and the replayed steps give the same parameters, bit for bit, as a
run that was never disturbed (sync mode).

Why it can be exact: the checkpoint holds the shards' fp32 weights and optimizer state
bit-exactly, the batch of (rank, step) is a function of the seed, two trainers' gradients
sum the same in either order, and no job state lives outside the checkpoint (with lossy
compression a trainer flushes its error-feedback residual at every checkpoint step, so a
restarted trainer's empty residual is the one the undisturbed run had there too).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from grains.training import CoordinatorGrain, TrainingJob, TrainingStatus
from grains.training.strategies.cluster import key_on
from tests.grains.training.conftest import GRAINS, wait_done

SPEC = {"mode": "sync", "trainers": 2, "shards": 2, "steps": 400, "batch_size": 32, "optimizer": "momentum",
        "lr": 0.05, "weight_decay": 1e-4, "checkpoint_every": 50, "seed": 5}  # fmt: skip


async def status_when(coord: Any, pred: Any, timeout_s: float = 60.0) -> TrainingStatus:
    """Poll the coordinator's status (the job runs in its own tasks) until ``pred`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        st: TrainingStatus = await coord.status()
        if pred(st) or st.status in ("completed", "failed", "cancelled"):
            return st
        assert loop.time() < deadline, st
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("compression", ["none", "topk:0.01"])
async def test_rollback_after_a_shard_loss_replays_to_the_undisturbed_parameters(cluster, client, compression):
    silos = await cluster(3, grains=GRAINS)
    for silo in silos:
        await silo.view.refresh()
    await client.refresh()
    rows = sorted(client.view.hosting("CoordinatorGrain"), key=lambda r: r.address)
    assert len(rows) == 3
    # Trainers land on the first two silos by address, shard i on silo i+1: with the
    # coordinator on the first, the third silo hosts shard 1 and nothing else.
    spec = TrainingJob(**SPEC, compression=compression)
    quiet = client.get_grain(CoordinatorGrain, key_on("CoordinatorGrain", "quiet", rows[0].silo, rows))
    await quiet.start(spec)
    undisturbed = await wait_done(quiet)
    assert undisturbed.status == "completed" and undisturbed.rollbacks == 0, undisturbed
    want = await quiet.parameters()

    coord = client.get_grain(CoordinatorGrain, key_on("CoordinatorGrain", "hit", rows[0].silo, rows))
    await coord.start(spec)
    st = await status_when(coord, lambda s: bool(s.checkpoints) and s.step > s.checkpoints[-1])
    assert st.status == "running" and st.step < 300, f"the job got too far to be hit mid-run: {st}"
    victim = rows[2].address
    assert victim in st.shard_silos and victim not in st.trainer_silos + [st.coordinator_silo], st
    await next(s for s in silos if str(s.address) == victim).stop(graceful=False)

    final = await wait_done(coord)
    assert final.status == "completed" and final.rollbacks >= 1, final
    got = await coord.parameters()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), (name, (got[name] - want[name]).abs().max())
    assert final.accuracy == undisturbed.accuracy
