"""One all-reduce trainer's model, optimizer and data (its grain: trainer.py).

:class:`TrainerCore` runs a step of mode ``allreduce``: forward/backward on
this rank's slice of the global batch (the job's own step, at its
precision), one collective averaging the flattened gradients, one averaging
the floating buffers (BatchNorm statistics) when the model has any, then
clipping and the job's optimizer and schedule, exactly as one process would
on the global batch. Its methods run on the silo's executor; a lock makes a
step, a load and a snapshot exclusive.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from grains.training.api.job import TrainingJob
from grains.training.data.batches import job_batches
from grains.training.data.position import Segment
from grains.training.loop.optim import (
    advance,
    build_optimizer,
    build_schedule,
    step_schedule,
    sync_rates,
    trainable,
)
from grains.training.loop.step_runner import StepRunner
from grains.training.models import build_model
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.state.model_tensors import frozen_parameters, persistent_buffers
from grains.training.state.optimizer_state import load_optimizer_state, optimizer_state


class Collective(Protocol):
    """The group a step averages over (:class:`grains.training.strategies.allreduce.trainer.Group`)."""

    def allreduce_mean(self, flat: torch.Tensor, abandon: threading.Event, raw: bool = False) -> torch.Tensor: ...


@dataclass(slots=True)
class StepResult:
    loss: float
    metrics: dict[str, float]
    samples: int
    skipped: bool = False
    exchange_s: float = 0.0
    """Time in the step's collectives."""


class TrainerCore:
    """The model, optimizer and data of one trainer; every method runs on the executor.

    ``held`` is ``(run, step)``: the state is that after ``step`` committed steps of
    ``run``. A lock makes a step, a load and a snapshot exclusive.
    """

    def __init__(self, spec: TrainingJob, device: str, total_steps: int | None = None) -> None:
        self.spec = spec
        self.device = device
        self.total_steps = total_steps
        """The job's length the schedule runs over (None: not known)."""
        self.model = build_model(spec).to(device)
        self.model.train()
        named = trainable(self.model)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.frozen = dict(frozen_parameters(self.model))
        self.buffers = dict(persistent_buffers(self.model))
        self.float_buffers = [b for b in self.buffers.values() if b.is_floating_point()]
        self.opt = build_optimizer(named, spec)
        self.schedule = build_schedule(self.opt, spec, total_steps)
        self.runner = StepRunner(spec, device, self.params)
        self.batches = job_batches(spec, "train", device)
        self.segments: list[Segment] = []
        """The data position of the current group (its assignment's ``data_segments``)."""
        self.flat = torch.zeros(sum(p.numel() for p in self.params), device=device)
        self.held = (-1, -1)
        self._lock = threading.Lock()

    def fresh(self, run: int) -> None:
        """Start from the seeded weights: the constructor's; only valid before any step."""
        self.held = (run, 0)

    def load(self, snap: TrainingSnapshot, run: int) -> None:
        with self._lock, torch.no_grad():
            for n, p in zip(self.names, self.params, strict=True):
                p.copy_(snap.params[n])
            for n, t in {**self.frozen, **self.buffers}.items():
                t.copy_(snap.buffers[n])
            # A fresh schedule stepped to the restored step, then the saved groups (their rates agree).
            self.schedule = build_schedule(self.opt, self.spec, self.total_steps)
            advance(self.schedule, snap.step)
            load_optimizer_state(self.opt, list(zip(self.names, self.params, strict=True)), snap.optimizer)
            sync_rates(self.opt, self.schedule)
            # Every rank and every joiner takes the same scale: a mean of gradients scaled by
            # different factors is no gradient at all.
            self.runner.load_state_dict(snap.scaler)
            self.held = (run, snap.step)

    def follow(self, total_steps: int | None) -> None:
        """The job's length changed (an ``epochs`` or elastic job re-formed with another trainer
        count): the schedule is rebuilt over it, at the step held."""
        with self._lock:
            if total_steps == self.total_steps:
                return
            self.total_steps = total_steps
            self.schedule = build_schedule(self.opt, self.spec, total_steps)
            advance(self.schedule, max(0, self.held[1]))
            sync_rates(self.opt, self.schedule)

    def snapshot(self) -> TrainingSnapshot:
        """Parameters, buffers and optimizer state of the held step, in the checkpoint format."""
        with self._lock:
            return TrainingSnapshot(
                step=self.held[1],
                version=self.held[1],
                params={n: p.detach().to("cpu", copy=True) for n, p in zip(self.names, self.params, strict=True)},
                optimizer=optimizer_state(self.opt, list(zip(self.names, self.params, strict=True))),
                buffers={n: t.detach().to("cpu", copy=True) for n, t in {**self.frozen, **self.buffers}.items()},
                scaler=self.runner.state_dict(),
            )

    def step(self, step: int, rank: int, trainers: int, group: Collective, abandon: threading.Event) -> StepResult:
        """Forward/backward on this rank's slice of global step ``step``, average, apply.

        A rank whose loss is non-finite (``on_nonfinite = "skip"``) sends NaN gradients, so
        the mean is non-finite on every rank and all of them skip the update alike.
        """
        with self._lock:
            if self.held[1] != step:
                raise RuntimeError(f"trainer holds step {self.held[1]}, asked to run step {step}")
            batch = self.batches.batch(self.spec.trainer_batch, trainers, rank, step, self.spec.seed, self.segments)
            epoch = 0
            if self.runner.program.context:  # only a step that takes a context is told its epoch
                epoch = self.batches.schedule(self.spec.trainer_batch, trainers, self.segments).position(step)[0]
            b = self.runner.backward(self.model, batch, step, rank=rank, trainers=trainers, epoch=epoch)
            if b.skip:  # non-finite loss, on_nonfinite = "skip": the mean is non-finite everywhere
                self.flat.fill_(math.nan)
            else:
                torch.cat([g.reshape(-1) for g in self.runner.grads()], out=self.flat)
            t0 = time.perf_counter()
            mean = group.allreduce_mean(self.flat, abandon)
            if self.float_buffers:  # BatchNorm statistics: the mean over the group, as in sync PS mode
                bufs = torch.cat([buf.detach().reshape(-1).float() for buf in self.float_buffers])
                bufs = group.allreduce_mean(bufs, abandon, raw=True)
                offset = 0
                with torch.no_grad():
                    for buf in self.float_buffers:
                        buf.copy_(bufs[offset : offset + buf.numel()].view_as(buf))
                        offset += buf.numel()
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = mean[offset : offset + n].view_as(p).to(p.device, p.dtype)
                offset += n
            exchange_s = time.perf_counter() - t0
            skipped = self._apply(mean)
            self.held = (self.held[0], step + 1)
            return StepResult(b.loss, b.metrics, b.samples, skipped, exchange_s)

    def _apply(self, mean: torch.Tensor) -> bool:
        """The optimizer step on the group's mean gradient (unscaled, clipped); True when skipped.

        Every rank holds the same mean and the same scale, so every rank decides alike."""
        skipped = False
        if self.opt is not None:
            if self.runner.scaler is not None:
                skipped = self.runner.unscale([p.grad for p in self.params if p.grad is not None])
            elif self.spec.on_nonfinite == "skip" and not bool(torch.isfinite(mean).all()):
                skipped = True
            if not skipped:
                self.runner.clip(self.params)
                self.opt.step()
        step_schedule(self.schedule)
        return skipped
