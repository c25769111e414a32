"""One pipeline stage's module, optimizer and micro-batch activations (its grain: stage.py).

Runs on the silo's executor, one operation at a time (a lock): a forward
keeps the micro-batch's input and output (the autograd graph) until its
backward, which accumulates the parameters' gradients and returns the
gradient of the input for the previous stage. The last stage computes the
loss: the job's ``loss`` hook (default: cross-entropy) on the stage's output
and the micro-batch's targets, scaled by ``1 / microbatches``, so the accumulated gradient of a step is that of the
whole batch, as one process computes it. ``apply`` then runs the job's
optimizer and schedule on this stage's parameters only.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn

from grains.training.api.messages import StageConfig
from grains.training.loop.optim import (
    advance,
    build_optimizer,
    build_schedule,
    squared_norm,
    step_schedule,
    sync_rates,
)
from grains.training.loop.program import loss_function, run_loss
from grains.training.loop.step_runner import StepRunner
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.state.model_tensors import persistent_buffers
from grains.training.state.optimizer_state import load_optimizer_state, optimizer_state


def to_device(t: Any, device: str) -> Any:
    """A target (a tensor, or any nesting of them) on ``device``."""
    if isinstance(t, torch.Tensor):
        return t.to(device)
    if isinstance(t, (list, tuple)):
        return type(t)(to_device(v, device) for v in t)
    if isinstance(t, dict):
        return {k: to_device(v, device) for k, v in t.items()}
    return t


class StageCore:
    def __init__(self, cfg: StageConfig, device: str, snapshot: TrainingSnapshot | None, module: nn.Module) -> None:
        spec = cfg.spec
        self.module = module  # its parameters and buffers carry the whole model's names
        self.module.train()
        self.first = cfg.index == 0
        self.device = device
        self.last = cfg.index == len(cfg.stage_keys) - 1
        self.loss_fn = loss_function(spec)
        self.scale = 1.0 / spec.microbatches
        self.rank, self.index, self.microbatches = cfg.rank, cfg.index, spec.microbatches
        self.wire = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.compression)
        """Activations and their gradients travel in this dtype (None: as computed)."""
        self.runner = StepRunner(spec, device, [p for _, p in self.module.named_parameters()])
        """The job's step policy, the one of every mode: this stage's forwards run in its seeded
        draws and autocast, its loss goes through its non-finite rule, its clipping coefficient
        (over every stage's norm) is its rule."""
        named = list(self.module.named_parameters())
        self.params = dict(named)
        self.trainable = [(n, p) for n, p in named if p.requires_grad]
        self.buffers = dict(persistent_buffers(self.module))
        self.opt = build_optimizer(self.trainable, spec)
        self.schedule = build_schedule(self.opt, spec, cfg.end_step or None)
        self.acts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.step = cfg.start_step
        self.lock = threading.Lock()
        self.forward_s = self.backward_s = 0.0
        self.forwards = self.backwards = 0
        self.spans: list[tuple[int, str, float, float]] = []
        """The current step's micro-batch spans (mb, F/B, start, end; unix seconds)."""
        self.last_spans: list[tuple[int, str, float, float]] = []
        if snapshot is not None:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(snapshot.params[n] if n in snapshot.params else snapshot.buffers[n])
                for n, t in self.buffers.items():
                    t.copy_(snapshot.buffers[n])
            advance(self.schedule, snapshot.step)
            load_optimizer_state(self.opt, self.trainable, snapshot.optimizer)
            sync_rates(self.opt, self.schedule)
            self.step = snapshot.step

    def forward(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        """A micro-batch's forward; its graph is kept for the backward. Returns the output, detached."""
        with self.lock:
            t0 = time.perf_counter()
            x = x.to(self.device)
            if x.is_floating_point() and not self.first:
                x = x.float().requires_grad_(True)  # a compressed activation computes in fp32
            # Each micro-batch's draws on each stage, whatever order the schedule ran them in.
            with self.runner.forward_context(self.step, self.rank, part=1 + self.index * self.microbatches + mb):
                y = self.module(x)
            self.acts[mb] = (x, y)
            self._span(mb, "F", t0)
            self.forwards += 1
            return self.to_wire(y.detach())

    def _span(self, mb: int, kind: str, t0: float) -> None:
        took = time.perf_counter() - t0
        if kind == "F":
            self.forward_s += took
        else:
            self.backward_s += took
        end = time.time()
        self.spans.append((mb, kind, end - took, end))

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as it is sent to the next (or previous) stage: compressed when the job says so."""
        return t.to(self.wire) if self.wire is not None and t.is_floating_point() else t

    def on_wire(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else self.to_wire(t)

    def loss_backward(self, mb: int, target: Any) -> tuple[float, dict[str, float], torch.Tensor | None]:
        """Last stage: the job's loss on the micro-batch and its backward; the loss, the loss
        function's metrics and the input's gradient."""
        with self.lock:
            t0 = time.perf_counter()
            x, y = self.acts.pop(mb)
            loss, metrics = run_loss(self.loss_fn, y.float() if y.is_floating_point() else y, to_device(target, self.device))
            (loss * self.scale).backward()
            self._span(mb, "B", t0)
            self.backwards += 1
            return float(loss.detach()), metrics, (self.on_wire(x.grad) if x.requires_grad else None)

    def backward(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        """A micro-batch's backward from the next stage's input gradient; the input's gradient."""
        with self.lock:
            t0 = time.perf_counter()
            x, y = self.acts.pop(mb)
            # A stage with no trainable parameter fed a batch (a Flatten cut off alone, say)
            # computes nothing that needs a gradient: its backward is nothing.
            if y.requires_grad:
                y.backward(grad.to(self.device, y.dtype))
            self._span(mb, "B", t0)
            self.backwards += 1
            return self.on_wire(x.grad) if x.requires_grad else None

    def local_part(self) -> dict[str, torch.Tensor]:
        """Hybrid: this trainer's accumulated gradients and floating buffers, to be averaged."""
        with self.lock:
            out = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for n, p in self.trainable}
            out.update({n: t.detach().clone() for n, t in self.buffers.items() if t.is_floating_point()})
            return out

    @staticmethod
    def mean_of(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {n: t.clone() for n, t in parts[0].items()}
        for part in parts[1:]:
            for n, t in part.items():
                out[n].add_(t.to(out[n].device))
        return {n: t.div_(len(parts)) for n, t in out.items()}

    def take_mean(self, mean: dict[str, torch.Tensor]) -> None:
        """Hybrid: the trainers' mean gradient and buffers replace this trainer's own."""
        with self.lock, torch.no_grad():
            for n, p in self.trainable:
                p.grad = mean[n].to(p.device, p.dtype).clone()
            for n, t in self.buffers.items():
                if n in mean:
                    t.copy_(mean[n])

    def discard_step(self) -> None:
        """Drop the unfinished step (its activations and gradients); the applied state stays."""
        with self.lock:
            self.acts.clear()
            self.spans = []
            if self.opt is not None:
                self.opt.zero_grad(set_to_none=True)

    def norm_sq(self) -> float:
        with self.lock:
            return squared_norm(p.grad for _, p in self.trainable if p.grad is not None)

    def apply(self, coef: float, skip: bool = False) -> None:
        """The step's optimizer update on this stage (gradients times the clip coefficient); with
        ``skip`` (a non-finite loss, ``on_nonfinite = "skip"``) the gradients are dropped instead,
        and the schedule and the step counter advance all the same."""
        with self.lock:
            if skip:
                if self.opt is not None:
                    self.opt.zero_grad(set_to_none=True)
            elif self.opt is not None:
                if coef != 1.0:
                    for _, p in self.trainable:
                        if p.grad is not None:
                            p.grad.mul_(coef)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            step_schedule(self.schedule)
            self.acts.clear()
            self.last_spans, self.spans = self.spans, []
            self.step += 1

    def snapshot(self) -> TrainingSnapshot:
        with self.lock:
            trainable = {n for n, _ in self.trainable}
            return TrainingSnapshot(
                step=self.step,
                version=self.step,
                params={n: p.detach().to("cpu", copy=True) for n, p in self.trainable},
                optimizer=optimizer_state(self.opt, self.trainable),
                buffers={
                    n: t.detach().to("cpu", copy=True)
                    for n, t in {**{n: p for n, p in self.params.items() if n not in trainable}, **self.buffers}.items()
                },
            )

    def tensors(self) -> dict[str, torch.Tensor]:
        with self.lock:
            out = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
            out.update({n: t.detach().to("cpu", copy=True) for n, t in self.buffers.items()})
            return out
