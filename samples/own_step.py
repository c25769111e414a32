"""Bring your own training step: your loss, metrics, optimizer, schedule — and the model back.

A small CNN with BatchNorm and Dropout on the 8x8 digits, trained the way you
would write it yourself: a label-smoothed cross-entropy step that reports its
own metric, an evaluation that reports per-split figures, AdamW with no
weight decay on biases and norms, a warm-up then a cosine schedule, gradient
clipping. After the job, the trained ``state_dict`` is loaded strictly into a
fresh model and scored here, in ``eval()`` mode::

    python samples/own_step.py          # local cluster: Redis + 2 silos, sync mode, 2 trainers, 2 shards

The silos import ``samples.own_step:smoothed_step`` and ``:digit_metrics`` by
path, as they import the model and dataset.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def smoothed_step(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """The training step: label-smoothed cross-entropy, and the batch's accuracy as a metric."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits, y, label_smoothing=0.05)
    return loss, {"accuracy": float((logits.argmax(1) == y).float().mean())}


def digit_metrics(model: nn.Module, batch: Any) -> dict[str, float]:
    """Evaluation (redgrain runs it in eval() under no_grad and averages over the test split)."""
    x, y = batch
    logits = model(x)
    top2 = logits.topk(2, dim=1).indices
    return {
        "loss": float(F.cross_entropy(logits, y)),
        "accuracy": float((logits.argmax(1) == y).float().mean()),
        "top2_accuracy": float((top2 == y[:, None]).any(1).float().mean()),
    }


JOB: dict[str, Any] = {
    "model": "grains.training.models:cnn_bn",
    "step": "samples.own_step:smoothed_step",
    "evaluate": "samples.own_step:digit_metrics",
    "optimizer": "adamw",
    "lr": 3e-3,
    "weight_decay": 0.05,
    "param_groups": [{"match": ["*.bias", "2.weight", "5.weight"], "weight_decay": 0.0}],
    "lr_schedule": "torch.optim.lr_scheduler:CosineAnnealingLR",
    "lr_schedule_args": {"T_max": 300, "eta_min": 1e-4},
    "warmup_steps": 20,
    "clip_grad_norm": 1.0,
    "mode": "sync",
    "trainers": 2,
    "shards": 2,
    "batch_size": 32,
    "steps": 320,
    "eval_every": 80,
}


async def train(redis_url: str, cluster: str, save: str) -> tuple[Any, float]:
    from grains.training import CoordinatorGrain, TrainingJob
    from grains.training.console import save_model, watch
    from silo import ClusterClient

    async with await ClusterClient.connect(redis_url, cluster=cluster) as client:
        coord = client.get_grain(CoordinatorGrain, "own-step")
        await coord.start(TrainingJob.model_validate(JOB))
        st = await watch(coord, timeout_s=300)
        if st.status != "completed":
            return st, 0.0
        await save_model(coord, save)  # what `redgrain train job.toml --save model.pt` does
    return st, local_accuracy(save)


def local_accuracy(path: str) -> float:
    """Load the saved state_dict strictly into a fresh model and score the test split here."""
    from grains.training import TrainingJob
    from grains.training.datasets import load_dataset
    from grains.training.models import build_model

    spec = TrainingJob.model_validate(JOB)
    model = build_model(spec)
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)
    model.eval()
    x, y = load_dataset(spec, "test").tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main() -> int:
    from silo.testing.local import LocalCluster

    os.chdir(ROOT)
    save = os.path.join(ROOT, ".redgrain", "own-step.pt")
    os.makedirs(os.path.dirname(save), exist_ok=True)
    with LocalCluster("grains.training", silos=2, cluster="own-step-sample") as lc:
        st, local = asyncio.run(train(lc.redis_url, lc.cluster, save))
    figures = " ".join(f"{k} {v:.4f}" for k, v in sorted(st.eval_metrics.items()))
    print(f"own-step: {st.status}; reported {figures}; saved model scores {local:.2%} here")
    return 0 if st.status == "completed" and local >= 0.95 and abs(local - (st.accuracy or 0.0)) < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
