"""Pipeline schedules as action lists, and a non-finite loss in pipeline mode (on_nonfinite)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.models import build_model
from grains.training.strategies.pipeline.driver import PipelineDriver
from grains.training.strategies.pipeline.schedules import Action, actions, peak_activations
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job
from tests.grains.training.pipeline_data import samples


def plan(text: str) -> list[Action]:
    return [Action(a[0], int(a[1:])) for a in text.split()]  # type: ignore[arg-type]


def test_gpipe_runs_every_forward_then_every_backward_on_each_stage():
    for stage in range(3):
        assert actions("gpipe", 3, stage, 4) == plan("F0 F1 F2 F3 B0 B1 B2 B3")


def test_1f1b_warms_up_with_fewer_forwards_the_later_the_stage():
    assert actions("1f1b", 3, 0, 4) == plan("F0 F1 F2 B0 F3 B1 B2 B3")
    assert actions("1f1b", 3, 1, 4) == plan("F0 F1 B0 F2 B1 F3 B2 B3")
    assert actions("1f1b", 3, 2, 4) == plan("F0 B0 F1 B1 F2 B2 F3 B3")
    assert actions("1f1b", 4, 0, 2) == plan("F0 F1 B0 B1")  # fewer micro-batches than stages
    assert actions("1f1b", 1, 0, 2) == plan("F0 B0 F1 B1")


@pytest.mark.parametrize(("stages", "m"), [(3, 4), (4, 8), (4, 2), (1, 3)])
def test_1f1b_holds_at_most_stages_minus_i_activations_and_gpipe_all_of_them(stages, m):
    for i in range(stages):
        one = actions("1f1b", stages, i, m)
        assert peak_activations(one) == min(m, stages - i)
        assert peak_activations(actions("gpipe", stages, i, m)) == m
        assert sorted(one, key=lambda a: (a.kind, a.mb)) == sorted(actions("gpipe", stages, i, m), key=lambda a: (a.kind, a.mb))


def test_a_stage_outside_the_pipeline_has_no_schedule():
    with pytest.raises(ValueError, match="no stage 3"):
        actions("1f1b", 3, 3, 4)


@pytest.mark.parametrize(("stages", "schedule"), [(2, "1f1b"), (3, "1f1b"), (3, "gpipe")])
async def test_each_stage_computes_in_its_schedules_order(cluster, client, stages, schedule):
    await cluster(stages, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(model_args={"hidden": [64, 64]}, mode="pipeline", trainers=1, stages=stages, microbatches=4,
                       schedule=schedule, batch_size=32, steps=6, checkpoint_every=0)  # fmt: skip
    st = await run_job(client, f"order-{stages}-{schedule}", spec, timeout_s=120)
    assert st.status == "completed" and len(st.stages) == stages, st
    for g in st.stages:  # the latest step's spans as they ran, not sorted
        assert [(sp.kind, sp.mb) for sp in g.timeline] == [(a.kind, a.mb) for a in actions(schedule, stages, g.index, 4)], g
        assert all(a.end <= b.start + 1e-3 for a, b in zip(g.timeline, g.timeline[1:])), g.timeline  # one at a time


# --- on_nonfinite -----------------------------------------------------------------
B, STEPS, NAN_STEP = 32, 12, 7


def nan_job(on_nonfinite: str, trainers: int = 1) -> TrainingJob:
    """Step 7's loss is NaN; with several trainers (hybrid), only in the last one's share."""
    return TrainingJob(model_args={"hidden": [64, 64]}, mode="pipeline", trainers=trainers, stages=2, microbatches=4,
                       schedule="1f1b", batch_size=B, steps=STEPS, optimizer="momentum", lr=0.05, warmup_steps=STEPS,
                       clip_grad_norm=1.0, checkpoint_every=5, seed=3, on_nonfinite=on_nonfinite,
                       dataset="tests.grains.training.pipeline_data:marked_digits",
                       dataset_args={"n": STEPS * B * trainers, "nan_at": nan_at(trainers)})  # fmt: skip


def nan_at(trainers: int) -> int:
    """Micro-batch 2 of step 7 of the last trainer (the stream's global batch of a step is the
    trainers' batches in rank order)."""
    return NAN_STEP * B * trainers + (trainers - 1) * B + 17


def skipping_loop(spec: TrainingJob) -> dict[str, torch.Tensor]:
    """One process, the same batches; step 7 computes a NaN loss and applies nothing, but the
    learning-rate warm-up steps on."""
    model = build_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / (STEPS + 1), end_factor=1.0, total_iters=STEPS)
    k = int(spec.trainers)
    x_all, y_all = samples("train", STEPS * B * k, nan_at(k))
    for t in range(STEPS):
        opt.zero_grad()
        x, y = x_all[t * B * k : (t + 1) * B * k], y_all[t * B * k : (t + 1) * B * k]
        loss = F.cross_entropy(model(x), y)
        assert torch.isfinite(loss).item() == (t != NAN_STEP), t
        if t != NAN_STEP:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        sched.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_skipped_as_one_process(got: dict[str, torch.Tensor], spec: TrainingJob) -> None:
    want = skipping_loop(spec)
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.isfinite(got[k]).all(), k
        assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-5), (k, (got[k] - v).abs().max())


