"""The user's training program: their step and evaluation functions, run as the contract says.

:func:`run_step` calls the job's step on one batch and checks what comes
back (a scalar floating tensor that has a gradient, and metrics that are
numbers); :func:`evaluate` runs the job's evaluation over a whole split in
``eval()`` mode under ``torch.no_grad()``, each metric averaged weighted by
the batch's samples. :func:`check_program` runs both once on one batch at
submit, so a step that returns no scalar, a batch the model cannot take or a
metric that is not a number fails there with a ConfigError, before anything
is placed.

Errors while a job runs: :class:`TrainingStepError` (the step broke its
contract, or raised) and :class:`NonFiniteLossError` (``on_nonfinite =
"fail"``) are *fatal*: the same batch would fail the same way again, so the
job fails at once with the reason instead of restarting the trainer.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from grains.training.api.job import DEFAULT_LOSS, TrainingJob, resolve_path
from silo.errors import ConfigError

StepFn = Callable[[nn.Module, Any], Any]
EvalFn = Callable[[nn.Module, Any], Mapping[str, Any]]
LossFn = Callable[[torch.Tensor, Any], Any]
"""Pipeline mode's hook: ``fn(output, target) -> loss`` or ``-> (loss, {"name": float})``."""


class TrainingStepError(RuntimeError):
    """The job's step function raised or returned something other than its contract (fatal)."""


class NonFiniteLossError(RuntimeError):
    """A step's loss was NaN or infinite and the job says ``on_nonfinite = "fail"`` (fatal)."""


def nonfinite(value: float, step: int, policy: str) -> bool:
    """The job's rule for a step's loss ``value``, the same in every mode: True when the step is
    to be skipped (not finite, ``on_nonfinite = "skip"``); NonFiniteLossError naming the step
    under ``"fail"``; False when the loss is finite."""
    if math.isfinite(value):
        return False
    if policy == "fail":
        raise NonFiniteLossError(f"step {step}: the loss is {value} (on_nonfinite='fail')")
    return True


def is_out_of_memory(exc: BaseException) -> bool:
    """Out of memory, raised directly or from inside the user's step."""
    oom = (MemoryError, *((torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else ()))
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, oom):
            return True
        seen = seen.__cause__
    return False


def is_fatal(exc: BaseException) -> bool:
    """Whether retrying the same work would fail the same way (the job fails at once)."""
    if isinstance(exc, (TrainingStepError, NonFiniteLossError, MemoryError)):
        return True
    return isinstance(exc, getattr(torch, "OutOfMemoryError", ()))  # CUDA and MPS out of memory


@dataclass(slots=True)
class StepContext:
    """What a step taking a third argument, ``fn(model, batch, ctx)``, is told about its step.

    ``ctx.log(name, value)`` records a scalar of this step; it is reported beside the step's
    metrics (the job's status, history and dashboard), averaged over the trainers.
    """

    step: int
    """The global step (0-based)."""
    epoch: int
    """The epoch the step's samples come from (0 for a stream)."""
    rank: int
    """This trainer's index among the step's ``trainers`` (0 .. trainers - 1)."""
    trainers: int
    """Trainers taking this step."""
    device: str
    logged: dict[str, float] = field(default_factory=dict)

    def log(self, name: str, value: float | torch.Tensor) -> None:
        """Report ``value`` (a number or a one-element tensor) as this step's ``name``."""
        self.logged.update(numbers({name: value}, "ctx.log"))

    # The names of the first release of the context; steps written against it keep working.
    @property
    def slot(self) -> int:
        """Deprecated spelling of :attr:`rank`."""
        warnings.warn("StepContext.slot is StepContext.rank", DeprecationWarning, stacklevel=2)
        return self.rank

    @property
    def world(self) -> int:
        """Deprecated spelling of :attr:`trainers`."""
        warnings.warn("StepContext.world is StepContext.trainers", DeprecationWarning, stacklevel=2)
        return self.trainers


