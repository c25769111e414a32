"""Your own model and dataset, named by import path: two interleaved spirals.

Any ``torch.nn.Module`` factory and any ``torch.utils.data.Dataset`` factory
work; the silos import them by path, so this module must be importable there
(it is, for silos started from the repository root)::

    python samples/custom_model.py            # local cluster: Redis + 2 silos, sync mode

The job names ``samples.custom_model:spiral_net`` and ``samples.custom_model:spirals``;
the dataset is a plain ``Dataset`` (not tensors), so trainers gather it item by item.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys

import torch
from torch import nn
from torch.utils.data import Dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class Spirals(Dataset[tuple[torch.Tensor, int]]):
    """Two spirals in the plane, one per class, with a little noise; items made on demand."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.t = torch.rand(n, generator=g) * 3 * math.pi + 0.5
        self.label = torch.randint(0, 2, (n,), generator=g)
        self.noise = torch.randn(n, 2, generator=g) * 0.15

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        t, c = self.t[i], int(self.label[i])
        sign = 1.0 if c == 0 else -1.0
        point = torch.stack([sign * t * torch.cos(t), sign * t * torch.sin(t)]) / 5.0 + self.noise[i]
        return point, c


def spirals(split: str = "train", samples: int = 4000) -> Dataset[tuple[torch.Tensor, int]]:
    return Spirals(samples if split == "train" else samples // 4, seed=0 if split == "train" else 1)


def spiral_net(width: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))


JOB = {
    "model": "samples.custom_model:spiral_net",
    "model_args": {"width": 64},
    "dataset": "samples.custom_model:spirals",
    "mode": "sync",
    "trainers": 2,
    "shards": 2,
    "optimizer": "adam",
    "lr": 0.03,
    "batch_size": 64,
    "epochs": 15,
}


async def train(redis_url: str, cluster: str) -> float:
    from grains.training import CoordinatorGrain, TrainingJob
    from grains.training.console import watch
    from silo import ClusterClient

    async with await ClusterClient.connect(redis_url, cluster=cluster) as client:
        coord = client.get_grain(CoordinatorGrain, "spirals")
        await coord.start(TrainingJob.model_validate(JOB))
        st = await watch(coord, timeout_s=300)
        return float(st.accuracy or 0.0)


def main() -> int:
    from silo.testing.local import LocalCluster

    os.chdir(ROOT)
    with LocalCluster("grains.training", silos=2, cluster="spirals-sample") as lc:
        acc = asyncio.run(train(lc.redis_url, lc.cluster))
    print(f"spirals: test accuracy {acc:.2%}")
    return 0 if acc >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
