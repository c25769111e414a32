"""One training step's policy, the same in every mode (Lightning's Precision + the loop's step).

Parameter-server trainers, all-reduce ranks and the whole-model checks run
the user's step through :class:`StepRunner`; they differ only in where the
gradients go between :meth:`StepRunner.backward` and the update (pushed to
shards, averaged over the group). Pipeline stages hold a runner too and take
its policy piece by piece (their forward and backward are split by
micro-batch). What is the same everywhere lives here,
once:

- autocast at the job's precision, and the user's step checked against its
  contract (:mod:`grains.training.loop.program`);
- gradient accumulation: the trainer's batch of ``batch_size x
  grad_accumulation`` samples runs as ``grad_accumulation`` chunks, each
  loss divided by their number, so the accumulated gradient is that of the
  whole batch (exactly, for a loss that is a mean over samples);
- the non-finite rule (:func:`grains.training.loop.program.nonfinite`): a NaN or
  inf loss fails the job naming the step, or skips the step on every holder;
- fp16 loss scaling (:class:`grains.training.loop.loss_scale.LossScaler`): the
  loss scaled before backward, the gradients the update uses (local or the
  group's mean) unscaled and checked once, an overflow skipping the step;
- gradient clipping (``clip_grad_norm``) on what the update uses;
- the step's random draws seeded from (seed, step, rank) (:mod:`grains.training.loop.rng`),
  so a resumed step draws what it drew the first time.

The runner's state (the scaler's) is part of every mode's snapshot.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grains.training.api.job import TrainingJob
from grains.training.data.batches import batch_samples
from grains.training.loop.loss_scale import LossScaler
from grains.training.loop.optim import clip_coefficient, squared_norm
from grains.training.loop.program import Program, StepContext, nonfinite
from grains.training.loop.rng import draws


@dataclass(slots=True)
class Backward:
    """What one step's forward and backward left behind (the gradients are on the parameters)."""

    loss: float
    """The loss of the trainer's whole batch (the chunks' mean)."""
    metrics: dict[str, float]
    samples: int
    skip: bool
    """The loss was not finite (``on_nonfinite = "skip"``): no gradient was computed."""


def split_batch(batch: Any, chunks: int) -> list[Any]:
    """``batch`` cut into ``chunks`` along the leading dimension of every tensor in it (any
    nesting of tuples, lists and dicts; other leaves are repeated)."""
    if chunks == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * chunks
        parts = batch.chunk(chunks)
        if len(parts) != chunks:
            raise ValueError(f"a batch of {batch.shape[0]} samples cannot be cut into {chunks} chunks")
        return list(parts)
    if isinstance(batch, Mapping):
        cut = {k: split_batch(v, chunks) for k, v in batch.items()}
        return [type(batch)({k: v[i] for k, v in cut.items()}) if type(batch) is not dict else {k: v[i] for k, v in cut.items()} for i in range(chunks)]  # type: ignore[call-arg]
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        cols = [split_batch(v, chunks) for v in batch]
        rows = [[c[i] for c in cols] for i in range(chunks)]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):
            return [type(batch)(*r) for r in rows]
        return [type(batch)(r) if isinstance(batch, tuple) else r for r in rows]
    return [batch] * chunks


