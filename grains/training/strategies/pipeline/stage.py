"""PipelineStageGrain: one stage of a pipeline-parallel job (mode ``pipeline``).

A job's model (an ``nn.Sequential``, or any module at its ``split_points``)
is cut into stages (:mod:`grains.training.strategies.pipeline.partition`), each a grain on its
own silo that builds and holds only its layers' parameters, gradients and
optimizer state. Stage 0 runs the
steps: per step it cuts the batch into ``microbatches`` micro-batches and
sends each one's activations forward; every stage computes its forward on
the silo's executor and passes the output on (``forward``), the last stage
computes the loss and the backward and sends the input's gradient back
(``backward``), down to stage 0. Activations and gradients travel as tensors
on the grain-call wire (zero-copy frames between silos).

Each stage runs a step as one *runner* task that walks the stage's action
list (:mod:`grains.training.strategies.pipeline.schedules`: ``gpipe`` or ``1f1b``) in order: an
``F`` waits until its micro-batch's input is in (stage 0: its own chunk),
computes and sends the output on; a ``B`` waits until its output's gradient
is in (the last stage: computes the loss), computes and sends the input's
gradient back. ``forward`` and ``backward`` calls only deposit their tensor
in the (step, micro-batch) slot and return, so the order a stage computes in
is its schedule's, whatever order the tensors arrive in, and the recorded
timeline is that list. Every task a stage starts for a generation (runners,
sends) is cancelled when it is configured again, stopped or released, and a
deposit of another generation or step is refused: a late backward never
takes a newer step's activation.

A non-finite loss on the last stage goes through the job's ``on_nonfinite``
(:func:`~grains.training.loop.program.nonfinite`): ``fail`` raises a fatal
NonFiniteLossError naming the step (the job fails, no rollback); ``skip``
tells stage 0 (awaited, before the micro-batch's gradient goes back), the
backwards still run, and stage 0 asks every stage to apply the step with
``skip``: no update anywhere, the gradients dropped, the schedule and the
step counter advanced (hybrid: a step any trainer skips, every trainer skips).

When stage 0 has every micro-batch's backward, every later stage has too (a
gradient reaches stage 0 through all of them); it then asks each stage to
``apply`` the step (with ``clip_grad_norm``: the squared norms of all stages
first, one coefficient for all), which also takes the consistent checkpoint
at checkpoint steps. A stage whose call or task fails stops stage 0's step
(``fail``); the coordinator rolls every stage back to the last committed
checkpoint, as for a lost parameter shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from grains.base import DeactivationReason, Grain
from grains.placement import hash_placement, immovable, keep_alive, reentrant
from grains.training.api.messages import StageConfig, StageStatus, StaleGenerationError, StepPoint
from grains.training.api.records import MicroBatchSpan
from grains.training.data.batches import Batches, job_batches
from grains.training.loop.program import is_fatal
from grains.training.state import checkpoint
from grains.training.state.checkpoint import SnapshotState, TrainingSnapshot
from grains.training.strategies.pipeline.partition import stage_module, tensor_names
from grains.training.strategies.pipeline.schedules import actions
from grains.training.strategies.pipeline.stage_core import StageCore

log = logging.getLogger("redgrain.training.stage")

_POINTS = 2000
_SKIP = "#skip"
"""Hybrid: the entry of a stage's reduced part that says a trainer skips the step."""


