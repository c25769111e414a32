"""An async/ssp push runs at its batch-size rule's rate (SGD lr/trainers in async, Adam lr/sqrt(trainers)
in async and ssp) and leaves every param group's lr as the job set it."""

from __future__ import annotations

import math

import pytest
import torch

from grains.training import TrainingJob
from grains.training.api.messages import ShardConfig
from grains.training.models import build_model
from grains.training.strategies.ps.shard import push_lr_scale
from grains.training.strategies.ps.shard_core import ShardCore, scaled_lr


def core(optimizer: str, trainers: int) -> ShardCore:
    spec = TrainingJob(optimizer=optimizer, lr=0.1, trainers=trainers, shards=1, steps=1, mode="async")
    names = [n for n, _ in build_model(spec).named_parameters()]
    cfg = ShardConfig(job="j", index=0, spec=spec, names=names, shard_keys=["j/shard-0"], trainers=trainers,
                      generation=0, run=0, restore_step=None)  # fmt: skip
    return ShardCore(cfg, "cpu", None)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_a_push_at_a_scaled_lr_moves_the_weights_as_that_lr_would(optimizer):
    scaled, plain = core(optimizer, 2), core(optimizer, 2)
    assert scaled.opt is not None and plain.opt is not None
    factor = push_lr_scale("async", 2, scaled.opt)
    for group in plain.opt.param_groups:
        group["lr"] = 0.1 * factor
    grads = {n: torch.full_like(p, 0.5) for n, p in scaled.params.items()}
    scaled.apply_push(dict(grads), None, False, 1, factor)
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


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_one_trainer_keeps_the_job_rate(mode):
    for optimizer in ("sgd", "momentum", "adam", "adamw"):
        assert push_lr_scale(mode, 1, core(optimizer, 1).opt) == 1.0, optimizer


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_sgd_pushes_take_the_linear_rule_in_async_and_the_job_rate_in_ssp(optimizer):
    opt = core(optimizer, 4).opt
    assert push_lr_scale("async", 4, opt) == 0.25 and push_lr_scale("ssp", 4, opt) == 1.0


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_pushes_take_the_square_root_rule_in_async_and_ssp(optimizer):
    # lr/trainers left AdamW async 6 F1 points behind sync on the HF-style fine-tune; lr/sqrt(trainers)
    # 1.7 (docs/training.md, "Modes").
    opt = core(optimizer, 4).opt
    assert push_lr_scale("async", 4, opt) == 0.5 and push_lr_scale("ssp", 4, opt) == 0.5
    assert push_lr_scale("async", 2, opt) == 1 / math.sqrt(2)


def test_a_subclass_of_adam_is_adaptive():
    class MyAdam(torch.optim.AdamW):
        pass

    assert push_lr_scale("async", 4, MyAdam([torch.nn.Parameter(torch.zeros(1))])) == 0.5
