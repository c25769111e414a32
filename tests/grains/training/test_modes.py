"""async and ssp converge; ssp holds its staleness bound; bad specs fail before anything starts."""

from __future__ import annotations

import time
from typing import Any

import pytest

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.steps import classification_step
from silo import errors
from tests.grains.training.conftest import GRAINS, run_job

SYNTHETIC = {
    "model_args": {"in_features": 32, "hidden": [64]},
    "dataset": "grains.training.datasets:synthetic",
    "dataset_args": {"samples": 2048, "test_samples": 512, "features": 32, "spread": 2.0},
}


@pytest.mark.parametrize("mode", ["async", "ssp"])
async def test_async_and_ssp_converge_on_the_synthetic_set(cluster, client, mode):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(**SYNTHETIC, mode=mode, staleness=1, trainers=3, shards=2, steps=150, batch_size=32,
                       optimizer="momentum", lr=0.05, checkpoint_every=40)  # fmt: skip
    st = await run_job(client, f"conv-{mode}", spec)
    assert st.status == "completed", st
    assert st.accuracy is not None and st.accuracy >= 0.9, st
    assert st.checkpoints[-2:] == [120, 150]  # every 40 steps, and always the last step
    if mode == "ssp":
        # Recorded at every release of a trainer, by every shard and trainer.
        assert 0 < st.max_gap <= 1, st


def rank0_slow_step(model: Any, batch: Any, ctx: Any) -> Any:
    """Trainer 0 takes 20 ms longer a step (a slower device): the others run ahead of it."""
    if ctx.rank == 0:
        time.sleep(0.02)
    return classification_step(model, batch)


async def test_ssp_gap_never_exceeds_its_bound_with_a_slow_trainer(cluster, client):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(**SYNTHETIC, mode="ssp", staleness=2, trainers=4, shards=1, steps=60, batch_size=16,
                       checkpoint_every=0, step=f"{__name__}:rank0_slow_step")  # fmt: skip
    st = await run_job(client, "ssp-bound", spec)
    assert st.status == "completed", st
    # The fast trainers ran ahead until the bound held them: the gap reached it, never more.
    assert st.max_gap == 2, st


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "no.such.module:mlp"}, "cannot import module 'no.such.module'"),
        ({"model": "grains.training.models:nope"}, "has no attribute 'nope'"),
        ({"trainers": 0}, "at least one trainer"),
        ({"compression": "topk:2"}, "bad compression 'topk:2'"),
        ({"compression": "zip"}, "bad compression 'zip'"),
        ({"steps": 10, "epochs": 1}, "steps or epochs, not both"),
    ],
)
async def test_bad_job_spec_is_rejected_with_a_clear_message(cluster, client, change, message):
    await cluster(1, grains=GRAINS)
    coord = client.get_grain(CoordinatorGrain, "bad")
    with pytest.raises(errors.ConfigError, match=message):
        await coord.start({**TrainingJob().model_dump(), **change})
    st = await coord.status()
    assert st.status == "idle" and st.step == 0


async def test_a_custom_model_and_a_plain_dataset_train_by_import_path(cluster, client):
    from samples.custom_model import JOB

    await cluster(2, grains=GRAINS)
    spec = TrainingJob.model_validate({**JOB, "epochs": None, "steps": 300, "dataset_args": {"samples": 2000}})
    st = await run_job(client, "spirals", spec)
    assert st.status == "completed", st
    assert st.accuracy is not None and st.accuracy >= 0.85, st


async def test_a_second_job_on_the_same_coordinator_is_evaluated_with_its_own_model(cluster, client):
    await cluster(1, grains=GRAINS)
    small = TrainingJob(**SYNTHETIC, trainers=1, shards=1, steps=40, batch_size=32, lr=0.1, checkpoint_every=0)
    first = await run_job(client, "two-models", small)
    assert first.status == "completed" and first.accuracy is not None, first
    # Same coordinator activation, another network: the evaluation must build this job's model
    # (the first job's model would not even take these weights).
    wider = small.model_copy(update={"model_args": {"in_features": 32, "hidden": [96]}})
    second = await run_job(client, "two-models", wider)
    assert second.status == "completed", second
    assert second.accuracy is not None and second.accuracy >= 0.8, second