def takes_context(fn: Callable[..., Any]) -> bool:
    """Whether a step function takes the :class:`StepContext` as a third positional argument."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


@dataclass(frozen=True, slots=True)
class Program:
    """The resolved hooks of one job (resolve once per trainer or stage: imports are not free)."""

    step_fn: StepFn
    eval_fn: EvalFn
    precision: str
    device: str
    context: bool = False
    """The step takes a :class:`StepContext` third."""

    @classmethod
    def of(cls, spec: TrainingJob, device: str = "cpu") -> Program:
        # Pipeline mode runs a loss hook on the last stage, not a step (no stage holds the
        # whole model); as one process it is the step fn(model(input), target).
        step = loss_step(loss_function(spec)) if spec.mode == "pipeline" else resolve_path(spec.step, "step")
        context = spec.mode != "pipeline" and takes_context(step)
        return cls(step, resolve_path(spec.evaluate, "evaluate"), spec.amp, device, context)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast at the job's precision (fp32: none)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=torch.device(self.device).type, dtype=dtype)

    def step(self, model: nn.Module, batch: Any, ctx: StepContext | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The job's step on ``batch`` under autocast: the loss (not yet backpropagated) and metrics
        (with what the step logged through ``ctx``)."""
        with self.autocast():
            if not self.context:
                return call_user("step", self.step_fn, model, batch)
            if ctx is None:
                ctx = StepContext(step=0, epoch=0, rank=0, trainers=1, device=self.device)
            loss, metrics = call_user("step", self.step_fn, model, batch, ctx)
            return loss, {**metrics, **ctx.logged}


def loss_function(spec: TrainingJob) -> LossFn:
    """The job's pipeline loss (``loss``; default: classification cross-entropy)."""
    return resolve_path(spec.loss or DEFAULT_LOSS, "loss")  # type: ignore[no-any-return]


