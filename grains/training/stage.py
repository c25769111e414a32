"""PipelineStageGrain: one stage of a pipeline-parallel job (mode ``pipeline``).

A job's model (an ``nn.Sequential``, or any module at its ``split_points``)
is cut into stages (:mod:`grains.training.pipeline`), each a grain on its
own silo that builds and holds only its layers' parameters, gradients and
optimizer state. Stage 0 runs the
steps: per step it cuts the batch into ``microbatches`` micro-batches and
sends each one's activations forward; every stage computes its forward on
the silo's executor and passes the output on (``forward``), the last stage
computes the loss and the backward and sends the input's gradient back
(``backward``), down to stage 0. Activations and gradients travel as tensors
on the grain-call wire (zero-copy frames between silos). Calls return at
once: each stage does its part in a background task, so no call waits on the
whole chain.

Schedules: ``gpipe``: stage 0 sends every micro-batch forward and the last
stage starts the backwards once it has all of them (all forwards, then all
backwards); ``1f1b``: the last stage runs each micro-batch's backward right
after its forward and stage 0 keeps at most ``stages`` micro-batches in
flight, so a stage holds at most that many activations. Both accumulate the
same gradients (in another order: equal to float tolerance).

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
import math
import time
from collections import deque
from typing import Any

import torch

from grains.base import DeactivationReason, Grain
from grains.placement import hash_placement, immovable, keep_alive, reentrant
from grains.training import checkpointing
from grains.training.batches import Batches
from grains.training.checkpointing import ShardSnapshot, SnapshotState
from grains.training.datasets import load_dataset
from grains.training.messages import StageConfig, StageStatus, StepPoint
from grains.training.optim import clip_coefficient
from grains.training.pipeline import stage_module, tensor_names
from grains.training.program import is_fatal
from grains.training.records import MicroBatchSpan
from grains.training.shard import StaleGenerationError
from grains.training.stage_core import StageCore

log = logging.getLogger("redgrain.training.stage")

_POINTS = 2000


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
        self._loop: asyncio.Task[None] | None = None
        self._back: asyncio.Queue[int] = asyncio.Queue()
        self._failed: asyncio.Event = asyncio.Event()
        self._window: asyncio.Semaphore | None = None
        self._arrived: dict[int, int] = {}  # gpipe, last stage: forwards received per step
        self._steps_done = 0
        self._rate = 0.0
        self._labels: tuple[int, tuple[torch.Tensor, ...]] | None = None
        self._parts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # hybrid leader: step -> replica -> part
        self._means: dict[int, tuple[dict[str, torch.Tensor], int]] = {}  # step -> (mean, fetches left)
        self._reduced = asyncio.Condition()

    async def on_deactivate(self, reason: DeactivationReason) -> None:
        await self._stop_loop()

    # --- the coordinator's API ---------------------------------------------
    async def configure(self, cfg: StageConfig) -> StageStatus:
        """Start (or restart) this stage for a generation; stage 0 starts running the steps."""
        await self._stop_loop()
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
        self._batches = await self.run_in_thread(Batches, load_dataset(cfg.spec, "train"), self.device) if first or last else None
        self._status, self._error, self._fatal = "running", "", False
        if not cfg.keep:
            self._saved = [cfg.restore_step] if cfg.restore_step is not None else []
        self._points.clear()
        self._losses, self._metrics = [], []
        self._arrived = {}
        self._labels = None
        self._steps_done = 0
        self._back, self._failed = asyncio.Queue(), asyncio.Event()
        self._parts, self._means = {}, {}
        async with self._reduced:
            self._reduced.notify_all()  # contributions of an older generation give up
        if first:
            self._loop = self.start_task(self._run(cfg), name=f"{self.key} steps g{cfg.generation}")
        return await self.status()

    async def stop(self) -> None:
        self._generation += 1  # messages of the stopped generation are refused from now on
        await self._stop_loop()
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
            steps_done=self._steps_done,
        )  # fmt: skip

    async def tensors(self) -> dict[str, torch.Tensor]:
        core = self._core
        return {} if core is None else await self.run_in_thread(core.tensors)

    # --- between stages -------------------------------------------------------
    async def forward(self, generation: int, step: int, mb: int, x: torch.Tensor) -> None:
        """Micro-batch ``mb``'s input from the previous stage; computed in the background."""
        self._check(generation)
        self.start_task(self._guard(generation, self._forward(generation, step, mb, x)), name=f"{self.key} f{step}.{mb}")

    async def backward(self, generation: int, step: int, mb: int, grad: torch.Tensor | None) -> None:
        """The gradient of micro-batch ``mb``'s output from the next stage; computed in the background."""
        self._check(generation)
        self.start_task(self._guard(generation, self._backward(generation, step, mb, grad)), name=f"{self.key} b{step}.{mb}")

    async def reduce(self, generation: int, step: int) -> None:
        """Hybrid: average this stage's gradients and buffers of ``step`` over the replicas."""
        self._check(generation)
        cfg, core = self._cfg, self._core
        assert cfg is not None and core is not None
        replicas = len(cfg.peer_keys)
        if replicas <= 1:
            return
        part = await self.run_in_thread(core.local_part)
        if cfg.replica == 0:
            mean = await self._collect(generation, step, 0, part, replicas)
        else:
            leader: Any = self.get_grain(PipelineStageGrain, cfg.peer_keys[0])
            mean = await leader.with_timeout(cfg.spec.step_timeout_s).contribute(generation, step, cfg.replica, part)
        await self.run_in_thread(core.take_mean, mean)

    async def contribute(self, generation: int, step: int, replica: int, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hybrid, replica 0's stage: another replica's part of ``step``; returns the replicas' mean."""
        self._check(generation)
        cfg = self._cfg
        assert cfg is not None
        return await self._collect(generation, step, replica, part, len(cfg.peer_keys))

    async def _collect(
        self, generation: int, step: int, replica: int, part: dict[str, torch.Tensor], replicas: int
    ) -> dict[str, torch.Tensor]:
        async with self._reduced:
            self._parts.setdefault(step, {})[replica] = part
            if len(self._parts[step]) == replicas:
                parts = self._parts.pop(step)
                mean = await self.run_in_thread(StageCore.mean_of, [parts[r] for r in sorted(parts)])
                self._means[step] = (mean, replicas)
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

    async def apply(self, generation: int, step: int, coef: float) -> StepPoint:
        """Apply step ``step`` here; the last stage returns the step's loss and the loss function's
        metrics (means over the micro-batches)."""
        self._check(generation)
        core, cfg = self._core, self._cfg
        assert core is not None and cfg is not None
        if core.step != step:
            raise StaleGenerationError(f"{self.key} is at step {core.step}, asked to apply step {step}")
        await self.run_in_thread(core.apply, coef)
        loss = sum(self._losses) / len(self._losses) if self._losses else 0.0
        metrics = {k: sum(m[k] for m in self._metrics) / len(self._metrics) for k in self._metrics[0]} if self._metrics else {}
        self._losses, self._metrics = [], []
        every = cfg.spec.checkpoint_every
        if cfg.replica == 0 and ((every and core.step % every == 0) or core.step == cfg.end_step):
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
        ref: Any = self.get_grain(PipelineStageGrain, cfg.stage_keys[index])
        return ref.with_timeout(cfg.spec.step_timeout_s)

    async def _guard(self, generation: int, work: Any) -> None:
        try:
            await work
        except StaleGenerationError:
            pass
        except Exception as exc:  # noqa: BLE001 - reported to stage 0, which stops the step
            if generation != self._generation:
                return
            log.info("%s: generation %d: %s", self.key, generation, exc)
            with contextlib.suppress(Exception):
                await self._peer(0).fail(generation, f"{self.key}: {type(exc).__name__}: {exc}", is_fatal(exc))

    async def _forward(self, generation: int, step: int, mb: int, x: torch.Tensor) -> None:
        core, cfg = self._core, self._cfg
        assert core is not None and cfg is not None
        y = await self.run_in_thread(core.forward, mb, x)
        if not core.last:
            await self._peer(cfg.index + 1).forward(generation, step, mb, y)
            return
        if cfg.spec.schedule == "1f1b":
            await self._loss_backward(generation, step, mb)
            return
        self._arrived[step] = self._arrived.get(step, 0) + 1
        if self._arrived[step] == cfg.spec.microbatches:  # gpipe: all forwards in, now all backwards
            del self._arrived[step]
            for m in range(cfg.spec.microbatches):
                await self._loss_backward(generation, step, m)

    async def _loss_backward(self, generation: int, step: int, mb: int) -> None:
        core, cfg, batches = self._core, self._cfg, self._batches
        assert core is not None and cfg is not None and batches is not None
        if self._labels is None or self._labels[0] != step:  # once per step, not per micro-batch
            replicas = max(1, len(cfg.peer_keys))
            _, labels = await self.run_in_thread(batches.batch, cfg.spec.batch_size, replicas, cfg.replica, step, cfg.spec.seed)
            self._labels = (step, tuple(labels.chunk(cfg.spec.microbatches)))
        target = self._labels[1][mb]
        loss, metrics, grad = await self.run_in_thread(core.loss_backward, mb, target)
        if not math.isfinite(loss):
            raise RuntimeError(f"step {step}: the loss is {loss}")
        self._losses.append(loss)
        self._metrics.append(metrics)
        await self._send_back(generation, step, mb, grad)

    async def _backward(self, generation: int, step: int, mb: int, grad: torch.Tensor | None) -> None:
        core = self._core
        assert core is not None and grad is not None
        out = await self.run_in_thread(core.backward, mb, grad)
        await self._send_back(generation, step, mb, out)

    async def _send_back(self, generation: int, step: int, mb: int, grad: torch.Tensor | None) -> None:
        cfg = self._cfg
        assert cfg is not None
        if cfg.index == 0:
            self._back.put_nowait(mb)
            if self._window is not None:
                self._window.release()
        else:
            await self._peer(cfg.index - 1).backward(generation, step, mb, grad)

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
        replicas = max(1, len(cfg.peer_keys))
        others = [self._peer(i) for i in range(1, stages)]
        last = self._peer(stages - 1) if stages > 1 else None
        t_first: float | None = None
        def gather(step: int) -> asyncio.Future[Any]:
            return asyncio.ensure_future(self.run_in_thread(batches.batch, spec.batch_size, replicas, cfg.replica, step, spec.seed))

        upcoming = gather(core.step) if core.step < cfg.end_step else None
        for step in range(core.step, cfg.end_step):
            assert upcoming is not None
            x, _ = await upcoming
            chunks = x.chunk(m)
            self._window = asyncio.Semaphore(stages if spec.schedule == "1f1b" else m)
            for mb, chunk in enumerate(chunks):
                await self._acquire(self._window, spec.step_timeout_s)
                y = await self.run_in_thread(core.forward, mb, chunk.contiguous())
                if last is None:  # one stage: the whole model here
                    await self._loss_backward(gen, step, mb)
                else:
                    await others[0].forward(gen, step, mb, y)
            # The next step's batch is gathered while this one's backwards run.
            upcoming = gather(step + 1) if step + 1 < cfg.end_step else None
            for _ in range(m):
                await self._next_back(spec.step_timeout_s)
            if replicas > 1:  # hybrid: each stage's gradients averaged over the replicas first
                await asyncio.gather(self.reduce(gen, step), *(p.reduce(gen, step) for p in others))
            coef = 1.0
            if spec.clip_grad_norm is not None:
                parts = await asyncio.gather(self.norm_sq(gen), *(p.norm_sq(gen) for p in others))
                coef = clip_coefficient(math.sqrt(sum(parts)), spec.clip_grad_norm)
            applied = await asyncio.gather(self.apply(gen, step, coef), *(p.apply(gen, step, coef) for p in others))
            self._loss = float(applied[-1].loss)
            now = time.monotonic()
            t_first = t_first or now
            self._steps_done += 1
            if self._steps_done > 1:
                self._rate = (self._steps_done - 1) * spec.batch_size / max(1e-9, now - t_first)  # this replica
            self._points.append(StepPoint(step=step, loss=self._loss, metrics=applied[-1].metrics, at=time.time()))

    async def _acquire(self, window: asyncio.Semaphore, timeout_s: float) -> None:
        await self._wait(window.acquire(), timeout_s, "a micro-batch slot")

    async def _next_back(self, timeout_s: float) -> None:
        await self._wait(self._back.get(), timeout_s, "a micro-batch's backward")

    async def _wait(self, what: Any, timeout_s: float, name: str) -> None:
        waiter = asyncio.ensure_future(what)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            done, _ = await asyncio.wait({waiter, failed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if waiter not in done:
            waiter.cancel()
            raise RuntimeError(self._error if self._failed.is_set() else f"no {name} within step_timeout_s={timeout_s}")

    async def _restore(self, cfg: StageConfig, module: torch.nn.Module) -> ShardSnapshot:
        assert cfg.restore_step is not None
        names, extra = tensor_names(module)  # in the stage's order: its optimizer state's
        return await checkpointing.load(self, cfg.job, cfg.run, cfg.restore_step, names, extra)

    async def _save(self, cfg: StageConfig, snap: ShardSnapshot, generation: int) -> None:
        try:
            await checkpointing.save(self, cfg.job, cfg.run, snap, cfg.checkpoint_keys or cfg.stage_keys, cfg.spec.keep_checkpoints)
        except Exception:
            log.exception("%s: saving checkpoint %d failed", self.key, snap.step)
            return
        if generation == self._generation:
            self._saved = [*self._saved, snap.step][-10:]

    async def _stop_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.done():
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loop
