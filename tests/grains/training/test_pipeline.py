"""Pipeline parallelism: a model cut into stage grains on different silos trains as one process does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.models import build_model
from grains.training.strategies.pipeline.partition import stage_layers
from grains.training.strategies.pipeline.schedules import actions
from silo import errors
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job
from tests.grains.training.test_own_step import global_batches

DEEP = {"model_args": {"hidden": [64, 64]}}  # Flatten, (Linear, ReLU) x 2, Linear: 6 layers


def plain_loop(spec: TrainingJob, steps: int) -> dict[str, torch.Tensor]:
    model = build_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    for x, y in global_batches(spec, 1, steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("stages", "schedule"), [(2, "gpipe"), (2, "1f1b"), (3, "gpipe"), (3, "1f1b")])
async def test_stages_with_four_microbatches_equal_the_single_process_loop(cluster, client, stages, schedule):
    await cluster(3, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(**DEEP, mode="pipeline", trainers=1, stages=stages, microbatches=4, schedule=schedule,
                       batch_size=32, steps=24, optimizer="momentum", lr=0.05, weight_decay=1e-4,
                       clip_grad_norm=1.0, checkpoint_every=10, seed=4)  # fmt: skip
    st = await run_job(client, f"pipe-{stages}-{schedule}", spec, timeout_s=120)
    assert st.status == "completed", st
    assert st.checkpoints[-2:] == [20, 24] and len(set(st.trainer_silos)) == stages, st  # one stage a silo
    # Each stage's place, its times and the latest step's micro-batch timeline, for the dashboard.
    assert [(g.index, g.silo) for g in st.stages] == list(enumerate(st.trainer_silos)), st.stages
    for g in st.stages:
        assert g.forward_ms > 0 and g.backward_ms > 0, g
        # In execution order: the schedule's action list (1f1b interleaves, gpipe does not).
        assert [(sp.kind, sp.mb) for sp in g.timeline] == [(a.kind, a.mb) for a in actions(schedule, stages, g.index, 4)], g
        assert all(sp.start <= sp.end for sp in g.timeline)
    got = await client.get_grain(CoordinatorGrain, f"pipe-{stages}-{schedule}").state_dict()
    want = plain_loop(spec, 24)
    assert set(got) == set(want)
    for k, v in want.items():
        # Micro-batch gradients summed in another order than the full batch's: float tolerance.
        assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-5), (k, (got[k] - v).abs().max())


async def test_the_digits_mlp_in_three_stages_reaches_sync_accuracy(cluster, client):
    await cluster(3, grains=GRAINS)
    common = {"optimizer": "momentum", "lr": 0.05, "batch_size": 64, "steps": 300, "checkpoint_every": 100, **DEEP}
    piped = await run_job(client, "pipe-acc", TrainingJob(**common, mode="pipeline", trainers=1, stages=3), timeout_s=180)
    sync = await run_job(client, "sync-acc", TrainingJob(**common, mode="sync", trainers=1, shards=1))
    assert piped.status == sync.status == "completed", (piped, sync)
    assert piped.accuracy is not None and sync.accuracy is not None and piped.accuracy >= 0.9, piped
    assert abs(piped.accuracy - sync.accuracy) <= 0.01, (piped.accuracy, sync.accuracy)


def test_a_model_that_cannot_be_cut_as_asked_is_refused():
    with pytest.raises(errors.ConfigError, match="only 4 layers"):
        stage_layers(build_model(TrainingJob()), 5)  # the default MLP: Flatten, Linear, ReLU, Linear
    with pytest.raises(errors.ConfigError, match="nn.Sequential"):
        stage_layers(torch.nn.Linear(2, 2), 2)
    with pytest.raises(Exception, match="does not divide"):
        TrainingJob(mode="pipeline", trainers=1, batch_size=30, microbatches=4)
    assert stage_layers(build_model(TrainingJob(**DEEP)), 3) == [(0, 2), (2, 4), (4, 6)]


async def test_bad_pipeline_specs_fail_at_submit(cluster, client):
    await cluster(1, grains=GRAINS)
    with pytest.raises(errors.ConfigError, match="only 4 layers"):
        await client.get_grain(CoordinatorGrain, "pipe-bad").start(TrainingJob(mode="pipeline", trainers=1, stages=5))


@pytest.mark.slow
async def test_sigkill_of_a_stage_silo_rolls_the_pipeline_back_and_it_finishes_as_undisturbed(silo_processes, client):
    from grains.training.strategies.cluster import key_on
    from tests.grains.training.conftest import training_silos
    from tests.grains.training.test_faults import process_of, status_when

    procs = silo_processes(3, grains="grains.training")
    rows = await training_silos(client, 3)
    job = key_on("CoordinatorGrain", "pipe-kill", rows[2].silo, rows)  # the coordinator away from both stages
    spec = TrainingJob(**DEEP, mode="pipeline", trainers=1, stages=2, microbatches=4, batch_size=32, steps=400,
                       optimizer="momentum", lr=0.05, clip_grad_norm=1.0, checkpoint_every=50)  # fmt: skip
    coord = client.get_grain(CoordinatorGrain, job)
    await coord.start(spec)
    st = await status_when(coord, lambda s: s.status == "running" and s.checkpoints and s.step >= 100)
    assert st.step < 350, "the job ran too fast to be killed mid-run"
    victim = st.trainer_silos[1]
    assert victim not in (st.trainer_silos[0], st.coordinator_silo), st
    process_of(procs, victim).kill()
    final = await status_when(coord, lambda s: s.status == "completed", timeout_s=120)
    assert final.rollbacks >= 1 and final.step == 400, final
    assert victim not in final.trainer_silos, final
    change = final.changes[-1]  # the rollback, and when the pipeline committed its next step
    assert change.first_step_at is not None and change.first_step_at > change.at, change
    print(f"pipeline back {change.first_step_at - change.at:.2f} s after the decision")
    # Restored from a checkpoint of every stage at one step, the run replays exactly.
    got = await coord.state_dict()
    for k, v in plain_loop(spec, 400).items():
        assert torch.allclose(got[k], v, rtol=1e-3, atol=1e-4), k


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_hybrid_two_trainers_of_two_stages_equal_data_parallel_training(cluster, client, schedule):
    # trainers = 2: two copies of the 2-stage pipeline, each on half of the global batch; each
    # stage's gradients (and buffers) averaged over the trainers: plain training on the global batch.
    await cluster(4, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(**DEEP, mode="pipeline", trainers=2, stages=2, microbatches=4, schedule=schedule,
                       batch_size=32, steps=20, optimizer="momentum", lr=0.05, clip_grad_norm=1.0,
                       checkpoint_every=10, seed=6)  # fmt: skip
    st = await run_job(client, f"hybrid-{schedule}", spec, timeout_s=120)
    assert st.status == "completed" and st.trainers == 2 and len(st.trainer_keys) == 4, st
    assert len(set(st.trainer_silos)) == 4, st  # every stage of every trainer on its own silo
    got = await client.get_grain(CoordinatorGrain, f"hybrid-{schedule}").state_dict()
    model = build_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in global_batches(spec, 2, 20):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-5), (k, (got[k] - v).abs().max())


async def test_activations_compressed_to_fp16_and_bf16_autocast_train_as_well(cluster, client):
    await cluster(2, grains=GRAINS)
    common = {"optimizer": "momentum", "lr": 0.05, "batch_size": 64, "steps": 150, "checkpoint_every": 0, **DEEP,
              "mode": "pipeline", "trainers": 1, "stages": 2}  # fmt: skip
    full = await run_job(client, "pipe-fp32", TrainingJob(**common))
    half = await run_job(client, "pipe-fp16", TrainingJob(**common, compression="fp16"))
    bf16 = await run_job(client, "pipe-bf16", TrainingJob(**common, precision="bf16"))
    assert full.status == half.status == bf16.status == "completed", (full, half, bf16)
    assert full.accuracy is not None and full.accuracy >= 0.9, full
    for st in (half, bf16):
        assert st.accuracy is not None and abs(st.accuracy - full.accuracy) <= 0.02, (st.job, st.accuracy, full.accuracy)
    with pytest.raises(Exception, match="activations"):
        TrainingJob(**{**common, "compression": "topk:0.01"})


def test_a_cut_by_measured_time_follows_the_costs_not_the_bytes():
    from grains.training.strategies.pipeline.partition import measured_costs

    model = build_model(TrainingJob(**DEEP))  # Flatten, Linear(64, 64), ReLU, Linear(64, 64), ReLU, Linear(64, 10)
    costs = measured_costs(model, torch.randn(16, 64))
    assert len(costs) == 6 and all(c > 0 for c in costs)
    # By bytes the cut falls after the second Linear; costs that sit elsewhere move it.
    assert stage_layers(model, 2) == [(0, 4), (4, 6)]
    assert stage_layers(model, 2, [1.0, 1.0, 1.0, 1.0, 1.0, 20.0]) == [(0, 5), (5, 6)]
    assert stage_layers(model, 3, [5.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == [(0, 1), (1, 3), (3, 6)]


async def test_a_job_cut_by_measured_time_trains(cluster, client):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(**DEEP, mode="pipeline", trainers=1, stages=2, balance="time", steps=30, batch_size=32)
    st = await run_job(client, "pipe-time", spec)
    assert st.status == "completed" and len(st.trainer_keys) == 2, st
    assert set(await client.get_grain(CoordinatorGrain, "pipe-time").state_dict()) == set(build_model(spec).state_dict())


@pytest.mark.slow
async def test_a_lost_trainer_shrinks_the_hybrid_job_without_a_rollback(silo_processes, client):
    from grains.training.strategies.cluster import key_on
    from tests.grains.training.conftest import training_silos
    from tests.grains.training.test_faults import process_of, status_when

    procs = silo_processes(4, grains="grains.training")
    rows = await training_silos(client, 4)
    job = key_on("CoordinatorGrain", "hybrid-kill", rows[0].silo, rows)  # with rank 0's first stage
    spec = TrainingJob(**DEEP, mode="pipeline", trainers=2, stages=2, microbatches=2, batch_size=32, steps=400,
                       optimizer="momentum", lr=0.05, checkpoint_every=50)  # fmt: skip
    coord = client.get_grain(CoordinatorGrain, job)
    await coord.start(spec)
    st = await status_when(coord, lambda s: s.status == "running" and s.step >= 100)
    assert st.step < 350 and len(st.trainer_silos) == 4, st
    victim = st.trainer_silos[3]  # rank 1's last stage
    assert victim not in (*st.trainer_silos[:3], st.coordinator_silo), st
    process_of(procs, victim).kill()
    final = await status_when(coord, lambda s: s.status == "completed", timeout_s=120)
    assert final.step == 400 and final.rollbacks == 0 and final.trainers == 1, final
    assert any("shrank to 1 trainer" in c.reason for c in final.changes), final.changes
    assert final.accuracy is not None and final.accuracy >= 0.9, final


async def test_each_stage_holds_its_share_of_the_parameters_only(cluster, client):
    await cluster(2, grains=GRAINS)
    # Four equal Linear(64, 64) layers (10 of the 64 outputs are the digits' classes): 2 stages of 2.
    spec = TrainingJob(model_args={"hidden": [64, 64, 64], "classes": 64}, mode="pipeline", trainers=1, stages=2,
                       steps=10, batch_size=32)  # fmt: skip
    st = await run_job(client, "pipe-mem", spec)
    assert st.status == "completed", st
    total = sum(p.numel() * p.element_size() for p in build_model(spec).parameters())
    shares = [g.param_bytes / total for g in st.stages]
    print("stage parameter shares:", [f"{x:.1%}" for x in shares])
    assert sum(g.param_bytes for g in st.stages) == total
    assert all(abs(x - 1 / 2) <= 0.2 / 2 for x in shares), shares  # each within 20% of 1/p


async def test_a_first_stage_without_parameters_trains(cluster, client):
    # A cut by measured time can leave a stage no parameter (here: the Flatten alone, as a slow
    # first call once made it on CI): its output needs no gradient, and its backward is nothing.
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(**DEEP, mode="pipeline", trainers=1, split_points=["1"], microbatches=2, batch_size=32,
                       steps=12, optimizer="momentum", lr=0.05, clip_grad_norm=1.0, checkpoint_every=6)  # fmt: skip
    st = await run_job(client, "pipe-bare", spec)
    assert st.status == "completed" and st.checkpoints[-1] == 12, st
    got = await client.get_grain(CoordinatorGrain, "pipe-bare").state_dict()
    for k, v in plain_loop(spec, 12).items():
        assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-5), (k, (got[k] - v).abs().max())
