"""The learning-rate schedule in the user's terms, over the job's current length.

Hugging Face's schedules are factories (``get_linear_schedule_with_warmup(optimizer,
num_warmup_steps, num_training_steps)`` returns a LambdaLR); they were refused as
"not a torch.optim.lr_scheduler class". And a schedule's length was a number in
``lr_schedule_args``: an elastic or ``epochs`` job that recomputed its total steps
when trainers changed kept the old one (the rate hit 0 at step 96 of a longer
job, so the whole 2-trainer phase was a no-op).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import get_linear_schedule_with_warmup

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.datasets import load_dataset
from grains.training.models import build_model
from grains.training.state.store import CheckpointStoreGrain
from tests.grains.training import data_ids
from tests.grains.training.conftest import (
    GRAINS,
    grown_at_a_gate,
    run_job,
    status_when,
    training_silos,
    wait_done,
)

IDS = 512


async def rate_at(client, job: str, run: int, step: int, spec: TrainingJob | None = None) -> float:
    """The rate checkpoint ``step`` holds (its optimizer's groups, by name)."""
    names = [n for n, p in build_model(spec or TrainingJob()).named_parameters() if p.requires_grad]
    snap = await client.get_grain(CheckpointStoreGrain, job).read(run, step, names, [])
    return float(snap.optimizer["param_groups"][0]["lr"])


async def test_hugging_faces_warmup_factory_runs_unmodified_and_equals_a_plain_loop(cluster, client):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(mode="sync", trainers=2, shards=2, steps=12, batch_size=16, optimizer="momentum", lr=0.1,
                       warmup_steps=3, lr_schedule="transformers:get_linear_schedule_with_warmup", checkpoint_every=4)  # fmt: skip
    st = await run_job(client, "hf-schedule", spec)
    assert st.status == "completed", st
    # The plain loop: HF's factory with the job's warmup and length, stepped after each step.
    model = build_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=spec.momentum)
    schedule = get_linear_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=12)
    x, y = load_dataset(spec, "train").tensors  # type: ignore[attr-defined]
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(spec.seed))
    rates = []
    for t in range(12):
        idx = perm[t * 32 : (t + 1) * 32]
        rates.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        schedule.step()
    assert rates[0] == 0.0  # HF's warmup starts at 0
    got = await client.get_grain(CoordinatorGrain, "hf-schedule").parameters()
    for name, w in model.named_parameters():
        assert torch.allclose(got[name], w.detach(), rtol=1e-3, atol=1e-4), name
    assert await rate_at(client, "hf-schedule", st.run, 12) == 0.0


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
async def test_an_elastic_epochs_job_decays_its_rate_to_zero_at_its_recomputed_last_step(cluster, client, mode):
    # The trainers are held at a step gate until the job has grown (grown_at_a_gate): CI once
    # grew it at step 430 of 440, leaving no checkpoint of the 2-trainer phase to check.
    data_ids.reset(limit=20)
    try:
        await cluster(1, grains=GRAINS)
        spec = TrainingJob(mode=mode, trainers="auto", shards=1, epochs=5, batch_size=16, optimizer="momentum", lr=0.05,
                           lr_schedule="torch.optim.lr_scheduler:LinearLR",
                           lr_schedule_args={"start_factor": 1.0, "end_factor": 0.0, "total_iters": "total_steps"},
                           checkpoint_every=10, keep_checkpoints=100, model_args={"in_features": 8, "hidden": [16], "classes": 2},
                           dataset="tests.grains.training.data_ids:ids", dataset_args={"size": IDS},
                           step="tests.grains.training.data_ids:step")  # fmt: skip
        job = f"lr-follows-{mode}"
        coord = client.get_grain(CoordinatorGrain, job)
        await coord.start(spec)
        first = await status_when(coord, lambda s: s.status == "running" and 20 in s.checkpoints)
        alone = first.total_steps
        assert alone == 5 * IDS // 16, first
        await cluster(1, grains=GRAINS)
        await training_silos(client, 2)
        # A checkpoint a round: the job grows at one once the joiner warmed up.
        grown = await grown_at_a_gate(coord, lambda s: s.trainers == 2, 30, alone // 2, 10)
        data_ids.control(limit=None)
        st = await wait_done(coord, timeout_s=120)
    finally:
        data_ids.control(limit=None)
    assert st.status == "completed", st
    assert st.total_steps < alone, (alone, st.total_steps)  # two trainers: fewer steps to five epochs
    # The rate reaches 0 exactly at the job's last step and not before (a schedule over the
    # 1-trainer length would still be above 0 at the end).
    assert await rate_at(client, job, st.run, st.total_steps, spec) == 0.0
    before = [c for c in st.checkpoints if grown.changes[-1].start_step < c < st.total_steps]
    assert len(before) >= 2, st.checkpoints
    for c in before:
        want = spec.lr * (1 - c / st.total_steps)
        assert abs(await rate_at(client, job, st.run, c, spec) - want) < 1e-6, c
