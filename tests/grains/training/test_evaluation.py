"""Mid-run evaluation runs on one committed step's weights, labelled with that step.

It used to read each shard while training went on, at whatever step each was,
and label the result with the slowest trainer's step (``eval_every = 80``
evaluated "steps" like 83 and 165). Now every multiple of ``eval_every`` is a
checkpoint, and the evaluation of step c is that of checkpoint c.
"""

from __future__ import annotations

import pytest

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.data.batches import Batches, batch_samples
from grains.training.datasets import load_dataset
from grains.training.loop.program import Program, evaluate
from grains.training.models import build_model
from grains.training.strategies.cluster import key_on
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job, training_silos


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
async def test_mid_run_evaluations_are_those_of_the_committed_checkpoints_they_name(cluster, client, mode):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(mode=mode, trainers=2, steps=60, batch_size=32, lr=0.05, eval_every=15,
                       checkpoint_every=25, keep_checkpoints=10, seed=2)  # fmt: skip
    st = await run_job(client, f"eval-{mode}", spec)
    assert st.status == "completed", st
    coord = client.get_grain(CoordinatorGrain, f"eval-{mode}")
    evals = [(h.step, h.eval_metrics) for h in await coord.history() if h.eval_metrics is not None]
    assert [step for step, _ in evals] == [15, 30, 45, 60], evals  # every eval_every steps, exactly, and the end
    assert {15, 25, 30, 45, 50, 60} <= set(st.checkpoints), st  # evaluation steps are checkpoints
    program = Program.of(spec)
    test = Batches(load_dataset(spec, "test"))
    model = build_model(spec)
    for step, got in evals:
        model.load_state_dict(await coord.state_dict(step=step), strict=True)
        want = evaluate(program, model, test.eval_batches(spec.eval_batch_size), batch_samples)
        assert got == want, (step, got, want)
    assert st.eval_step == 60


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
async def test_evaluations_run_on_the_trainers_silo_not_the_coordinators(cluster, client, mode):
    """The coordinator's silo (no trainer role: no trainer there) asks the rank-0 trainer, whose
    silo has the job's device, to evaluate; the results are the checkpoints' evaluations."""
    (plain,) = await cluster(1, grains=GRAINS, membership=MembershipSettings())
    (trainer_silo,) = await cluster(1, grains=GRAINS, membership=MembershipSettings(), roles=("trainer",))
    rows = await training_silos(client, 2)
    job = key_on("CoordinatorGrain", f"eval-where-{mode}", plain.address, rows)
    spec = TrainingJob(mode=mode, trainers=1, steps=30, batch_size=32, lr=0.05, eval_every=10, keep_checkpoints=10, seed=4)
    st = await run_job(client, job, spec)
    assert st.status == "completed", st
    assert st.coordinator_silo == str(plain.address), st
    assert st.trainer_silos == [str(trainer_silo.address)], st
    assert (st.eval_silo, st.eval_device, st.eval_step) == (str(trainer_silo.address), "cpu", 30), st
    coord = client.get_grain(CoordinatorGrain, job)
    evals = {h.step: h.eval_metrics for h in await coord.history() if h.eval_metrics is not None}
    assert sorted(evals) == [10, 20, 30], evals  # the final evaluation is a point of the history too
    program, test, model = Program.of(spec), Batches(load_dataset(spec, "test")), build_model(spec)
    for step in (10, 20, 30):
        model.load_state_dict(await coord.state_dict(step=step), strict=True)
        want = evaluate(program, model, test.eval_batches(spec.eval_batch_size), batch_samples)
        assert evals[step] == want, step


async def test_pipeline_jobs_leave_the_evaluation_to_the_coordinator(cluster, client):
    """No stage holds the whole model: the coordinator evaluates on its own silo and device."""
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(mode="pipeline", stages=2, trainers=1, steps=12, batch_size=32, microbatches=2,
                       model_args={"hidden": [32, 32]}, eval_every=6, seed=5)  # fmt: skip
    st = await run_job(client, "eval-pipeline", spec)
    assert st.status == "completed", st
    assert (st.eval_silo, st.eval_device, st.eval_step) == (st.coordinator_silo, "cpu", 12), st
