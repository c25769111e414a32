"""TrainerGrain: one parameter-server trainer, a copy of the model stepping against the shards.

Per step: load the parameters the shards last sent, forward/backward on this
trainer's batch (optionally under bf16 autocast), compress the gradients (with
error feedback) and send one ``exchange`` per shard, all shards at once. The
compute runs on the silo's executor; the next batch is gathered right after
backward, so it is ready when the step ends. In async mode the exchange of
step t overlaps the compute of step t+1 (one step more staleness, no idle
wait); sync and ssp wait for the reply, since it may hold them back.

With lossy compression a trainer saves its error-feedback residual (what it
has not sent yet) at every checkpoint step ``c``, before it pushes step
``c - 1``; so when the shards' checkpoint ``c`` is complete the residuals are
saved too, and trainers restarted from ``c`` resume with them. With that, no
state of a sync job lives outside its checkpoint, and a rollback replays
exactly.

The loop is a background task of the activation, so ``progress`` and ``stop``
are answered while it runs. It never retries on its own: on any error it
stops and reports, and the coordinator decides (restart this trainer, or roll
everyone back to the last checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from grains.base import DeactivationReason, Grain
from grains.checkpoints import snapshots
from grains.immutable import immutable
from grains.placement import hash_placement, immovable, interleave, keep_alive
from grains.ref import Ref
from grains.training.api.job import DEFAULT_STEP, TrainingJob, parse_compression
from grains.training.api.messages import (
    Evaluation,
    ExchangeReply,
    StepPoint,
    TrainerAssignment,
    TrainerProgress,
)
from grains.training.data.batches import job_batches
from grains.training.datasets import load_dataset
from grains.training.evaluation import CheckpointEvaluations
from grains.training.loop.compression import Compressor, Payload, payload_nbytes
from grains.training.loop.program import is_fatal, is_out_of_memory
from grains.training.loop.step_runner import StepRunner
from grains.training.models import build_model
from grains.training.state import checkpoint
from grains.training.state.model_tensors import persistent_buffers
from grains.training.strategies.ps.inline import InlineWhenCheap
from grains.training.strategies.ps.shard import ParamShardGrain
from silo import errors

log = logging.getLogger("redgrain.training.trainer")

_POINTS = 2000
_RATE_WINDOW = 20


@dataclass(slots=True)
class StepResult:
    loss: float
    metrics: dict[str, float]
    samples: int
    grads: list[dict[str, Payload]]
    """Compressed gradients of the trainable parameters, one dict per shard."""
    buffers: list[dict[str, torch.Tensor]]
    """This step's persistent buffers (BatchNorm statistics), one dict per shard."""
    skip: bool = False
    """Nothing of this step is to be applied (non-finite loss with on_nonfinite='skip', fp16 overflow)."""


