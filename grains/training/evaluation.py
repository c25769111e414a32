"""The job's whole model on one silo: evaluations of committed checkpoints, exports, init weights.

An evaluation of step ``c`` is that of checkpoint ``c`` (every multiple of
``eval_every`` is a checkpoint, :func:`grains.training.state.checkpoint.checkpoint_due`),
so it reads weights of one step, never weights torn between steps, and it is
labelled with that step.

It runs where the job trains: the coordinator asks the rank-0 trainer's grain
(parameter-server or all-reduce mode) to evaluate checkpoint ``c``, and that
grain runs it on its own silo's device (a GPU when its silo has one), at the
job's autocast, on the silo's executor beside its training steps, which go on.
The coordinator's silo may have no GPU: evaluating there ran a GPU job's
evaluation on a CPU, with an autocast meant for the GPU. Pipeline mode has no
grain that holds the whole model, and a trainer that cannot answer (lost, or
released at the job's end) leaves the evaluation to the coordinator, on its
own silo's device: an evaluation is never lost with a silo.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from grains.base import Grain
from grains.training.api.job import TrainingJob
from grains.training.api.messages import Evaluation
from grains.training.data.batches import batch_samples, job_batches, to_device
from grains.training.loop.optim import build_optimizer, trainable
from grains.training.loop.program import Program, evaluate
from grains.training.models import build_model
from grains.training.state import checkpoint
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.state.init_weights import read_init, read_init_optimizer
from grains.training.state.model_tensors import (
    export_state_dict,
    frozen_parameters,
    load_tensors,
    persistent_buffers,
)
from grains.training.state.optimizer_state import optimizer_state
from grains.training.state.store import CheckpointStoreGrain

READ_TIMEOUT_S = 120.0
"""A whole checkpoint read through the job's store grain."""


class Evaluator:
    """The model and test split for evaluations and exports on ``device`` (built once per job,
    used off the loop)."""

    def __init__(self, spec: TrainingJob, device: str = "cpu") -> None:
        self.spec = spec
        self.device = device
        self.model = build_model(spec).to(device)
        self.names = [n for n, _ in trainable(self.model)]
        self.extra = [n for n, _ in frozen_parameters(self.model)] + [n for n, _ in persistent_buffers(self.model)]
        self.program = Program.of(spec, device)
        self.batches = job_batches(spec, "test")
        self.batch_size = spec.eval_batch_size
        self._lock = threading.Lock()  # one model: a background evaluation and an export take turns

    def evaluate(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """The job's evaluation over the whole test split with these weights and buffers."""
        with self._lock:
            load_tensors(self.model, tensors)
            batches = self.batches.eval_batches(self.batch_size)
            if self.device != "cpu":
                batches = (to_device(b, self.device) for b in batches)
            return evaluate(self.program, self.model, batches, batch_samples)

    def state_dict(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with self._lock:
            load_tensors(self.model, tensors)
            return export_state_dict(self.model)

    def init_snapshot(self, path: str, spec: TrainingJob) -> TrainingSnapshot:
        """The weights of ``init_from`` as step 0 of a run; with ``init_optimizer``, the saved
        optimizer's per-parameter state too (otherwise none yet)."""
        with self._lock:
            self.model.load_state_dict(read_init(path, self.model), strict=True)
            optimizer: dict[str, Any] = {}
            if spec.init_optimizer:
                named = trainable(self.model)
                opt = build_optimizer(named, spec)
                if opt is not None:
                    read_init_optimizer(path, self.model, opt)
                    optimizer = optimizer_state(opt, named)
            return checkpoint.initial(self.model, optimizer)


class CheckpointEvaluations:
    """What a grain keeps to evaluate its job's checkpoints on its own silo: the evaluator, built
    on first use (a model and the test split: not free) and dropped with the grain's job."""

    def __init__(self) -> None:
        self._evaluator: Evaluator | None = None

    async def evaluate(self, grain: Grain, spec: TrainingJob, job: str, run: int, step: int) -> Evaluation:
        """Checkpoint ``step`` of ``job``'s ``run``, read through the job's store, evaluated on
        ``grain``'s silo and device."""
        ev = await self._ready(grain, spec)
        store = grain.get_grain(CheckpointStoreGrain, job)
        snap: TrainingSnapshot = await store.with_timeout(READ_TIMEOUT_S).read(run, step, ev.names, ev.extra)
        return await self.evaluate_held(grain, spec, snap)

    async def evaluate_held(self, grain: Grain, spec: TrainingJob, snap: TrainingSnapshot) -> Evaluation:
        """The weights of ``snap`` (a committed step's, which the grain holds itself: no read)
        evaluated on ``grain``'s silo and device."""
        ev = await self._ready(grain, spec)
        metrics = await grain.run_in_thread(ev.evaluate, {**snap.params, **snap.buffers})
        return Evaluation(step=snap.step, metrics=metrics, silo=str(grain.silo), device=grain.device)

    async def _ready(self, grain: Grain, spec: TrainingJob) -> Evaluator:
        ev = self._evaluator
        if ev is None or ev.spec != spec or ev.device != grain.device:
            ev = self._evaluator = await grain.run_in_thread(Evaluator, spec, grain.device)
        return ev

    def clear(self) -> None:
        self._evaluator = None
