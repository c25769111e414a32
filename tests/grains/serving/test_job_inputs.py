"""Serving a job trained on token lists: the inputs are read as the job's collate_fn makes them,
and a deployment whose model cannot load says so at start, not at every request."""

from __future__ import annotations

import pytest
import torch

from grains.serving import ModelGrain, Predictor, ServeSpec, deploy
from grains.serving.command import _servable
from grains.serving.errors import ModelUnservableError
from grains.serving.loader import job_inputs
from grains.training import CoordinatorGrain, TrainingJob
from silo import errors
from tests.grains.serving.conftest import GRAINS
from tests.grains.training import hf_task
from tests.grains.training.conftest import run_job

TASK = "tests.grains.training.hf_task"
HF = {"model": f"{TASK}:model", "dataset": f"{TASK}:sequences", "step": f"{TASK}:step", "evaluate": f"{TASK}:evaluate"}


def test_token_lists_are_described_as_the_collate_fn_pads_them_with_their_length_free() -> None:
    got = job_inputs(TrainingJob(**HF, collate_fn=f"{TASK}:pad"))
    assert [(s.name, s.datatype, s.shape) for s in got] == [
        ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1]),
    ]  # labels are not an input; the sequence length differs between items


def test_token_lists_without_a_collate_fn_are_a_config_error_naming_input() -> None:
    with pytest.raises(errors.ConfigError, match="--input NAME:DATATYPE:SHAPE") as e:
        job_inputs(TrainingJob(**HF))
    assert "list" in str(e.value)  # what the features were


async def test_a_job_trained_on_token_lists_is_served_without_input_flags(cluster, client) -> None:
    await cluster(1, grains=GRAINS)
    spec = TrainingJob(**HF, collate_fn=f"{TASK}:pad", optimizer="adamw", lr=3e-3, batch_size=16, trainers=1,
                       steps=4, mode="sync", eval_batch_size=64, checkpoint_every=0, seed=1)  # fmt: skip
    assert (await run_job(client, "hf", spec, timeout_s=120)).status == "completed"
    await deploy(client, "hf", ServeSpec(job="hf"))
    await _servable(client, ModelGrain, "hf")  # what `redgrain serve --job hf` checks at start
    info = await client.get_grain(ModelGrain, "hf").metadata()
    assert [(s.name, s.shape) for s in info.inputs] == [("input_ids", [-1, -1]), ("attention_mask", [-1, -1])]
    test = hf_task.sequences("test")
    batch = hf_task.pad([test[i] for i in range(5)])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    served = await Predictor(client, "hf").predict(inputs)
    model = hf_task.model()
    model.load_state_dict(await client.get_grain(CoordinatorGrain, "hf").state_dict(), strict=True)
    with torch.no_grad():
        local = model.eval()(**inputs).logits
    assert isinstance(served, dict) and torch.allclose(served["logits"], local, atol=1e-5)


async def test_a_deployment_that_cannot_load_stops_serve_at_start_and_is_503_meanwhile(cluster, client, tmp_path) -> None:
    await cluster(1, grains=GRAINS)
    weights = tmp_path / "w.pt"
    torch.save({}, weights)
    await deploy(client, "broken", ServeSpec(model="tests.grains.serving.models:refuses_to_build",
                                             weights=str(weights), inputs=[{"name": "input", "shape": [-1, 4]}]))  # fmt: skip
    with pytest.raises(errors.ConfigError, match="cannot be served as deployed.*needs an argument"):
        await _servable(client, ModelGrain, "broken")
    with pytest.raises(ModelUnservableError) as e:
        await Predictor(client, "broken").predict(torch.zeros(1, 4))
    assert e.value.status == 503