class TrainerCore:
    """The model, the data and the compressor of one trainer run (used from the executor only)."""

    def __init__(self, a: TrainerAssignment, device: str) -> None:
        self.a = a
        spec = a.spec
        self.model = build_model(spec).to(device)
        self.model.train()
        self.params = dict(self.model.named_parameters())
        self.trainable = [p for p in self.params.values() if p.requires_grad]
        self.buffers = dict(persistent_buffers(self.model))
        self.runner = StepRunner(spec, device, self.trainable)
        self.shard_grads = [[n for n in names if n in self.params and self.params[n].requires_grad] for names in a.shard_names]
        self.shard_buffers = [[n for n in names if n in self.buffers] for names in a.shard_names]
        self.batches = job_batches(spec, "train", device, spec.loader_workers)
        self._stream = self.batches.iterate(
            spec.trainer_batch, a.trainers, a.rank, a.start_step, a.end_step, spec.seed, a.data_segments
        )
        self._next_step = a.start_step
        self.compressor = Compressor(parse_compression(spec.compression))
        self.dense_nbytes = sum(self.params[n].nbytes for names in self.shard_grads for n in names)
        """Bytes of a step's push when it is not compressed: every gradient whole (a skipped
        step's zeros too), the same each step."""
        # Sync mode clips the averaged gradient on the shards (one global norm); async and ssp
        # apply each push alone, so each trainer clips its own (after the residual is added back).
        self.clip = spec.mode != "sync"
        self.device = device
        self._device = next(iter(self.params.values())).device if self.params else torch.device(device)
        """The model's device as its tensors name it ("cuda:0" for "cuda"): pulls on it load as they are."""
        self._prefetched: tuple[int, Any] | None = None

    def load(self, params: dict[str, torch.Tensor]) -> None:
        # The pulled parameters become the weights, with no copy: the shard publishes fresh
        # tensors for each version and never writes to them again, and nothing here writes
        # to weights (the optimizer lives on the shards). fp16/bf16 pulls, and tensors from
        # another device or flattened, are converted; the usual pull (a shard's own fp32
        # tensors) is taken as it is, without the conversion's two calls a tensor.
        # Buffers are copied in: the forward pass updates them in place.
        device = self._device
        for n, t in params.items():
            p = self.params.get(n)
            if p is None:
                with torch.no_grad():
                    self.buffers[n].copy_(t)
            elif t.dtype is p.dtype and t.shape == p.shape and t.device == device:
                p.data = t
            else:
                p.data = t.to(p.device, p.dtype).view_as(p)

    def batch(self, step: int) -> Any:
        if self._prefetched is not None and self._prefetched[0] == step:
            return self._prefetched[1]
        if step != self._next_step:
            raise RuntimeError(f"trainer asked for the batch of step {step}, its stream is at {self._next_step}")
        self._next_step += 1
        return next(self._stream)

    def step(self, payloads: list[dict[str, torch.Tensor]], step: int) -> StepResult:
        for payload in payloads:
            self.load(payload)
        batch = self.batch(step)
        epoch = 0
        if self.runner.program.context:  # only a step that takes a context is told its epoch
            epoch = self.batches.schedule(self.a.spec.trainer_batch, self.a.trainers, self.a.data_segments).position(step)[0]
        b = self.runner.backward(self.model, batch, step, rank=self.a.rank, trainers=self.a.trainers, epoch=epoch)
        # An fp16 overflow skips the step as a non-finite loss does: the shards apply nothing.
        skip = b.skip or (
            self.runner.scaler is not None and self.runner.unscale([p.grad for p in self.trainable if p.grad is not None])
        )
        grads: list[dict[str, Payload]]
        if skip:
            grads = [{n: torch.zeros_like(self.params[n]) for n in names} for names in self.shard_grads]
        elif not self.compressor.lossy and not self.clip:
            # Sent as they are (sync, uncompressed: most jobs): no residual, nothing to clip.
            grads = [{n: self._grad(n) for n in names} for names in self.shard_grads]
        else:
            dense = self.compressor.add_residual({n: self._grad(n) for names in self.shard_grads for n in names})
            if self.clip:
                self.runner.clip_tensors(dense.values())
            grads = [{n: self.compressor.compress(n, dense[n]) for n in names} for names in self.shard_grads]
        buffers = [{n: self.buffers[n].detach().clone() for n in names} for names in self.shard_buffers]
        _by_reference(grads)
        _by_reference(buffers)
        if step + 1 < self.a.end_step:  # prefetch: the next batch is ready before it is asked for
            self._prefetched = (step + 1, self.batch(step + 1))
        return StepResult(b.loss, b.metrics, b.samples, grads, buffers, skip)

    def close(self) -> None:
        """End the batch stream (stops DataLoader workers, if any)."""
        close = getattr(self._stream, "close", None)
        if close is not None:
            with contextlib.suppress(ValueError):  # a step still reading it (cancelled): it ends with the core
                close()

    def _grad(self, name: str) -> torch.Tensor:
        g = self.params[name].grad
        return g if g is not None else torch.zeros_like(self.params[name])


async def _listed(call: Awaitable[ExchangeReply]) -> list[ExchangeReply]:
    return [await call]


def _warm_up(spec: TrainingJob) -> None:
    build_model(spec)
    load_dataset(spec, "train")


def _by_reference(parts: Sequence[Mapping[str, Payload]]) -> None:
    """Mark what a step sends ``@immutable``: a shard on this silo takes it by reference, not as a
    codec copy (at 41 tensors, the tiny BERT's, the copies of the push and of the reply took
    ~2 ms of the silo's event loop a step). Nothing writes to them once sent: the next step's
    backward makes new gradients (``p.grad = None`` first), the buffers are a fresh clone, and
    lossy payloads are new tensors (the residual is kept apart)."""
    for part in parts:
        for payload in part.values():
            for t in (payload,) if isinstance(payload, torch.Tensor) else payload:
                immutable(t)


