"""An async/ssp push runs at lr/trainers and leaves every param group's lr as the job set it."""

from __future__ import annotations

import pytest
import torch

from grains.training import TrainingJob
from grains.training.api.messages import ShardConfig
from grains.training.models import build_model
from grains.training.strategies.ps.shard import async_lr_scale
from grains.training.strategies.ps.shard_core import ShardCore, scaled_lr


def core(optimizer: str, trainers: int) -> ShardCore:
    spec = TrainingJob(optimizer=optimizer, lr=0.1, trainers=trainers, shards=1, steps=1, mode="async")
    names = [n for n, _ in build_model(spec).named_parameters()]
    cfg = ShardConfig(job="j", index=0, spec=spec, names=names, shard_keys=["j/shard-0"], trainers=trainers,
                      generation=0, run=0, restore_step=None)  # fmt: skip
    return ShardCore(cfg, "cpu", None)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_a_push_at_lr_over_trainers_moves_the_weights_as_that_lr_would(optimizer):
    scaled, plain = core(optimizer, 2), core(optimizer, 2)
    assert scaled.opt is not None and plain.opt is not None
    for group in plain.opt.param_groups:
        group["lr"] = 0.1 * async_lr_scale(2)
    grads = {n: torch.full_like(p, 0.5) for n, p in scaled.params.items()}
    scaled.apply_push(dict(grads), None, False, 1, async_lr_scale(2))
    plain.apply_push(dict(grads), None, False, 1)
    for n in scaled.params:
        assert torch.equal(scaled.params[n], plain.params[n]), n
    assert [g["lr"] for g in scaled.opt.param_groups] == [0.1]  # restored for the schedule and checkpoints


def test_the_lr_is_restored_when_the_step_fails():
    c = core("momentum", 2)
    assert c.opt is not None
    with pytest.raises(RuntimeError), scaled_lr(c.opt, 0.5):
        assert c.opt.param_groups[0]["lr"] == 0.05
        raise RuntimeError("step failed")
    assert c.opt.param_groups[0]["lr"] == 0.1


def test_one_trainer_keeps_the_job_rate():
    assert async_lr_scale(1) == 1.0 and async_lr_scale(4) == 0.25
