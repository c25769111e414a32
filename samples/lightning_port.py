"""A Lightning module ported to redgrain unchanged, through a small adapter, beside Lightning's loop.

``LitClassifier`` is written as a ``LightningModule`` is: ``training_step``
and ``validation_step`` that ``self.log``, a torchmetrics F1 held by the
module, and ``configure_optimizers`` returning AdamW over no-decay groups
and a per-step schedule sized by ``self.trainer.estimated_stepping_batches``.
Lightning is not needed (nor installed here): ``LightningLike`` stands in
for ``L.LightningModule`` with the two things the module uses of it,
``self.log`` and ``self.trainer``; swap the base class and it runs under
Lightning's ``Trainer``.

The adapter (``lightning_job``) maps the module onto redgrain's hooks:

- the module class is the model factory (its ``hparams`` the ``model_args``);
- ``training_step(batch, batch_idx)`` is the step (``step`` below), its
  ``self.log`` calls going to ``ctx.log``;
- ``validation_step`` is ``evaluate``: what it logs is the evaluation's
  result, a logged torchmetrics object computed over the whole split, as
  Lightning computes it at the epoch's end;
- ``configure_optimizers`` is read once when the job is made: the optimizer's
  class, its arguments and its groups (by parameter name) become the spec's
  ``optimizer``, ``lr``, ``optimizer_args`` and ``param_groups``, so each
  holder builds the same optimizer over its own parameters; the scheduler
  (``interval="step"``) becomes ``lr_schedule``: the module's own schedule,
  replayed on every holder by its rate factor at each step (``replayed_schedule``);
- ``Trainer(max_steps, accumulate_grad_batches, gradient_clip_val,
  val_check_interval, callbacks=[EarlyStopping(...)])`` become ``steps``,
  ``grad_accumulation``, ``clip_grad_norm``, ``eval_every`` and ``callbacks``;
  ``strategy="ddp"`` on 2 devices is ``mode="allreduce"`` with 2 ``trainers``.

Run it (an embedded Redis and 2 silo processes)::

    python -m samples.lightning_port                   # sync and allreduce, each against Lightning's loop
    python -m samples.lightning_port --steps 32 --eval-steps 4 --mode allreduce

The data is ``samples.hf_finetune``'s (token lists: is token 5 before token
6?). The comparison is ``fit_plain``: what Lightning's ``Trainer`` does with
this module on one device over the same global batches, written out in plain
PyTorch. It exits 1 when the job's F1, loss or weights differ from it by more
than float noise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from samples.hf_finetune import (
    Outcome,
    compare,
    global_batches,
    pad,
    seeded,
    tiny_bert,
    token_pairs,
)

# ---- what the module uses of Lightning ---------------------------------------------------------


@dataclass
class TrainerView:
    """The part of ``L.Trainer`` a module reads while configuring its optimizers."""

    estimated_stepping_batches: int
    max_steps: int


class LightningLike(nn.Module):
    """Stands in for ``L.LightningModule``: ``self.log`` goes wherever the running loop points it."""

    def __init__(self) -> None:
        super().__init__()
        self.trainer: TrainerView | None = None
        self._log_to: Callable[[str, Any], None] | None = None

    def log(self, name: str, value: Any, **_: Any) -> None:
        if self._log_to is not None:
            self._log_to(name, value)


@contextlib.contextmanager
def logging_to(module: nn.Module, sink: Callable[[str, Any], None]) -> Iterator[None]:
    module._log_to = sink  # type: ignore[assignment]
    try:
        yield
    finally:
        module._log_to = None  # type: ignore[assignment]


# ---- the user's module, as written for Lightning -----------------------------------------------


class LitClassifier(LightningLike):
    def __init__(self, lr: float = 3e-3, weight_decay: float = 0.1, warmup_steps: int = 16) -> None:
        super().__init__()
        from torchmetrics.classification import BinaryF1Score

        self.hparams = {"lr": lr, "weight_decay": weight_decay, "warmup_steps": warmup_steps}
        self.model = tiny_bert()
        self.val_f1 = BinaryF1Score()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits  # type: ignore[no-any-return]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss  # type: ignore[no-any-return]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self.model(**batch)
        self.val_f1.update(out.logits.argmax(-1), batch["labels"])
        self.log("val_loss", out.loss)
        self.log("val_f1", self.val_f1)

    def configure_optimizers(self) -> dict[str, Any]:
        from transformers import get_linear_schedule_with_warmup

        no_decay = ("bias", "LayerNorm.weight")
        named = list(self.named_parameters())
        groups: list[dict[str, Any]] = [
            {"params": [p for n, p in named if not any(nd in n for nd in no_decay)]},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.hparams["lr"], weight_decay=self.hparams["weight_decay"])
        assert self.trainer is not None
        total = self.trainer.estimated_stepping_batches
        schedule = get_linear_schedule_with_warmup(opt, self.hparams["warmup_steps"], total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class StopOnValF1:
    """``EarlyStopping(monitor="val_f1", mode="max", patience=3)`` (redgrain makes callbacks with
    no arguments, so the settings are class attributes)."""

    monitor, patience = "val_f1", 3

    def __init__(self) -> None:
        self.best: float | None = None
        self.wait = 0

    def on_eval(self, step: int, metrics: dict[str, float]) -> bool:
        value = metrics[self.monitor]
        if self.best is None or value > self.best:
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        return self.wait >= self.patience


# ---- the adapter: a LightningModule onto redgrain's hooks --------------------------------------


def step(module: nn.Module, batch: Any, ctx: Any) -> torch.Tensor:
    """``training_step``, its ``self.log`` calls reported as the step's metrics."""
    with logging_to(module, ctx.log):
        out = module.training_step(batch, ctx.step)  # type: ignore[operator]
    return out["loss"] if isinstance(out, dict) else out  # type: ignore[no-any-return]