class StepRunner:
    """The step policy of one holder of trainable parameters ``params`` (used off the loop).

    A PS trainer or an all-reduce rank runs the user's whole step through :meth:`backward`; a
    pipeline stage, whose forward and backward are split by micro-batch and whose loss is the
    last stage's, takes the same policy piece by piece: :meth:`forward_context` around each
    forward, :meth:`nonfinite` on the loss, :meth:`clip_coefficient` over every stage's norm.
    """

    def __init__(self, spec: TrainingJob, device: str, params: Iterable[nn.Parameter]) -> None:
        self.program = Program.of(spec, device)
        self.params = [p for p in params if p.requires_grad]
        self.policy = spec.on_nonfinite
        self.clip_norm = spec.clip_grad_norm
        self.chunks = spec.grad_accumulation
        self.scaler = LossScaler(spec.loss_scale, spec.loss_scale_growth_interval) if spec.amp == "fp16" else None
        self.seed = spec.seed

    def backward(self, model: nn.Module, batch: Any, step: int, *, rank: int = 0, trainers: int = 1, epoch: int = 0) -> Backward:
        """The user's step on ``batch`` (in ``grad_accumulation`` chunks) and its backward; the
        gradients are left, still scaled, on the parameters. ``rank`` of ``trainers`` and ``epoch``
        are what a step that takes a context is told."""
        for p in self.params:
            p.grad = None
        losses: list[float] = []
        sums: dict[str, float] = {}
        for i, chunk in enumerate(split_batch(batch, self.chunks)):
            ctx = StepContext(step=step, epoch=epoch, rank=rank, trainers=trainers, device=self.program.device)
            with self.draws(step, rank, part=i):  # a resumed step draws as the first run did
                loss, metrics = self.program.step(model, chunk, ctx)  # under autocast
            value = float(loss.detach())  # one read of the loss a chunk (on CUDA each read waits)
            if self.nonfinite(value, step):
                for p in self.params:
                    p.grad = None
                return Backward(value, metrics, batch_samples(batch), True)
            losses.append(value)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            if self.chunks > 1:
                loss = loss / self.chunks
            (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()
        n = len(losses)
        return Backward(sum(losses) / n, {k: v / n for k, v in sums.items()}, batch_samples(batch), False)

    def draws(self, step: int, rank: int, part: int = 0) -> contextlib.AbstractContextManager[None]:
        """Around a forward: torch's generators seeded for (step, rank, part), held by this thread
        (:mod:`grains.training.loop.rng`)."""
        return draws(self.seed, step, rank, self.program.device, part)

    def forward_context(self, step: int, rank: int, part: int = 0) -> contextlib.ExitStack[bool | None]:
        """Around a forward that is not the user's whole step (a pipeline stage's): the step's
        seeded draws and the job's autocast, as :meth:`backward` runs the user's step."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.draws(step, rank, part))
        stack.enter_context(self.program.autocast())
        return stack

    def nonfinite(self, value: float, step: int) -> bool:
        """The job's non-finite rule for a loss of ``step``: True to skip the step, False to go on
        (``on_nonfinite = "fail"``: raises NonFiniteLossError naming the step)."""
        return nonfinite(value, step, self.policy)

    def clip_coefficient(self, squared_norm: float) -> float:
        """The factor on the gradients whose squared global norm is ``squared_norm`` (the sum over
        every holder of the step's parameters) that ``clip_grad_norm`` asks for; 1.0 without it."""
        return 1.0 if self.clip_norm is None else clip_coefficient(math.sqrt(squared_norm), self.clip_norm)

    def grads(self) -> list[torch.Tensor]:
        """The parameters' gradients (zeros where a parameter took no part in the loss)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def unscale(self, grads: Iterable[torch.Tensor]) -> bool:
        """Unscale the gradients the update will use and update the scale; True on an overflow
        (the step is skipped). Without fp16 scaling: nothing to do, False."""
        if self.scaler is None:
            return False
        overflow = self.scaler.unscale_(grads)
        self.scaler.update(overflow)
        return overflow

    def clip(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Clip the gradients on ``params`` (default: the runner's) to ``clip_grad_norm``."""
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(params) if params is not None else self.params, self.clip_norm)

    def clip_tensors(self, grads: Iterable[torch.Tensor]) -> None:
        """Clip gradient tensors held apart from their parameters (a trainer's error-compensated
        gradients, about to be compressed and sent) to ``clip_grad_norm``, in place."""
        grads = list(grads)
        if self.clip_norm is None or not grads:
            return
        coef = self.clip_coefficient(squared_norm(grads))
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)

    def state_dict(self) -> dict[str, float]:
        """The loss scaler's state ({} without fp16 scaling)."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state)
