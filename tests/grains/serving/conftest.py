"""Helpers for serving tests: a digits model trained in a few seconds, silos that serve it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from grains.serving.records import ReplicaRecord, read_models
from grains.training import TrainingJob
from grains.training.datasets import load_dataset
from tests.grains.training.conftest import run_job

GRAINS = ("grains.training", "grains.serving")
# Adam on one trainer reaches ~97% test accuracy on digits in 150 steps (about 2 s here).
DIGITS = TrainingJob(trainers=1, shards=1, optimizer="adam", lr=0.01, batch_size=64, steps=150, checkpoint_every=50)


async def train_digits(client: Any, job: str = "digits", **changes: Any) -> Any:
    st = await run_job(client, job, DIGITS.model_copy(update=changes), timeout_s=60)
    assert st.status == "completed", st
    return st


async def replicas(client: Any) -> list[ReplicaRecord]:
    """The served models' live replicas that are ready and have answered requests."""
    models = await read_models(client.redis, client.keys.rendezvous("serving", 0))
    return [r for m in models for r in m.replicas if r.ready and r.requests]


@pytest.fixture(scope="session")
def digits_test() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_dataset(DIGITS, "test").tensors  # type: ignore[attr-defined]
    return x, y