def evaluate(module: nn.Module, batch: Any) -> dict[str, Any]:
    """``validation_step``: what it logs for this batch (a held metric object is computed over the
    whole split by redgrain, then reset, as Lightning does at the epoch's end)."""
    logged: dict[str, Any] = {}
    with logging_to(module, logged.__setitem__):
        module.validation_step(batch, 0)  # type: ignore[operator]
    return logged


HERE = "samples.lightning_port"
"""This module's import path: the silos import the adapter from it (``__main__`` when run with -m)."""


def _path(obj: Any) -> str:
    module = HERE if obj.__module__ == "__main__" else obj.__module__
    return f"{module}:{obj.__qualname__}"


def template(module_path: str, module_args: dict[str, Any], total_steps: int) -> tuple[nn.Module, dict[str, Any]]:
    """A module built on the meta device (no memory, no random draws: a silo builds the job's
    seeded models in other threads from torch's one generator) and what its
    ``configure_optimizers`` returns for a job of ``total_steps``."""
    from grains.training.api.job import resolve_path

    cls = resolve_path(module_path, "model")
    with torch.device("meta"):
        module = cls(**module_args)
    module.trainer = TrainerView(estimated_stepping_batches=total_steps, max_steps=total_steps)
    config = module.configure_optimizers()
    if isinstance(config, torch.optim.Optimizer):
        config = {"optimizer": config}
    return module, config


def _scheduler_config(config: dict[str, Any]) -> dict[str, Any] | None:
    sched = config.get("lr_scheduler")
    if sched is None:
        return None
    sched = sched if isinstance(sched, dict) else {"scheduler": sched}
    if isinstance(sched["scheduler"], ReduceLROnPlateau):
        raise TypeError("ReduceLROnPlateau needs a monitored metric each step: redgrain's schedules are stepped without one")
    if sched.get("interval", "epoch") != "step" or sched.get("frequency", 1) != 1:
        raise ValueError("only a scheduler stepped every step (interval='step', frequency=1) maps onto lr_schedule")
    return sched