@keep_alive
@immovable
@reentrant
@hash_placement
class PipelineStageGrain(Grain):
    """Key: ``job/stage-i``."""

    State = SnapshotState

    def __init__(self) -> None:
        self._cfg: StageConfig | None = None
        self._core: StageCore | None = None
        self._batches: Batches | None = None
        self._generation = -1
        self._status = "idle"
        self._error = ""
        self._fatal = False
        self._saved: list[int] = []
        self._loss = 0.0
        self._losses: list[float] = []
        self._metrics: list[dict[str, float]] = []  # last stage: the loss function's, per micro-batch
        self._points: deque[StepPoint] = deque(maxlen=_POINTS)
        self._tasks: set[asyncio.Task[Any]] = set()  # this generation's: runners, sends, stage 0's loop
        self._runners: dict[int, asyncio.Task[None]] = {}  # step -> its runner
        self._slots: dict[tuple[str, int, int], asyncio.Future[Any]] = {}  # (F/B, step, mb) -> tensor in
        self._skipping: set[int] = set()  # stage 0: steps the last stage found a non-finite loss in
        self._skipped = 0
        self._failed: asyncio.Event = asyncio.Event()
        self._steps_done = 0
        self._rate = 0.0
        self._labels: tuple[int, tuple[torch.Tensor, ...]] | None = None
        self._parts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # hybrid leader: step -> rank -> part
        self._means: dict[int, tuple[dict[str, torch.Tensor], int]] = {}  # step -> (mean, fetches left)
        self._reduced = asyncio.Condition()

    async def on_deactivate(self, reason: DeactivationReason) -> None:
        await self._stop_tasks()

    # --- the coordinator's API ---------------------------------------------
    async def configure(self, cfg: StageConfig) -> StageStatus:
        """Start (or restart) this stage for a generation; stage 0 starts running the steps."""
        await self._stop_tasks()
        self._generation = cfg.generation
        core = self._core
        if cfg.keep:
            if core is None or self._cfg is None or self._cfg.layers != cfg.layers or core.step != cfg.start_step:
                held = None if core is None else core.step
                raise StaleGenerationError(f"{self.key} cannot go on from step {cfg.start_step}: it holds {held}")
            await self.run_in_thread(core.discard_step)
        else:
            self._core = None  # the old generation's tensors go before the new ones are made
            restoring = cfg.restore_step is not None
            module = await self.run_in_thread(stage_module, cfg.spec, cfg.index, cfg.layers, self.device, restoring)
            snapshot = await self._restore(cfg, module) if restoring else None
            self._core = await self.run_in_thread(StageCore, cfg, self.device, snapshot, module)
        self._cfg = cfg
        first, last = cfg.index == 0, cfg.index == len(cfg.stage_keys) - 1
        self._batches = await self.run_in_thread(job_batches, cfg.spec, "train", self.device) if first or last else None
        self._status, self._error, self._fatal = "running", "", False
        if not cfg.keep:
            self._saved = [cfg.restore_step] if cfg.restore_step is not None else []
        self._points.clear()
        self._losses, self._metrics = [], []
        self._labels = None
        self._steps_done = self._skipped = 0
        self._skipping = set()
        self._failed = asyncio.Event()
        self._parts, self._means = {}, {}
        async with self._reduced:
            self._reduced.notify_all()  # contributions of an older generation give up
        self._begin(cfg.start_step)
        if first:
            self._spawn(self._run(cfg), f"steps g{cfg.generation}")
        return await self.status()

    async def stop(self) -> None:
        self._generation += 1  # messages of the stopped generation are refused from now on
        await self._stop_tasks()
        if self._status == "running":
            self._status = "idle"

    async def release(self) -> None:
        """The job is over: free the stage's tensors and deactivate."""
        await self.stop()
        self._core = None
        self.deactivate_on_idle()

    async def status(self, since_step: int = 1 << 62) -> StageStatus:
        core = self._core
        return StageStatus(
            activation_id=self.activation_id, generation=self._generation, silo=str(self.silo), status=self._status,  # type: ignore[arg-type]
            step=core.step if core else 0, loss=self._loss, saved_steps=list(self._saved), error=self._error,
            fatal=self._fatal, forward_ms=1000 * core.forward_s / max(1, core.forwards) if core else 0.0,
            backward_ms=1000 * core.backward_s / max(1, core.backwards) if core else 0.0,
            points=[p for p in self._points if p.step >= since_step], samples_per_s=self._rate,
            timeline=[MicroBatchSpan(mb=m, kind=k, start=a, end=b) for m, k, a, b in (core.last_spans if core else [])],
            param_bytes=sum(p.numel() * p.element_size() for p in core.params.values()) if core else 0,
            steps_done=self._steps_done, skipped=self._skipped,
        )  # fmt: skip

    async def tensors(self) -> dict[str, torch.Tensor]:
        core = self._core
        return {} if core is None else await self.run_in_thread(core.tensors)

    # --- between stages -------------------------------------------------------
    async def forward(self, generation: int, step: int, mb: int, x: torch.Tensor) -> None:
        """Micro-batch ``mb``'s input from the previous stage, for the step's runner."""
        self._deposit(generation, "F", step, mb, x)

    async def backward(self, generation: int, step: int, mb: int, grad: torch.Tensor | None) -> None:
        """The gradient of micro-batch ``mb``'s output from the next stage, for the step's runner."""
        self._deposit(generation, "B", step, mb, grad)

    async def skip_step(self, generation: int, step: int) -> None:
        """Stage 0: the last stage found a non-finite loss in ``step`` (``on_nonfinite = "skip"``)."""
        self._check(generation)
        self._skipping.add(step)

    async def reduce(self, generation: int, step: int, skip: bool = False) -> bool:
        """Hybrid: average this stage's gradients and buffers of ``step`` over the trainers; whether
        any trainer skips the step (each trainer's stage 0 says ``skip`` for its own)."""
        self._check(generation)
        cfg, core = self._cfg, self._core
        assert cfg is not None and core is not None
        trainers = len(cfg.peer_keys)
        if trainers <= 1:
            return skip
        part = await self.run_in_thread(core.local_part)
        part[_SKIP] = torch.tensor(float(skip))
        if cfg.rank == 0:
            mean = await self._collect(generation, step, 0, part, trainers)
        else:
            leader = self.get_grain(PipelineStageGrain, cfg.peer_keys[0])
            mean = await leader.with_timeout(cfg.spec.step_timeout_s).contribute(generation, step, cfg.rank, part)
        await self.run_in_thread(core.take_mean, mean)
        return bool(mean[_SKIP] > 0)

    async def contribute(self, generation: int, step: int, rank: int, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hybrid, rank 0's stage: another trainer's part of ``step``; returns the trainers' mean."""
        self._check(generation)
        cfg = self._cfg
        assert cfg is not None
        return await self._collect(generation, step, rank, part, len(cfg.peer_keys))

    async def _collect(
        self, generation: int, step: int, rank: int, part: dict[str, torch.Tensor], trainers: int
    ) -> dict[str, torch.Tensor]:
        async with self._reduced:
            self._parts.setdefault(step, {})[rank] = part
            if len(self._parts[step]) == trainers:
                parts = self._parts.pop(step)
                mean = await self.run_in_thread(StageCore.mean_of, [parts[r] for r in sorted(parts)])
                self._means[step] = (mean, trainers)
                self._reduced.notify_all()
            while step not in self._means:
                self._check(generation)
                await self._reduced.wait()
            mean, left = self._means[step]
            if left <= 1:
                del self._means[step]
            else:
                self._means[step] = (mean, left - 1)
            return mean

    async def norm_sq(self, generation: int) -> float:
        self._check(generation)
        core = self._core
        assert core is not None
        return await self.run_in_thread(core.norm_sq)

    async def apply(self, generation: int, step: int, coef: float, skip: bool = False) -> StepPoint:
        """Apply step ``step`` here (``skip``: drop its gradients instead) and start the next step's
        runner; the last stage returns the step's loss and the loss function's metrics (means over
        the micro-batches)."""
        self._check(generation)
        core, cfg = self._core, self._cfg
        assert core is not None and cfg is not None
        if core.step != step:
            raise StaleGenerationError(f"{self.key} is at step {core.step}, asked to apply step {step}")
        runner = self._runners.pop(step, None)
        if runner is not None:  # done: its last backward is in on stage 0
            await asyncio.wait_for(asyncio.shield(runner), cfg.spec.step_timeout_s)
        await self.run_in_thread(core.apply, coef, skip)
        self._skipped += skip
        self._check(generation)
        self._begin(core.step)
        loss = sum(self._losses) / len(self._losses) if self._losses else 0.0
        metrics = {k: sum(m[k] for m in self._metrics) / len(self._metrics) for k in self._metrics[0]} if self._metrics else {}
        self._losses, self._metrics = [], []
        if cfg.rank == 0 and checkpoint.checkpoint_due(cfg.spec, core.step, cfg.end_step):
            snap = await self.run_in_thread(core.snapshot)
            self.start_task(self._save(cfg, snap, generation), name=f"{self.key} checkpoint {snap.step}")
        return StepPoint(step=step, loss=loss, metrics=metrics, at=time.time())

    async def fail(self, generation: int, error: str, fatal: bool) -> None:
        """A stage could not do its part of the current step (stage 0 stops the run)."""
        if generation == self._generation and not self._failed.is_set():
            self._error, self._fatal = error[:2000], fatal
            self._failed.set()

    # --- internals -------------------------------------------------------------
    def _check(self, generation: int) -> None:
        if generation != self._generation or self._core is None:
            raise StaleGenerationError(f"{self.key} is at generation {self._generation}, the call is of {generation}")

    def _peer(self, index: int) -> Any:
        cfg = self._cfg
        assert cfg is not None
        ref = self.get_grain(PipelineStageGrain, cfg.stage_keys[index])
        return ref.with_timeout(cfg.spec.step_timeout_s)

    def _spawn(self, work: Any, name: str) -> asyncio.Task[Any]:
        """A task of this generation: cancelled when the stage is configured again, stopped or released."""
        task = self.start_task(work, name=f"{self.key} {name}")
        self._tasks.add(task)
        task.add_done_callback(_forget(self._tasks))
        return task

    def _begin(self, step: int) -> None:
        """Start the runner of ``step`` (stage 0's errors reach its loop; the others' go to stage 0)."""
        cfg = self._cfg
        assert cfg is not None
        if step >= cfg.end_step or step in self._runners:
            return
        gen = cfg.generation
        work = self._walk(gen, step) if cfg.index == 0 else self._guard(gen, lambda: self._walk(gen, step))
        self._runners[step] = self._spawn(work, f"step {step}")

    def _slot(self, kind: str, step: int, mb: int) -> asyncio.Future[Any]:
        return self._slots.setdefault((kind, step, mb), asyncio.get_running_loop().create_future())

    def _deposit(self, generation: int, kind: str, step: int, mb: int, t: torch.Tensor | None) -> None:
        """Micro-batch ``mb``'s input (F) or output gradient (B) of ``step`` into its slot; refused
        (StaleGenerationError) unless it is of this generation and of the step this stage runs."""
        self._check(generation)
        core, cfg = self._core, self._cfg
        assert core is not None and cfg is not None
        if step != core.step or not 0 <= mb < cfg.spec.microbatches:
            raise StaleGenerationError(f"{self.key} runs step {core.step}, not {kind}{mb} of step {step}")
        slot = self._slot(kind, step, mb)
        if not slot.done():  # a second copy of a tensor already in is ignored
            slot.set_result(t)

    async def _take(self, kind: str, step: int, mb: int) -> Any:
        cfg = self._cfg
        assert cfg is not None
        try:
            return await asyncio.wait_for(self._slot(kind, step, mb), cfg.spec.step_timeout_s)
        except TimeoutError:
            what = "input" if kind == "F" else "output gradient"
            raise RuntimeError(f"no {what} of micro-batch {mb} of step {step} within step_timeout_s={cfg.spec.step_timeout_s}") from None
        finally:
            self._slots.pop((kind, step, mb), None)

    async def _guard(self, generation: int, work: Callable[[], Awaitable[Any]]) -> None:
        # ``work`` makes its coroutine here: a task cancelled before it starts leaves none unawaited.
        try:
            await work()
        except StaleGenerationError:
            pass
        except Exception as exc:  # noqa: BLE001 - reported to stage 0, which stops the step
            if generation != self._generation:
                return
            log.info("%s: generation %d: %s", self.key, generation, exc)
            cfg = self._cfg
            why = f"{self.key}: {type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                if cfg is not None and cfg.index == 0:
                    await self.fail(generation, why, is_fatal(exc))
                else:
                    await self._peer(0).fail(generation, why, is_fatal(exc))

    async def _walk(self, generation: int, step: int) -> None:
        """The runner of ``step``: this stage's actions in its schedule's order."""
        core, cfg = self._core, self._cfg
        assert core is not None and cfg is not None
        i, m = cfg.index, cfg.spec.microbatches
        for a in actions(cfg.spec.schedule, len(cfg.stage_keys), i, m):
            if a.kind == "F":
                x = await self._take("F", step, a.mb)
                y = await self.run_in_thread(core.forward, a.mb, x)
                if not core.last:
                    self._send(i + 1, "forward", step, a.mb, y)
                continue
            if core.last:
                grad = await self._loss_backward(generation, step, a.mb)
            else:
                out = await self._take("B", step, a.mb)
                grad = await self.run_in_thread(core.backward, a.mb, out)
            if i > 0:
                self._send(i - 1, "backward", step, a.mb, grad)

    async def _loss_backward(self, generation: int, step: int, mb: int) -> torch.Tensor | None:
        """Last stage: the loss of micro-batch ``mb`` and its backward; the input's gradient."""
        core, cfg, batches = self._core, self._cfg, self._batches
        assert core is not None and cfg is not None and batches is not None
        if self._labels is None or self._labels[0] != step:  # once per step, not per micro-batch
            trainers = max(1, len(cfg.peer_keys))
            _, labels = await self.run_in_thread(
                batches.batch, cfg.spec.batch_size, trainers, cfg.rank, step, cfg.spec.seed, cfg.data_segments
            )
            self._labels = (step, tuple(labels.chunk(cfg.spec.microbatches)))
        target = self._labels[1][mb]
        loss, metrics, grad = await self.run_in_thread(core.loss_backward, mb, target)
        if core.runner.nonfinite(loss, step):  # "fail" raised: fatal, the job fails
            # Stage 0 knows before this micro-batch's gradient goes back, so before it applies.
            await (self.skip_step(generation, step) if cfg.index == 0 else self._peer(0).skip_step(generation, step))
        self._losses.append(loss)
        self._metrics.append(metrics)
        return grad

    def _send(self, index: int, method: str, step: int, mb: int, t: torch.Tensor | None) -> None:
        """Micro-batch ``mb``'s tensor to stage ``index`` (its ``forward`` or ``backward``), in a task."""
        cfg = self._cfg
        assert cfg is not None
        gen = cfg.generation
        self._spawn(self._guard(gen, lambda: getattr(self._peer(index), method)(gen, step, mb, t)), f"{method} {step}.{mb}")

    async def _run(self, cfg: StageConfig) -> None:
        """Stage 0: every step of this generation, micro-batch by micro-batch."""
        try:
            await self._steps(cfg)
            self._status = "done"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which rolls back
            log.info("%s: generation %d stopped: %s", self.key, cfg.generation, exc)
            self._status, self._error = "failed", self._error or f"{type(exc).__name__}: {exc}"[:2000]
            self._fatal = self._fatal or is_fatal(exc)

    async def _steps(self, cfg: StageConfig) -> None:
        core, batches = self._core, self._batches
        assert core is not None and batches is not None
        spec, gen, m = cfg.spec, cfg.generation, cfg.spec.microbatches
        stages = len(cfg.stage_keys)
        trainers = max(1, len(cfg.peer_keys))
        others = [self._peer(i) for i in range(1, stages)]
        t_first: float | None = None
        def gather(step: int) -> asyncio.Future[Any]:
            return asyncio.ensure_future(
                self.run_in_thread(batches.batch, spec.batch_size, trainers, cfg.rank, step, spec.seed, cfg.data_segments)
            )

        upcoming = gather(core.step) if core.step < cfg.end_step else None
        for step in range(core.step, cfg.end_step):
            assert upcoming is not None
            x, _ = await upcoming
            for mb, chunk in enumerate(x.chunk(m)):  # the F actions of this stage's runner take these
                self._deposit(gen, "F", step, mb, chunk.contiguous())
            # The next step's batch is gathered while this one runs.
            upcoming = gather(step + 1) if step + 1 < cfg.end_step else None
            # Its runner done, every micro-batch's backward is done on every stage.
            await self._wait(asyncio.shield(self._runners[step]), None, "the step")
            skip = step in self._skipping
            self._skipping.discard(step)
            if trainers > 1:  # hybrid: each stage's gradients averaged over the trainers first
                reduced = await asyncio.gather(self.reduce(gen, step, skip), *(p.reduce(gen, step) for p in others))
                skip = reduced[0]  # a step any trainer skips, every trainer skips
            coef = 1.0
            if spec.clip_grad_norm is not None and not skip:
                parts = await asyncio.gather(self.norm_sq(gen), *(p.norm_sq(gen) for p in others))
                coef = core.runner.clip_coefficient(sum(parts))
            applied = await asyncio.gather(self.apply(gen, step, coef, skip), *(p.apply(gen, step, coef, skip) for p in others))
            self._loss = float(applied[-1].loss)
            now = time.monotonic()
            t_first = t_first or now
            self._steps_done += 1
            if self._steps_done > 1:
                self._rate = (self._steps_done - 1) * spec.batch_size / max(1e-9, now - t_first)  # this trainer
            self._points.append(StepPoint(step=step, loss=self._loss, metrics=applied[-1].metrics, at=time.time()))

    async def _wait(self, what: Any, timeout_s: float | None, name: str) -> Any:
        """``what``'s result, or RuntimeError once a stage reports a failure (or after ``timeout_s``)."""
        waiter = asyncio.ensure_future(what)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            done, _ = await asyncio.wait({waiter, failed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if waiter not in done:
            waiter.cancel()
            raise RuntimeError(self._error if self._failed.is_set() else f"no {name} within step_timeout_s={timeout_s}")
        return waiter.result()

    async def _restore(self, cfg: StageConfig, module: torch.nn.Module) -> TrainingSnapshot:
        assert cfg.restore_step is not None
        names, extra = tensor_names(module)  # in the stage's order: its optimizer state's
        return await checkpoint.load(self, cfg.job, cfg.run, cfg.restore_step, names, extra)

    async def _save(self, cfg: StageConfig, snap: TrainingSnapshot, generation: int) -> None:
        try:
            await checkpoint.save(
                self, cfg.job, cfg.run, snap, cfg.checkpoint_keys or cfg.stage_keys, checkpoint.retained(cfg.spec), generation
            )
        except Exception:
            log.exception("%s: saving checkpoint %d failed", self.key, snap.step)
            return
        if generation == self._generation:
            self._saved = [*self._saved, snap.step][-10:]

    async def _stop_tasks(self) -> None:
        """Cancel every task of the generation (stage 0's loop, runners, sends) and drop its slots."""
        tasks, self._tasks = self._tasks, set()
        self._runners = {}
        for slot in self._slots.values():
            slot.cancel()
        self._slots = {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _forget(tasks: set[asyncio.Task[Any]]) -> Any:
    """A done callback: the task leaves ``tasks`` and its exception counts as retrieved."""

    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()

    return done