class ResidualSnapshot(BaseModel):
    """A trainer's own state at checkpoint step ``step``: its error-feedback residual and loss scale.

    Saved in the trainer's state: ``trainers`` is read under its old name ``slots`` too."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    step: int
    trainers: int = Field(validation_alias=AliasChoices("trainers", "slots"))
    """Trainer count of the job when saved (a residual is only reused with the same split)."""
    residual: dict[str, torch.Tensor]
    scaler: dict[str, float] = Field(default_factory=dict)
    """The trainer's fp16 loss scaler (:meth:`StepRunner.state_dict`; {}: none)."""


class TrainerState(BaseModel):
    """Empty, except while a residual snapshot is being saved or loaded."""

    snapshot: ResidualSnapshot | None = None


def residual_group(a: TrainerAssignment) -> str:
    return f"training.{a.job}.r{a.run}.residual.{a.rank}"


@dataclass(slots=True)
class _RunCounters:
    """What a run counts at each step, as plain attributes: a pydantic model's assignment is
    two Python calls, and a step made eleven; ``progress`` turns them into the reported
    ``TrainerProgress`` once a tick."""

    step: int = 0
    steps_done: int = 0
    loss: float = 0.0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    max_staleness: int = 0
    staleness_sum: int = 0
    replies: int = 0
    max_gap: int = 0
    exchange_s: float = 0.0
    skipped: int = 0
    first_step_at: float | None = None

    def fields(self, times: deque[tuple[float, int]]) -> dict[str, Any]:
        """The counters as ``TrainerProgress`` fields; ``times``: (time, samples) of the last steps."""
        rate = 0.0
        if len(times) > 1:
            span = times[-1][0] - times[0][0]
            rate = (sum(n for _, n in times) - times[0][1]) / span if span > 0 else 0.0
        return {
            "step": self.step, "steps_done": self.steps_done, "loss": self.loss, "samples_per_s": rate,
            "bytes_pushed": self.bytes_pushed, "bytes_pulled": self.bytes_pulled, "max_staleness": self.max_staleness,
            "mean_staleness": self.staleness_sum / max(1, self.replies), "max_gap": self.max_gap,
            "exchange_s": self.exchange_s, "skipped": self.skipped, "first_step_at": self.first_step_at,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class TrainerStatistics:
    steps: int
    """Steps completed by the current run."""
    bytes_pushed: int
    """Tensor bytes of gradients sent."""
    bytes_pulled: int
    """Tensor bytes of parameters received."""
    samples_per_s: float
    """Over the last few steps."""


@keep_alive
@immovable
@hash_placement
class TrainerGrain(Grain):
    State = TrainerState

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._p = TrainerProgress(activation_id="", silo="")
        """The run's identity and outcome; what it counts per step is in ``_n``."""
        self._n = _RunCounters()
        self._times: deque[tuple[float, int]] = deque(maxlen=_RATE_WINDOW)
        self._points: deque[StepPoint] = deque(maxlen=_POINTS)
        self._evaluations = CheckpointEvaluations()

    async def on_activate(self) -> None:
        self._p = TrainerProgress(activation_id=self.activation_id, silo=str(self.silo))

    async def on_deactivate(self, reason: DeactivationReason) -> None:
        await self._cancel()

    async def run(self, assignment: TrainerAssignment) -> None:
        """Start (or restart) this trainer's loop; returns at once."""
        await self._cancel()
        a = assignment
        self._p = TrainerProgress(
            activation_id=self.activation_id, silo=str(self.silo), generation=a.generation, rank=a.rank,
            status="running", step=a.start_step,
        )  # fmt: skip
        self._n = _RunCounters(step=a.start_step)
        self._times.clear()
        self._points.clear()
        self._task = self.start_task(self._loop(a), name=f"{self.key} loop g{a.generation}")

    async def prepare(self, spec: TrainingJob) -> None:
        """Build the job's model and load its training data once, and drop both: a trainer about to
        join a running job pays here for its silo's first imports (``transformers``: seconds) and
        data load, while the job trains on, not after the job stopped to take it in."""
        await self.run_in_thread(_warm_up, spec)

    async def stop(self) -> None:
        await self._cancel()
        if self._p.status == "running":
            self._p.status = "idle"

    async def release(self) -> None:
        """The job is over: stop, drop the model and data with the loop, and deactivate."""
        await self._cancel()
        self._evaluations.clear()
        self.deactivate_on_idle()

    @interleave
    async def evaluate(self, job: str, spec: TrainingJob, run: int, step: int) -> Evaluation:
        """Evaluate the job's checkpoint ``step`` on this silo's device, beside training
        (:mod:`grains.training.evaluation`)."""
        return await self._evaluations.evaluate(self, spec, job, run, step)

    async def progress(self, since_step: int = 0) -> TrainerProgress:
        """Counters of the current run, and the per-step points from ``since_step`` on."""
        # The points are in step order: the new ones are read from the end, not found among the
        # last 2000 at every tick.
        points: list[StepPoint] = []
        for p in reversed(self._points):
            if p.step < since_step:
                break
            points.append(p)
        points.reverse()
        return self._p.model_copy(update={**self._n.fields(self._times), "points": points})

    async def _cancel(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _loop(self, a: TrainerAssignment) -> None:
        try:
            await self._train(a)
            self._p.status = "done"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which decides
            log.info("%s: generation %d stopped at step %d: %s", self.key, a.generation, self._n.step, exc)
            self._p.status = "failed"
            self._p.error = f"{type(exc).__name__}: {exc}"[:2000]
            self._p.fatal = is_fatal(exc)
            self._p.out_of_memory = is_out_of_memory(exc)

    async def _compute(
        self, core: TrainerCore, work: InlineWhenCheap | None, payloads: list[dict[str, torch.Tensor]], step: int, timeout_s: float
    ) -> StepResult:  # fmt: skip
        """One step on the executor (or inline while steps are cheap: ``work``); a step longer than
        ``step_timeout_s`` fails this run (the coordinator restarts the trainer: a new core; the
        late thread only touches the old one)."""
        if work is not None and work.inline:
            # On the loop, the step runs to its end before any timer could fire: a timeout there
            # would only cost its timer (a heap push and a cancel a step).
            return await work.run(core.step, payloads, step)
        run = work.run if work is not None else self.run_in_thread
        try:
            # asyncio.timeout, not wait_for: no task wrapping the step, one loop turn less a step.
            async with asyncio.timeout(timeout_s):
                return await run(core.step, payloads, step)
        except TimeoutError:
            raise TimeoutError(f"step {step} took longer than step_timeout_s={timeout_s}") from None

    async def _train(self, a: TrainerAssignment) -> None:
        core = await self.run_in_thread(TrainerCore, a, self.device)
        try:
            await self._steps(a, core)
        finally:
            await asyncio.shield(self.run_in_thread(core.close))

    async def _steps(self, a: TrainerAssignment, core: TrainerCore) -> None:
        shards: list[Ref[ParamShardGrain]] = [
            self.get_grain(ParamShardGrain, key).with_timeout(a.spec.step_timeout_s)
            for key in a.shard_keys
        ]
        n = len(shards)
        versions = [-1] * n  # version of the parameters the core holds (or will load next)
        base = [-1] * n  # version the next gradients are computed on
        replies = await asyncio.gather(
            *(s.exchange(a.generation, a.rank, a.start_step, None, -1, -1) for s in shards)
        )
        payloads = self._take(replies, versions)
        # Per-trainer state that lives outside the shards: the residual (lossy compression) and the
        # loss scale (fp16), saved with each checkpoint so a restart from it continues with both.
        own_state = core.compressor.lossy or core.runner.scaler is not None
        if own_state and a.start_step:
            await self._restore_residual(a, core)
        pipelined = a.spec.mode == "async"
        # A sub-millisecond step runs on the loop (inline.py): its two thread hops cost more than
        # it does. Not with DataLoader workers (a batch could wait on another process), a GPU, or a
        # step function of the user's own: it may wait (on a lock, a file, another process), and
        # on the loop that wait would hold every grain of the silo (seen: a test's step waiting
        # for its go-ahead held the loop 60 s, so the go-ahead never came).
        cheap = a.spec.loader_workers == 0 and core.device == "cpu" and a.spec.step == DEFAULT_STEP
        work = InlineWhenCheap(self.run_in_thread) if cheap else None
        pending: asyncio.Future[list[ExchangeReply]] | None = None
        step = a.start_step
        while step < a.end_step:
            for i, p in enumerate(payloads):
                if p:
                    base[i] = versions[i]
            r = await self._compute(core, work, [p for p in payloads if p], step, a.spec.step_timeout_s)
            payloads = [{} for _ in range(n)]
            if pending is not None:
                payloads = self._take(await self._timed(pending), versions)
                pending = None
            self._n.bytes_pushed += (
                sum(payload_nbytes(g) for d in r.grads for g in d.values()) if core.compressor.lossy else core.dense_nbytes
            )
            if own_state and checkpoint.checkpoint_due(a.spec, step + 1, a.end_step):
                # Before this push: checkpoint step+1 cannot complete until it is applied.
                await self._save_residual(a, core, step + 1)
            calls = [
                s.exchange(a.generation, a.rank, step, r.grads[i], base[i], versions[i], r.buffers[i] or None, r.skip)
                for i, s in enumerate(shards)
            ]
            if pipelined and step + 1 < a.end_step:
                pending = asyncio.gather(*calls)
            else:
                # One shard: its call awaited as it is, no gathering task (a loop turn less a step).
                payloads = self._take(await self._timed(_listed(calls[0]) if n == 1 else asyncio.gather(*calls)), versions)
            self._record(step, r)
            step += 1
        if pending is not None:
            self._take(await pending, versions)

    async def _timed(self, exchange: Awaitable[list[ExchangeReply]]) -> list[ExchangeReply]:
        """Wait for an exchange, adding the wait to this run's exchange time."""
        t0 = time.perf_counter()
        try:
            return await exchange
        finally:
            self._n.exchange_s += time.perf_counter() - t0

    async def _save_residual(self, a: TrainerAssignment, core: TrainerCore, step: int) -> None:
        residual = {n: t.to("cpu") for n, t in core.compressor.residual().items()}
        snap = ResidualSnapshot(step=step, trainers=a.trainers, residual=residual, scaler=core.runner.state_dict())
        self.state = TrainerState(snapshot=snap)
        try:
            await snapshots(self).save(residual_group(a), step, keep=a.spec.keep_checkpoints + 1)
        except errors.StateConflictError:
            raise
        except errors.StorageError as exc:
            # Training goes on; a restart from this checkpoint then begins with an empty
            # residual. A replay after a rollback finds this step already saved (the same
            # residual, in sync mode) and lands here too.
            log.debug("%s: residual of step %d not saved: %s", self.key, step, exc)
        finally:
            self.state = TrainerState()

    async def _restore_residual(self, a: TrainerAssignment, core: TrainerCore) -> None:
        try:
            await snapshots(self).load(residual_group(a), a.start_step, write=False)
        except errors.StorageError as exc:
            log.info("%s: no residual saved at step %d (%s); starting with none", self.key, a.start_step, exc)
            return
        snap, self.state = self.state.snapshot, TrainerState()
        if snap is not None and snap.step == a.start_step:
            core.runner.load_state_dict(snap.scaler)  # a loss scale is the trainer's whatever the split
            if snap.trainers == a.trainers:
                core.compressor.restore({n: t.to(core.device) for n, t in snap.residual.items()})

    def _take(self, replies: list[ExchangeReply], versions: list[int]) -> list[dict[str, torch.Tensor]]:
        out: list[dict[str, torch.Tensor]] = []
        for i, rep in enumerate(replies):
            n = self._n
            n.max_staleness = max(n.max_staleness, rep.staleness)
            n.staleness_sum += rep.staleness
            n.replies += 1
            n.max_gap = max(n.max_gap, rep.gap)
            if rep.params is not None:
                versions[i] = rep.version
                n.bytes_pulled += sum(t.nbytes for t in rep.params.values())
                out.append(rep.params)
            else:
                out.append({})
        return out

    def _record(self, step: int, r: StepResult) -> None:
        self._times.append((time.monotonic(), r.samples))
        n = self._n
        n.step = step + 1
        n.steps_done += 1
        now = time.time()
        if n.first_step_at is None:
            n.first_step_at = now
        n.loss = r.loss
        n.skipped += r.skip
        self._points.append(StepPoint(step=step, loss=r.loss, metrics=r.metrics, at=now))

    def statistics(self) -> TrainerStatistics:
        n = self._n
        return TrainerStatistics(n.steps_done, n.bytes_pushed, n.bytes_pulled, n.fields(self._times)["samples_per_s"])
