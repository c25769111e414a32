"""The job's optimizer, parameter groups, learning-rate schedule and gradient clipping.

Built from the spec the same way wherever the optimizer runs (on each
parameter shard for its slice of the model, on every all-reduce trainer for
the whole model), so each holder applies torch's own optimizer to its own
parameters:

- ``optimizer``: ``sgd`` | ``momentum`` | ``adam`` | ``adamw`` (the spec's
  ``lr``, ``momentum``, ``betas``, ``eps``, ``weight_decay``), or the import
  path of any ``torch.optim.Optimizer`` subclass, called with ``lr`` and
  ``optimizer_args`` (which also override a short name's defaults).
- ``param_groups``: ``[{"match": glob | [globs], <overrides>}]``; a trainable
  parameter joins the first group whose glob (``fnmatch`` on its name from
  ``named_parameters()``) matches, the rest form the default group, built
  last. Each group carries its index in the spec as ``rg_group`` (-1: the
  default), so a checkpoint saved by one layout of shards restores into any
  other (see :mod:`grains.training.state.checkpoint`).
- ``lr_schedule``: any ``torch.optim.lr_scheduler`` class, or any callable
  returning one (Hugging Face's ``get_linear_schedule_with_warmup``:
  ``fn(optimizer, num_warmup_steps, num_training_steps)``), with
  ``lr_schedule_args``. Arguments come from the job where the schedule asks for
  them and the args do not say: ``num_training_steps`` (the job's total steps)
  and ``num_warmup_steps`` (``warmup_steps``: the factory then does the warmup
  itself); an arg whose value is the string ``"total_steps"`` (LinearLR's
  ``total_iters``, CosineAnnealingLR's ``T_max``) becomes the steps the
  schedule runs: the job's total, less ``warmup_steps`` when our warmup comes
  first. The total is the job's current one, so an ``epochs`` or elastic job
  whose length is recomputed as trainers change rebuilds its schedule over the
  new length at the step it resumes (:func:`sync_rates`). ``warmup_steps``
  with a class (or alone) puts a ``LinearLR`` from ``1/(warmup_steps+1)`` to
  1 in front of it (``SequentialLR`` at milestone ``warmup_steps``): the first
  step runs at ``lr/(w+1)``, never at 0 (HF's warmup starts at 0; its factory
  gives exactly that). Stepped once per global step after the optimizer step,
  as a plain loop does; a restored holder rebuilds it and steps it to the
  restored step, which gives every holder the same rate.
- ``clip_grad_norm``: the global norm of the gradient the optimizer steps on,
  as ``torch.nn.utils.clip_grad_norm_`` computes it (``clip_coefficient``).

Frozen parameters (``requires_grad=False``) are in no group: nothing updates them.
"""

from __future__ import annotations

import fnmatch
import inspect
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LinearLR, LRScheduler, ReduceLROnPlateau, SequentialLR

from grains.training.api.job import TrainingJob, resolve_path
from silo.errors import ConfigError

DEFAULT_GROUP = -1


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters an optimizer updates, in model order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def group_index(name: str, spec: TrainingJob) -> int:
    """The spec's parameter group a parameter joins (``DEFAULT_GROUP``: none matched)."""
    for i, g in enumerate(spec.param_groups):
        globs = [g["match"]] if isinstance(g["match"], str) else g["match"]
        if any(fnmatch.fnmatchcase(name, m) for m in globs):
            return i
    return DEFAULT_GROUP


def group_order(tag: int) -> tuple[bool, int]:
    """Groups are built in spec order, the default group last."""
    return (tag == DEFAULT_GROUP, tag)