def replayed_schedule(optimizer: torch.optim.Optimizer, num_training_steps: int, module: str,
                      module_args: dict[str, Any]) -> LRScheduler:  # fmt: skip
    """The module's own scheduler over ``optimizer`` (a holder's, over its part of the model).

    The module builds its scheduler over its own optimizer, not the holder's, so it is stepped
    here once through the job on a meta-device template, and its rate factor at each step
    (rate / base rate, one for all groups) drives a ``LambdaLR`` of the holder's optimizer.
    """
    _, config = template(module, module_args, num_training_steps)
    sched = _scheduler_config(config)
    assert sched is not None
    theirs: LRScheduler = sched["scheduler"]
    base = [g["initial_lr"] for g in theirs.optimizer.param_groups]
    factors: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()"
        for _ in range(num_training_steps + 1):
            rates = [g["lr"] / b for g, b in zip(theirs.optimizer.param_groups, base, strict=True)]
            if max(rates) - min(rates) > 1e-12:
                raise ValueError("the module's scheduler moves its groups' rates apart; replay needs one factor")
            factors.append(rates[0])
            theirs.step()
    last = len(factors) - 1
    return LambdaLR(optimizer, lambda t: factors[min(t, last)])


def lightning_job(module: str, module_args: dict[str, Any], *, max_steps: int, devices: int, batch_size: int,
                  accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None, val_check_interval: int = 0,
                  callbacks: tuple[str, ...] = (), strategy: str = "ddp", **job: Any) -> dict[str, Any]:  # fmt: skip
    """The redgrain job of ``Trainer(...).fit(module)`` (``strategy="ddp"``: mode allreduce)."""
    probe, config = template(module, module_args, max_steps)
    opt: torch.optim.Optimizer = config["optimizer"]
    names = {id(p): n for n, p in probe.named_parameters()}
    trainable = {n for n, p in probe.named_parameters() if p.requires_grad}
    stepped = {names[id(p)] for g in opt.param_groups for p in g["params"]}
    if trainable - stepped:
        raise ValueError(f"parameters no optimizer group steps: {sorted(trainable - stepped)[:5]}")
    # The class's own defaults are left out; the rest travels as plain values.
    signature = inspect.signature(type(opt)).parameters
    given = {k: v for k, v in opt.defaults.items() if k in signature and v != signature[k].default}
    lr = given.pop("lr", opt.defaults["lr"])
    groups = []
    for g in opt.param_groups:
        # A scheduler has already set the group's rate to its first factor; its own is initial_lr.
        setting = {**g, "lr": g.get("initial_lr", g["lr"])}
        overrides = {k: setting[k] for k in opt.defaults if k in setting and setting[k] != opt.defaults[k]}
        if overrides:
            groups.append({"match": sorted(names[id(p)] for p in g["params"]), **overrides})
    spec: dict[str, Any] = {
        "model": module,
        "model_args": module_args,
        "step": _path(step),
        "evaluate": _path(evaluate),
        "optimizer": _path(type(opt)),
        "lr": lr,
        "optimizer_args": {k: list(v) if isinstance(v, tuple) else v for k, v in given.items()},
        "param_groups": groups,
        "steps": max_steps,
        "trainers": devices,
        "batch_size": batch_size,
        "grad_accumulation": accumulate_grad_batches,
        "eval_every": val_check_interval,
        "checkpoint_every": val_check_interval or 50,
        "callbacks": list(callbacks),
        "mode": {"ddp": "allreduce"}.get(strategy, strategy),
    }
    if gradient_clip_val is not None:
        spec["clip_grad_norm"] = gradient_clip_val
    if _scheduler_config(config) is not None:
        spec["lr_schedule"] = _path(replayed_schedule)
        spec["lr_schedule_args"] = {"module": module, "module_args": module_args}
    return {**spec, **job}


# ---- Lightning's loop, written out: one device, the same global batches ------------------------


@dataclass(frozen=True)
class Fit:
    """The ``Trainer`` arguments of the script (2 devices)."""

    max_steps: int = 160
    devices: int = 2
    batch_size: int = 16
    accumulate_grad_batches: int = 2
    gradient_clip_val: float = 1.0
    val_check_interval: int = 16
    eval_batch: int = 128
    seed: int = 1


MODULE = f"{HERE}:LitClassifier"
DATA = {"dataset": "samples.hf_finetune:token_pairs", "collate_fn": "samples.hf_finetune:pad"}
"""The train and val DataLoaders' dataset and collate_fn (``fit(module, train_dl, val_dl)``)."""
MODULE_ARGS: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 16}


