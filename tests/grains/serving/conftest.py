"""Helpers for serving tests: a digits model trained in a few seconds, silos that serve it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
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


async def classes_from_threads(predict_row: Callable[[int], int], rows: int, threads: int = 8) -> np.ndarray:
    """Each of ``rows`` rows' predicted class, asked one row a request from ``threads`` threads
    (a client each: tritonclient's clients are synchronous)."""

    def score(part: range) -> list[int]:
        return [predict_row(i) for i in part]

    parts = await asyncio.gather(*(asyncio.to_thread(score, range(k, rows, threads)) for k in range(threads)))
    got = np.zeros(rows, dtype=np.int64)
    for k, part in enumerate(parts):
        got[k::threads] = part
    return got


@pytest.fixture(scope="session")
def digits_test() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_dataset(DIGITS, "test").tensors  # type: ignore[attr-defined]
    return x, y