def optimizer_class(spec: TrainingJob) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and its defaults (the spec's fields, then ``optimizer_args``)."""
    base: dict[str, Any] = {"lr": spec.lr}
    cls: Any
    if spec.optimizer == "sgd":
        cls, base = torch.optim.SGD, {**base, "momentum": 0.0, "weight_decay": spec.weight_decay}
    elif spec.optimizer == "momentum":
        cls, base = torch.optim.SGD, {**base, "momentum": spec.momentum, "weight_decay": spec.weight_decay}
    elif spec.optimizer == "adam":
        cls = torch.optim.Adam
        base = {**base, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}
    elif spec.optimizer == "adamw":
        cls = torch.optim.AdamW
        base = {**base, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}
    else:
        cls = resolve_path(spec.optimizer, "optimizer")
        if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer {spec.optimizer!r} is not a torch.optim.Optimizer subclass")
        return cls, {**base, **spec.optimizer_args}
    return cls, {**base, **spec.optimizer_args}


_FUSED_DEVICES = ("cpu", "cuda")
"""Where torch has fused kernels for the short-named optimizers (SGD, Adam, AdamW)."""


def _implementation(spec: TrainingJob, params: Sequence[nn.Parameter]) -> dict[str, bool]:
    """The implementation flag a short-named optimizer gets when ``optimizer_args`` names none.

    torch's fused kernels: one kernel a tensor for the whole update, where the multi-tensor
    (``foreach``) implementation dispatches each of ~15 operations over the tensor list, with a
    Python list per operation. For AdamW over the tiny BERT's 41 tensors: per-tensor loop (what
    torch picks on the CPU) 0.91 ms, foreach 0.52, fused 0.15; the update is the event loop's
    largest piece of a sync step. Fused steps equal the per-tensor loop's to float rounding
    (1-2 ulp), not bit for bit; every holder of a job runs the same kernels, so all-reduce ranks
    and replays stay bit-identical. Hugging Face's Trainer picks it too (``adamw_torch_fused``).
    Elsewhere (a device without the kernels): ``foreach``, bitwise the per-tensor loop's steps.
    """
    if spec.optimizer not in ("sgd", "momentum", "adam", "adamw") or {"foreach", "fused"} & set(spec.optimizer_args):
        return {}
    if all(p.is_floating_point() and p.device.type in _FUSED_DEVICES for p in params):
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(named: Sequence[tuple[str, nn.Parameter]], spec: TrainingJob) -> torch.optim.Optimizer | None:
    """The spec's optimizer over ``named`` (trainable, model order); None when there are none."""
    if not named:
        return None
    cls, defaults = optimizer_class(spec)
    defaults.update(_implementation(spec, [p for _, p in named]))
    members: dict[int, list[nn.Parameter]] = {}
    for name, p in named:
        members.setdefault(group_index(name, spec), []).append(p)
    groups: list[dict[str, Any]] = []
    for tag in sorted(members, key=group_order):
        overrides = {k: v for k, v in spec.param_groups[tag].items() if k != "match"} if tag != DEFAULT_GROUP else {}
        groups.append({"params": members[tag], **overrides, "rg_group": tag})
    try:
        return cls(groups, **defaults)  # type: ignore[call-arg]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"optimizer {spec.optimizer} with {defaults} and groups {spec.param_groups}: {exc}") from None


TOTAL_STEPS = "total_steps"
"""An ``lr_schedule_args`` value that stands for the steps the schedule runs (the job's total)."""


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def schedule_args(spec: TrainingJob, fn: Any, total_steps: int | None) -> tuple[dict[str, Any], bool]:
    """The keyword arguments ``fn`` (the schedule class or factory) is called with, and whether
    it does the warmup itself (it takes ``num_warmup_steps``)."""
    args = dict(spec.lr_schedule_args)
    names = _parameters(fn)
    own_warmup = "num_warmup_steps" in names
    if own_warmup:
        args.setdefault("num_warmup_steps", spec.warmup_steps)
    if "num_training_steps" in names and "num_training_steps" not in args and total_steps is not None:
        args["num_training_steps"] = total_steps
    runs = None if total_steps is None else max(1, total_steps - (0 if own_warmup else spec.warmup_steps))
    for k, v in args.items():
        if v == TOTAL_STEPS:
            if runs is None:
                raise ConfigError(f"lr_schedule_args[{k!r}] = {TOTAL_STEPS!r} needs the job's length (steps or epochs)")
            args[k] = runs
    return args, own_warmup


def build_schedule(opt: torch.optim.Optimizer | None, spec: TrainingJob, total_steps: int | None = None) -> LRScheduler | None:
    """The spec's learning-rate schedule over ``opt`` (None: constant rate), for a job of
    ``total_steps`` steps (None: not known, only a schedule that needs it is refused)."""
    if opt is None or (spec.lr_schedule is None and not spec.warmup_steps):
        return None
    for g in opt.param_groups:
        # A schedule rebuilt over an optimizer that has stepped (a re-formed group's survivor, a
        # job whose length changed) starts from the base rates: torch's chainable schedules
        # (LinearLR, ...) scale the groups' current rate, which would compound the old decay.
        if "initial_lr" in g:
            g["lr"] = g["initial_lr"]
    with warnings.catch_warnings():
        # SequentialLR steps its next scheduler with an explicit epoch at a milestone, which
        # torch flags as deprecated; that is its own implementation, not ours to change.
        warnings.simplefilter("ignore", UserWarning)
        main: LRScheduler | None = None
        own_warmup = False
        if spec.lr_schedule is not None:
            fn = resolve_path(spec.lr_schedule, "lr_schedule")
            is_class = inspect.isclass(fn)
            if (is_class and not issubclass(fn, LRScheduler)) or (is_class and issubclass(fn, ReduceLROnPlateau)) or not callable(fn):
                raise ConfigError(
                    f"lr_schedule {spec.lr_schedule!r} is not a torch.optim.lr_scheduler class stepped without a metric,"
                    " nor a function returning one"
                )
            args, own_warmup = schedule_args(spec, fn, total_steps)
            try:
                made = fn(opt, **args)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"lr_schedule {spec.lr_schedule}({args}): {exc}") from None
            if not isinstance(made, LRScheduler) or isinstance(made, ReduceLROnPlateau):
                raise ConfigError(
                    f"lr_schedule {spec.lr_schedule!r} returned {type(made).__name__}, not a torch.optim.lr_scheduler"
                    " scheduler stepped without a metric"
                )
            main = made
        if not spec.warmup_steps or own_warmup:
            return main
        warm = LinearLR(opt, start_factor=1.0 / (spec.warmup_steps + 1), end_factor=1.0, total_iters=spec.warmup_steps)
        if main is None:
            return warm
        return SequentialLR(opt, [warm, main], milestones=[spec.warmup_steps])