def run_loss(fn: LossFn, output: torch.Tensor, target: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Pipeline mode, last stage: the loss hook on a micro-batch's output and targets, checked
    against the step's contract (a scalar floating loss with a gradient, metrics that are numbers)."""
    return call_user("loss", fn, output, target)


def call_user(what: str, fn: Callable[..., Any], *args: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """The user's ``what`` function on ``args``, its result checked; whatever it raises becomes a
    TrainingStepError naming it (ours pass through)."""
    try:
        out = fn(*args)
    except (TrainingStepError, ConfigError):
        raise
    except Exception as exc:
        raise TrainingStepError(f"the {what} function raised {type(exc).__name__}: {exc}") from exc
    return split_result(out)


def loss_step(fn: LossFn) -> StepFn:
    """The whole-model step a pipeline's loss hook amounts to: ``fn(model(input), target)`` on an
    ``(input, target)`` batch (what submit checks, and what one process would run)."""

    def step(model: nn.Module, batch: Any) -> Any:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(f"pipeline mode takes (input, target) batches, not {type(batch).__name__}")
        out = model(batch[0])
        return fn(out.float() if out.is_floating_point() else out, batch[1])

    step.__qualname__ = getattr(fn, "__qualname__", "loss")
    step.__module__ = getattr(fn, "__module__", __name__)
    return step


def split_result(out: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss`` or ``(loss, metrics)`` checked against the step contract."""
    metrics: Mapping[str, Any] = {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        out, metrics = out
    elif not isinstance(out, torch.Tensor | tuple):
        # A Hugging Face ModelOutput (a mapping with a `loss` attribute), read as HF's Trainer
        # reads it: so `return model(**batch)` is a whole step.
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if isinstance(loss, torch.Tensor):
            out = loss
    if not isinstance(out, torch.Tensor) or out.numel() != 1 or not out.is_floating_point():
        what = f"a tensor of shape {tuple(out.shape)} and dtype {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TrainingStepError(f"the step must return a scalar floating loss tensor (or (loss, metrics)), not {what}")
    if not out.requires_grad:
        raise TrainingStepError("the step's loss does not require grad: it was not computed from the model's parameters")
    return out.reshape(()), numbers(metrics, "step")


def numbers(metrics: Mapping[str, Any], what: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TrainingStepError(f"the {what} function's metric {k!r} is {type(v).__name__}, not a number")
        out[k] = float(v)
    return out


def is_metric(value: Any) -> bool:
    """A metric object (``update()`` and ``compute()``, as torchmetrics' ``Metric``), not a number."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "compute", None)) and not isinstance(value, Mapping)


def evaluate(program: Program, model: nn.Module, batches: Iterable[Any], samples: Callable[[Any], int]) -> dict[str, float]:
    """The evaluation over ``batches`` in ``eval()`` mode.

    A number an evaluation returns is a mean over its batch: the result is each one's mean
    weighted by samples. A metric object (``update()``/``compute()``: torchmetrics works
    unmodified) is exact over the whole split instead: return the same object from every batch
    (updated by you), or a new one per batch that redgrain merges (``merge_state``); the result
    is its ``compute()`` at the end, so F1, AUROC or perplexity are those of the split, not a
    mean of per-batch values. A held object is ``reset()`` after, ready for the next evaluation.
    """
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    objects: dict[str, Any] = {}
    count = 0
    try:
        with torch.no_grad(), program.autocast():
            for batch in batches:
                n = samples(batch)
                try:
                    got = program.eval_fn(model, batch)
                except Exception as exc:
                    raise TrainingStepError(f"the evaluate function raised {type(exc).__name__}: {exc}") from exc
                if not isinstance(got, Mapping):
                    raise TrainingStepError(f"the evaluate function must return {{name: float}}, not {type(got).__name__}")
                plain = {k: v for k, v in got.items() if not is_metric(v)}
                for k, v in got.items():
                    if k not in plain:
                        _merge(objects, k, v)
                for k, v in numbers(plain, "evaluate").items():
                    sums[k] = sums.get(k, 0.0) + v * n
                count += n
        out = {k: v / max(1, count) for k, v in sums.items()}
        for k, obj in objects.items():
            try:
                value = obj.compute()
            except Exception as exc:
                raise TrainingStepError(f"the evaluate function's metric {k!r}: compute() raised {type(exc).__name__}: {exc}") from exc
            out.update(numbers({k: value}, "evaluate"))
            reset = getattr(obj, "reset", None)
            if callable(reset):
                reset()
        return out
    finally:
        model.train(was_training)


def _merge(objects: dict[str, Any], name: str, metric: Any) -> None:
    held = objects.get(name)
    if held is None:
        objects[name] = metric
        return
    if held is metric:
        return
    merge = getattr(held, "merge_state", None)
    if not callable(merge):
        raise TrainingStepError(
            f"the evaluate function returned a new {type(metric).__name__} for {name!r} at each batch and it has no"
            " merge_state(): return the same metric object from every batch"
        )
    merge(metric)


def first(items: Iterable[Any]) -> Any:
    it: Iterator[Any] = iter(items)
    try:
        return next(it)
    except StopIteration:
        raise ConfigError("the dataset yields no batch") from None


def check_program(program: Program, model: nn.Module, train_batch: Any, test_batch: Any, samples: Callable[[Any], int]) -> None:
    """One step (forward, loss, backward) and one evaluation, as at submit: ConfigError saying why."""
    try:
        model.train()
        loss, _ = program.step(model, train_batch)
        loss.backward()
        evaluate(program, model, [test_batch], samples)
    except (TrainingStepError, NonFiniteLossError) as exc:
        raise ConfigError(f"step {program.step_fn.__module__}.{getattr(program.step_fn, '__qualname__', '?')}: {exc}") from None
    finally:
        model.zero_grad(set_to_none=True)
