"""A stale async/ssp push of an Adam-family optimizer is carried to the current weights (DC-ASGD-a):
g + lambda * g*g / sqrt(v_hat) * (w_now - w_pulled)."""

from __future__ import annotations

import pytest
import torch

from grains.training import TrainingJob
from grains.training.api.messages import ShardConfig
from grains.training.models import build_model
from grains.training.strategies.ps.shard_core import ShardCore, compensated


def core(optimizer: str = "adamw", mode: str = "async", strength: float = 2.0) -> ShardCore:
    spec = TrainingJob(optimizer=optimizer, lr=0.01, trainers=2, shards=1, steps=4, mode=mode, delay_compensation=strength)
    names = [n for n, _ in build_model(spec).named_parameters()]
    cfg = ShardConfig(job="j", index=0, spec=spec, names=names, shard_keys=["j/shard-0"], trainers=2,
                      generation=0, run=0, restore_step=None)  # fmt: skip
    return ShardCore(cfg, "cpu", None)


def test_a_stale_gradient_moves_by_lambda_g_squared_over_its_scale_times_the_step_since_its_pull():
    c = core()
    assert c.opt is not None
    pulled = {n: p.detach().clone() for n, p in c.params.items()}
    c.apply_push({n: torch.full_like(p, 0.5) for n, p in c.params.items()}, None, False, 1)  # v = 0.5^2 after bias correction
    stale = {n: torch.full_like(p, 0.3) for n, p in c.params.items()}
    out = compensated(c.opt, c.params, stale, pulled, 2.0)
    for n, p in c.params.items():
        step = p.detach() - pulled[n]
        assert step.abs().max() > 0, n
        # hessian ~ g*g / sqrt(v_hat) = 0.09 / 0.5; times lambda 2 and the step since the pull
        torch.testing.assert_close(out[n], 0.3 + 2.0 * (0.09 / 0.5) * step, rtol=1e-4, atol=1e-7)
        assert torch.equal(stale[n], torch.full_like(p, 0.3))  # the pushed tensors are not written


def test_apply_push_compensates_only_when_given_the_pulled_weights():
    a, b, off = core(), core(), core(strength=0.0)
    for c in (a, b, off):
        c.apply_push({n: torch.full_like(p, 0.5) for n, p in c.params.items()}, None, False, 1)
    pulled = {n: torch.zeros_like(p) for n, p in a.params.items()}  # far from the current weights
    g = {n: torch.full_like(p, 0.3) for n, p in a.params.items()}
    a.apply_push(dict(g), None, False, 2, 1.0, pulled)
    b.apply_push(dict(g), None, False, 2, 1.0, None)
    off.apply_push(dict(g), None, False, 2, 1.0, pulled)
    assert any(not torch.equal(a.params[n], b.params[n]) for n in a.params)
    assert all(torch.equal(off.params[n], b.params[n]) for n in b.params)


@pytest.mark.parametrize(("optimizer", "mode"), [("sgd", "async"), ("momentum", "ssp"), ("adamw", "sync"), ("torch.optim:Adagrad", "async")])
def test_no_compensation_without_adams_second_moment_or_in_sync_mode(optimizer, mode):
    assert core(optimizer, mode).compensation == 0.0


def test_adam_family_pushes_are_compensated_by_default_in_async_and_ssp():
    assert core("adam", "async", TrainingJob.model_fields["delay_compensation"].default).compensation == 2.0
    assert core("adamw", "ssp").compensation == 2.0