def validate(module: LitClassifier, fit: Fit) -> dict[str, float]:
    test = token_pairs("test")
    module.eval()
    loss_sum, n = 0.0, len(test)
    with torch.no_grad():
        for s in range(0, n, fit.eval_batch):
            batch = pad([test[i] for i in range(s, min(s + fit.eval_batch, n))])
            logged: dict[str, Any] = {}
            with logging_to(module, logged.__setitem__):
                module.validation_step(batch, s // fit.eval_batch)
            loss_sum += float(logged["val_loss"]) * len(batch["labels"])
    f1 = float(module.val_f1.compute())
    module.val_f1.reset()
    module.train()
    return {"val_f1": f1, "val_loss": loss_sum / n}


def fit_plain(fit: Fit) -> Outcome:
    """``Trainer(...).fit(module)`` on one device over the job's global batches."""
    module = seeded(lambda: LitClassifier(**MODULE_ARGS), fit.seed)
    assert isinstance(module, LitClassifier)
    module.trainer = TrainerView(estimated_stepping_batches=fit.max_steps, max_steps=fit.max_steps)
    config = module.configure_optimizers()
    opt, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    stopper = StopOnValF1()
    train = token_pairs("train")
    size = fit.batch_size * fit.devices * fit.accumulate_grad_batches
    micro = size // fit.accumulate_grad_batches
    module.train()
    for t, idx in enumerate(global_batches(len(train), size, fit.seed, fit.max_steps)):
        for m in range(fit.accumulate_grad_batches):
            batch = pad([train[i] for i in idx[m * micro : (m + 1) * micro]])
            (module.training_step(batch, t) / fit.accumulate_grad_batches).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), fit.gradient_clip_val)
        opt.step()
        schedule.step()
        opt.zero_grad()
        done = t + 1
        if done % fit.val_check_interval == 0 and done < fit.max_steps:
            metrics = validate(module, fit)
            if stopper.on_eval(done, metrics):
                return Outcome(_as_hf(metrics), done, True, _weights(module))
    return Outcome(_as_hf(validate(module, fit)), fit.max_steps, False, _weights(module))


def _as_hf(metrics: dict[str, float]) -> dict[str, float]:
    """The names :func:`samples.hf_finetune.compare` prints."""
    return {"f1": metrics["val_f1"], "loss": metrics["val_loss"]}


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


async def run_job(redis_url: str, cluster: str, job_id: str, spec: dict[str, Any]) -> Outcome:
    from samples import hf_finetune

    out = await hf_finetune.run_job(redis_url, cluster, job_id, spec)
    return Outcome(_as_hf(out.metrics), out.step, out.stopped_early, out.weights)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", action="append", choices=["sync", "allreduce", "async", "ssp"],
                        help="modes to run (repeat; default sync and allreduce)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=Fit.max_steps)
    parser.add_argument("--eval-steps", type=int, default=Fit.val_check_interval)
    opts = parser.parse_args(argv)
    fit = Fit(max_steps=opts.steps, val_check_interval=opts.eval_steps)
    modes = opts.mode or ["sync", "allreduce"]
    from silo.testing.local import LocalCluster

    # The plain loop shares the machine with two silos: at torch's default of a thread per core
    # the three fight over the cores (24 steps took 69 s instead of 12 on a busy 2-core machine).
    torch.set_num_threads(1)
    os.chdir(ROOT)  # the silos import samples.lightning_port from here
    want = fit_plain(fit)
    ok = True
    with LocalCluster("grains.training", silos=2, cluster="lightning-sample", persist=False) as lc:
        for mode in modes:
            spec = lightning_job(MODULE, MODULE_ARGS, max_steps=fit.max_steps, devices=fit.devices,
                                 batch_size=fit.batch_size, accumulate_grad_batches=fit.accumulate_grad_batches,
                                 gradient_clip_val=fit.gradient_clip_val, val_check_interval=fit.val_check_interval,
                                 callbacks=(_path(StopOnValF1),), strategy=mode, eval_batch_size=fit.eval_batch,
                                 seed=fit.seed, shards=2, **DATA)  # fmt: skip
            got = asyncio.run(run_job(lc.redis_url, lc.cluster, f"lit-{mode}", spec))
            c = compare(mode, got, want, lambda: LitClassifier(**MODULE_ARGS), fit.eval_batch)
            print(c.line, flush=True)
            ok = ok and (mode not in ("sync", "allreduce") or c.same)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