async def test_a_nan_loss_with_skip_skips_that_step_on_every_stage_and_counts_it(cluster, client, monkeypatch):
    reported = []
    progress = PipelineDriver._progress

    def spy(self, head, rank):
        out = progress(self, head, rank)
        reported.append(out)
        return out

    monkeypatch.setattr(PipelineDriver, "_progress", spy)
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = nan_job("skip")
    st = await run_job(client, "nan-pipe-skip", spec, timeout_s=120)
    assert st.status == "completed" and st.rollbacks == 0 and st.step == STEPS, st
    assert reported and reported[-1].skipped == 1, reported[-1:]  # the skip count the status reads
    got = await client.get_grain(CoordinatorGrain, "nan-pipe-skip").state_dict()
    assert_skipped_as_one_process(got, spec)


async def test_in_hybrid_a_step_one_trainer_finds_nan_is_skipped_by_every_trainer(cluster, client):
    """Two copies of two stages: only the second copy's share of step 7 is NaN; both skip the step
    (its stage 0 says so to the reduction), the learning-rate schedule steps on, nothing rolls back."""
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = nan_job("skip", trainers=2)
    st = await run_job(client, "nan-hybrid-skip", spec, timeout_s=120)
    assert st.status == "completed" and st.rollbacks == 0 and st.step == STEPS, st
    assert st.trainers == 2 and len(st.stages) == 4, st
    got = await client.get_grain(CoordinatorGrain, "nan-hybrid-skip").state_dict()
    assert_skipped_as_one_process(got, spec)


async def test_a_nan_loss_with_fail_fails_the_job_at_once_naming_the_step(cluster, client):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    st = await run_job(client, "nan-pipe-fail", nan_job("fail"), timeout_s=120)
    assert st.status == "failed" and st.rollbacks == 0, st
    assert f"step {NAN_STEP}: the loss is nan" in st.error and "NonFiniteLossError" in st.error, st.error


async def test_a_stage_refuses_a_tensor_of_an_older_generation_or_of_a_step_it_does_not_run(cluster, client):
    from grains.training.strategies.pipeline.stage import PipelineStageGrain
    from tests.grains.training.test_faults import status_when

    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(model_args={"hidden": [64, 64]}, mode="pipeline", trainers=1, stages=2, microbatches=4,
                       batch_size=32, steps=100_000, checkpoint_every=0)  # fmt: skip
    coord = client.get_grain(CoordinatorGrain, "pipe-refuse")
    await coord.start(spec)
    st = await status_when(coord, lambda s: s.status == "running" and s.step >= 2)
    stage = client.get_grain(PipelineStageGrain, st.trainer_keys[1])
    now = await stage.status()
    grad = torch.zeros(8, 64)
    with pytest.raises(Exception, match="generation"):  # a late backward of a stopped generation
        await stage.backward(now.generation - 1, now.step, 0, grad)
    with pytest.raises(Exception, match="runs step"):  # a step that is not the stage's current one
        await stage.forward(now.generation, now.step + 1000, 0, grad)
    await coord.cancel()
    assert (await coord.status()).rollbacks == 0
