"""A training job's evaluations, from due to recorded: the evaluation lifecycle of its coordinator.

Mid-run evaluation reads a committed checkpoint: weights of one step (every holder's part of
the same step), labelled with it, every ``eval_every`` steps exactly (``checkpoint_due`` makes
each multiple of ``eval_every`` a checkpoint). It runs beside the coordinator's ticks, so
training and the job's status go on; reading weights live from the grains while they train
tore them across steps and labelled them with the slowest trainer's step.

One evaluation runs at a time, where the job trains when a trainer can (its silo and device),
else on the coordinator's silo. A finished one is recorded in the job's state and history,
may become the best checkpoint (``keep_best``), and is shown to the job's callbacks, whose
``on_eval`` may stop the job at that step. When the job completes, the evaluations still due
are caught up, then the final weights are evaluated; the final checkpoint may become the best
too (callbacks hear of the end through ``on_end``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from grains.base import Grain
from grains.training import history
from grains.training.api.callbacks import Callbacks
from grains.training.api.job_state import JobState
from grains.training.api.messages import Evaluation, HistoryPoint
from grains.training.evaluation import Evaluator
from grains.training.job_checkpoints import JobCheckpoints
from grains.training.strategies.driver import Driver
from silo import errors

log = logging.getLogger("redgrain.training.coordinator")

EVALUATION_TIMEOUT_S = 600.0
"""The least a trainer is given to evaluate a checkpoint (read it, then the whole test split)."""


class JobEvaluations:
    """The evaluations of one coordinator's job.

    ``state`` reads the job's state as it is now; ``driver`` gives the running job's driver
    (which trainer evaluates); ``callbacks`` the job's callbacks; ``recorded`` is told of each
    history point an evaluation adds (the coordinator publishes and logs it).
    """

    def __init__(
        self,
        grain: Grain,
        state: Callable[[], JobState],
        checkpoints: JobCheckpoints,
        driver: Callable[[], Driver],
        callbacks: Callable[[], Awaitable[Callbacks]],
        recorded: Callable[[HistoryPoint], None],
    ) -> None:
        self._grain = grain
        self._state = state
        self._checkpoints = checkpoints
        self._driver = driver
        self._callbacks = callbacks
        self._recorded = recorded
        self._evaluator: Evaluator | None = None
        self._task: asyncio.Task[Evaluation | None] | None = None
        self.evaluating: int | None = None
        """The step of the evaluation in progress (its checkpoint is not pruned)."""
        self.last_step = 0
        """The newest step whose evaluation was started (or was evaluated by an earlier run)."""

    async def evaluator(self) -> Evaluator:
        """The job's model and test split, built on first use."""
        spec = self._state().spec
        assert spec is not None
        if self._evaluator is None:
            self._evaluator = await self._grain.run_in_thread(Evaluator, spec, self._grain.device)
        return self._evaluator

    def new_job(self) -> None:
        """A new start: its own model and test split (the last job's may differ), nothing running."""
        self.stop()
        self._evaluator = None
        s = self._state()
        # A resumed job's earlier checkpoints were evaluated by the run that made them.
        self.last_step = s.committed[-1] if s.committed else 0

    def committed(self, step: int) -> None:
        """Checkpoint ``step`` was committed: due for evaluation when it is an ``eval_every`` step."""
        s = self._state()
        spec = s.spec
        if spec is not None and spec.eval_every and step % spec.eval_every == 0 and step > self.last_step:
            s.eval_pending = sorted({*s.eval_pending, step})

    def start_due(self) -> None:
        """Start the oldest due evaluation, unless one runs (the final step is evaluated at the end)."""
        s = self._state()
        spec = s.spec
        if spec is None or not spec.eval_every or (self._task is not None and not self._task.done()):
            return
        due = [c for c in s.eval_pending if c != s.total_steps]
        s.eval_pending = due
        if not due:
            return
        step = min(due)
        s.eval_pending = [c for c in due if c != step]
        self.last_step = self.evaluating = step
        self._task = self._grain.start_task(self._evaluate_checkpoint(step), name=f"{self._grain.key} evaluation {step}")

    def take(self) -> tuple[int, dict[str, float]] | None:
        """A finished evaluation into the job's state and history: its step and metrics."""
        task = self._task
        if task is None or not task.done():
            return None
        self._task = None
        self.evaluating = None
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                log.warning("%s: evaluation failed: %s", self._grain.key, task.exception())
            return None
        done: Evaluation | None = task.result()
        if done is None:
            return None
        self._record(done)
        return done.step, done.metrics

    async def after(self, step: int, metrics: dict[str, float]) -> str | None:
        """Keep the best checkpoint (``keep_best``) and tell the callbacks; the path of a callback
        that asked to stop the job at ``step`` (None: go on)."""
        await self._keep_if_best(step, metrics)
        callbacks = await self._callbacks()
        stop = await self._grain.run_in_thread(callbacks.on_eval, step, metrics) if callbacks else None
        if stop is None:
            with contextlib.suppress(errors.RedgrainError):
                await self._checkpoints.prune(self.evaluating)  # the evaluated checkpoint may go now
        return stop

    async def catch_up(self) -> tuple[int, str] | None:
        """The job completed: the evaluations still due (the last steps ran faster than they did);
        the step and callback of a request to stop earlier (None: none)."""
        while True:
            task = self._task
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
                done = self.take()
                if done is not None:
                    stop = await self.after(*done)
                    if stop is not None:
                        return done[0], stop
            self.start_due()
            if self._task is None:
                return None

    async def final(self) -> dict[str, float]:
        """Evaluate the final weights on the test split; the result goes into the job's state.
        The final checkpoint where it is committed (where the job trains, as mid-run ones), else
        the weights the grains hold (a cancelled or failed job's)."""
        s = self._state()
        self.stop()
        last = s.total_steps or s.step
        done = await self._evaluate_checkpoint(last) if last in s.committed else None
        if done is None:
            evaluator = await self.evaluator()
            tensors = await self._checkpoints.current()
            metrics = await self._grain.run_in_thread(evaluator.evaluate, tensors)
            done = Evaluation(step=last, metrics=metrics, silo=str(self._grain.silo), device=self._grain.device)
        self._record(done)
        if last in s.committed:
            # The final checkpoint competes for the best too (as the last evaluation does in HF's
            # Trainer): a job whose last evaluation is its best keeps that one.
            await self._keep_if_best(last, done.metrics)
        return s.eval_metrics

    async def _keep_if_best(self, step: int, metrics: dict[str, float]) -> None:
        """Checkpoint ``step`` becomes the best (``keep_best``) when its metric beats the best's."""
        s = self._state()
        spec = s.spec
        assert spec is not None
        best = spec.best_metric
        if best is not None and best[0] in metrics:
            name, larger = best
            value = metrics[name]
            if s.best_value is None or (value > s.best_value if larger else value < s.best_value):
                await self._checkpoints.keep_best(step, value)

    def stop(self) -> None:
        """Cancel the evaluation in progress (the job ended or was cut short)."""
        task, self._task = self._task, None
        self.evaluating = None
        if task is not None and not task.done():
            task.cancel()

    def _record(self, done: Evaluation) -> None:
        """An evaluation into the job's status and its history (at the evaluated step)."""
        s = self._state()
        s.eval_metrics, s.eval_step, s.accuracy = done.metrics, done.step, done.metrics.get("accuracy")
        s.eval_silo, s.eval_device = done.silo, done.device
        point = HistoryPoint(step=done.step, eval_metrics=dict(done.metrics), at=time.time())
        history.add_evaluation(s.history, point)
        self._recorded(point)

    async def _evaluate_checkpoint(self, step: int) -> Evaluation | None:
        """Checkpoint ``step`` evaluated where the job trains (a trainer's silo and device), else
        here (:mod:`grains.training.evaluation`); None: the checkpoint is gone."""
        s = self._state()
        assert s.spec is not None
        key = self._grain.key
        trainer = self._driver().evaluator(max(EVALUATION_TIMEOUT_S, s.spec.step_timeout_s))
        if trainer is not None:
            try:
                done: Evaluation = await trainer.evaluate(key, s.spec, s.run, step)
                return done
            except errors.RedgrainError as exc:  # lost, released, or the checkpoint went: try here
                log.info("%s: checkpoint %d not evaluated by a trainer (%s); evaluating here", key, step, exc)
        evaluator = await self.evaluator()
        try:
            tensors = await self._checkpoints.read(step)
        except errors.RedgrainError as exc:  # retention dropped it first (checkpoints much faster than evaluations)
            log.warning("%s: checkpoint %d not evaluated: %s", key, step, exc)
            return None
        metrics = await self._grain.run_in_thread(evaluator.evaluate, tensors)
        return Evaluation(step=step, metrics=metrics, silo=str(self._grain.silo), device=self._grain.device)