def advance(schedule: LRScheduler | None, steps: int) -> None:
    """Step a fresh schedule ``steps`` times (a holder restored at global step ``steps``)."""
    if schedule is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()"
        for _ in range(steps):
            schedule.step()


def sync_rates(opt: torch.optim.Optimizer | None, schedule: LRScheduler | None) -> None:
    """Give ``opt``'s groups the rate ``schedule`` has now: a holder restored with saved groups
    takes the rate of its schedule over the job's current length (an ``epochs`` or elastic job
    recomputes it when trainers change); where the length did not change, they agree."""
    if opt is None or schedule is None:
        return
    for group, lr in zip(opt.param_groups, schedule.get_last_lr(), strict=True):
        group["lr"] = lr


def step_schedule(schedule: LRScheduler | None) -> None:
    if schedule is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            schedule.step()


def squared_norm(grads: Iterable[torch.Tensor]) -> float:
    """The sum of squared L2 norms (one holder's part of the global norm)."""
    total = 0.0
    for g in grads:
        total += float(torch.linalg.vector_norm(g.detach().float(), 2.0)) ** 2
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What ``clip_grad_norm_`` multiplies gradients by for this global norm (1.0: no clipping)."""
    if not math.isfinite(total_norm):
        return 1.0  # clip_grad_norm_ (error_if_nonfinite=False) leaves the non-finite step to the skip rule
    return min(1.0, max_norm / (total_norm + 1e-6))


def check_param_groups(model: nn.Module, spec: TrainingJob) -> None:
    """Every group's globs match at least one trainable parameter (ConfigError naming it)."""
    names = [n for n, _ in trainable(model)]
    for i, g in enumerate(spec.param_groups):
        globs = [g["match"]] if isinstance(g["match"], str) else g["match"]
        for m in globs:
            if not any(fnmatch.fnmatchcase(n, m) for n in names):
                sample = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise ConfigError(f"param_groups[{i}] match {m!r} matches no trainable parameter (they are: {sample})")
    if not names:
        raise ConfigError(f"model {spec.model} has no trainable parameters")
