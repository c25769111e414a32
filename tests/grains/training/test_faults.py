"""SIGKILL a trainer's, a shard's or the coordinator's silo mid-run: the job still finishes, as well.

Real silo processes (3), fast failure detection. Sync mode is deterministic
given its batches, so the undisturbed result is a plain torch loop; a run that
restarts a trainer or rolls back to a checkpoint must land within a
point of it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from grains.training import CoordinatorGrain, TrainingJob, TrainingStatus
from grains.training.datasets import load_dataset
from grains.training.models import build_model
from grains.training.strategies.cluster import key_on
from silo import errors
from tests.grains.training.conftest import training_silos
from tests.grains.training.test_sync import reference_parameters

pytestmark = pytest.mark.slow

SPEC = {"mode": "sync", "steps": 400, "batch_size": 32, "optimizer": "momentum", "lr": 0.05, "checkpoint_every": 50}


def reference_accuracy(spec: TrainingJob, trainers: int) -> float:
    params = reference_parameters(spec, trainers=trainers, steps=spec.steps or 0)
    model = build_model(spec)
    model.load_state_dict(params)
    x, y = load_dataset(spec, "test").tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


async def status_when(coord: Any, pred: Any, timeout_s: float = 90.0) -> TrainingStatus:
    """Poll the coordinator (another process) until ``pred(status)``; its silo may be down a while."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            st: TrainingStatus = await coord.with_timeout(5.0).status()
            if pred(st):
                return st
            assert st.status not in ("failed", "cancelled"), st
        except errors.RedgrainError:
            pass  # the coordinator's silo is being declared dead; it comes back elsewhere
        if loop.time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.1)


def process_of(procs: list[Any], silo: str) -> Any:
    return next(p for p in procs if str(p.address) == silo)


async def run_and_kill(
    client: Any, procs: list[Any], victim: str, *, trainers: int, shards: int, coordinator_on: int,
    **spec_overrides: Any,
) -> None:
    """Start a job with the coordinator on the ``coordinator_on``-th live silo, kill the silo that
    hosts only the ``victim`` mid-run, and check the job completes as well as undisturbed."""
    alive = {str(p.address) for p in procs if p.alive()}
    rows = await training_silos(client, len(alive))  # the previous victim out of the view before we place
    assert {r.address for r in rows} == alive, (rows, alive)
    job = key_on("CoordinatorGrain", f"kill-{victim}", rows[coordinator_on].silo, rows)
    spec = TrainingJob(**{**SPEC, **spec_overrides}, trainers=trainers, shards=shards)
    coord = client.get_grain(CoordinatorGrain, job)
    await coord.start(spec)
    st = await status_when(coord, lambda s: s.status == "running" and s.checkpoints and s.step >= 100)
    assert st.step < 350, "the job ran too fast to be killed mid-run"
    busy = {"trainer": set(st.trainer_silos), "shard": set(st.shard_silos), "coordinator": {st.coordinator_silo}}
    alone = busy[victim] - set().union(*(v for k, v in busy.items() if k != victim))
    assert alone, f"no silo hosts only a {victim}: {busy}"
    process_of(procs, min(alone)).kill()
    killed_at, killed_step = time.time(), st.step

    final = await status_when(coord, lambda s: s.status == "completed")
    want = reference_accuracy(spec, trainers)
    assert final.step == spec.steps
    assert final.accuracy is not None and abs(final.accuracy - want) <= 0.01, (victim, final.accuracy, want)
    if victim == "coordinator":
        return
    # The recovery is on record, with when its first step was committed (the benchmark's
    # kill -> next committed step); a trainer alone resumed where it stopped, a lost
    # shard rolled everyone back, losing at most what a checkpoint not yet saved adds.
    change = next(c for c in final.changes if c.at >= killed_at)
    assert change.first_step_at is not None and change.first_step_at > change.at, change
    if victim == "trainer":
        assert final.restarts >= 1 and final.rollbacks == 0, final
        assert change.ranks and change.start_step >= killed_step, change
    else:
        assert final.rollbacks >= 1, final
        assert change.ranks == [] and killed_step - change.start_step <= 2 * spec.checkpoint_every, change


# The shard case keeps one checkpoint, taken every 10 steps: shards then complete (and the
# store drops) checkpoints faster than the coordinator's ticks see them, so the rollback
# must restore the store's newest complete checkpoint, not the one it last committed.
@pytest.mark.parametrize(
    ("victim", "shards", "coordinator_on", "overrides"),
    [("coordinator", 1, 2, {}), ("trainer", 2, 2, {}), ("shard", 2, 0, {"checkpoint_every": 10, "keep_checkpoints": 1})],
)
async def test_job_survives_sigkill_of_a_silo_mid_run(silo_processes, client, victim, shards, coordinator_on, overrides):
    # Three silos sorted by address: trainers on the first two, shard i on silo i+1, the
    # coordinator where we steer it; so the victim's silo hosts nothing else.
    procs = silo_processes(3, grains="grains.training")
    await run_and_kill(client, procs, victim, trainers=2, shards=shards, coordinator_on=coordinator_on, **overrides)
