"""All-reduce training: trainer grains in a torch.distributed group, formed by the coordinator.

Mode ``allreduce`` has no parameter shards. Every trainer holds the whole
model and its optimizer; per step it computes the gradients of its slice of
the global batch, flattens them into one tensor, averages it over the group
with one collective (a sum then a division, as torch's ``allreduce_hook``;
torch's own DDP comm hooks ``fp16_compress_hook`` / ``bf16_compress_hook`` for
``compression``), and
applies the same optimizer step as every other rank. The math is that of one
process on the global batch, as in sync parameter-server mode.

The coordinator hands each trainer a :class:`GroupAssignment`: rank, trainer
count, group generation, a rendezvous prefix in Redis
(:mod:`grains.training.strategies.allreduce.rendezvous`) and the state to start from. The group is
a ``ProcessGroupGloo`` (``ProcessGroupNCCL`` when every member has a GPU) built
directly on that store, never torch's global default group, so any number of
trainers can live in one process.

A step is *committed* on a trainer once its collective returned and its
optimizer step ran; that is the only moment the held state changes, so a
trainer always holds a consistent (parameters, optimizer state, step). When
the group must change (a member's silo died, a trainer silo joined), the
coordinator calls :meth:`AllreduceTrainerGrain.stop` on the survivors: the
blocked collective is abandoned at once (the wait polls an abandon flag; the
group's gloo timeout is only a backstop), and the group is released on a
thread of its own, since destroying a gloo group with a collective in flight
blocks until that times out. Survivors then report the step they hold, and
the next generation starts from the newest one: members behind copy it from a
member that holds it (:meth:`AllreduceTrainerGrain.snapshot`), new members
too, and the last committed checkpoint is the fallback when none does.

Rank 0 saves checkpoints with the same snapshot API and format as the shards
(:mod:`grains.training.state.checkpoint`: one member holding the whole model), so
either mode can restore the other's.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from grains.base import DeactivationReason, Grain
from grains.placement import hash_placement, immovable, reentrant
from grains.training.api.job import TrainingJob
from grains.training.api.messages import Evaluation, GroupAssignment, StepPoint, TrainerProgress
from grains.training.evaluation import CheckpointEvaluations
from grains.training.loop.program import is_fatal, is_out_of_memory
from grains.training.state import checkpoint
from grains.training.state.checkpoint import SnapshotState, TrainingSnapshot
from grains.training.strategies.allreduce.rendezvous import (
    GroupAbandonedError,
    RedisStore,
    sync_client_like,
)
from grains.training.strategies.allreduce.trainer_core import StepResult, TrainerCore
from grains.workload import workload
from silo import errors

log = logging.getLogger("redgrain.training.allreduce")

_POINTS = 2000
_RATE_WINDOW = 20
_ABANDON_POLL = datetime.timedelta(milliseconds=50)

# torch's own DDP comm hooks, for the compressed kinds ("none" calls the collective directly).
_HOOKS: dict[str, Any] = {
    "none": None,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


class _Bucket:
    """The one gradient bucket of a step, as torch's comm hooks see it (they only read ``buffer()``)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self._flat = flat

    def buffer(self) -> torch.Tensor:
        return self._flat


class Group:
    """One generation's process group; ``release()`` hands it to a thread that can wait for gloo."""

    def __init__(self, pg: Any, hook: Any) -> None:
        self.pg: Any = pg
        self._hook = hook

    def allreduce_mean(self, flat: torch.Tensor, abandon: threading.Event, raw: bool = False) -> torch.Tensor:
        """The mean of ``flat`` over the group (``raw``: never compressed); GroupAbandonedError as
        soon as ``abandon`` is set."""
        if abandon.is_set():  # never start a collective once stopped: the held step must not move
            raise GroupAbandonedError("collective abandoned: the coordinator replaced the group")
        if self._hook is None or raw:
            # Uncompressed: the collective itself, waited on in C++ (a torch future's callback
            # would wake this thread through the GIL: ~0.6 ms a step on a small model).
            work = self.pg.allreduce([flat])
            while True:
                try:
                    work.wait(_ABANDON_POLL)
                    break
                except RuntimeError:
                    if work.is_completed():
                        work.wait()  # finished meanwhile: its result, or the peer's error
                        break
                    if abandon.is_set():
                        raise GroupAbandonedError(
                            "collective abandoned: the coordinator replaced the group"
                        ) from None
            return flat.div_(self.pg.size())
        fut = self._hook(self.pg, _Bucket(flat))
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())
        while not done.wait(_ABANDON_POLL.total_seconds()):
            if abandon.is_set():
                raise GroupAbandonedError(
                    "collective abandoned: the coordinator replaced the group"
                )
        out: torch.Tensor = fut.value()  # raises when a peer broke the collective
        return out

    def release(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            # Dropping a gloo group whose collective is still pending blocks until its
            # timeout; never on the event loop or the silo's executor.
            threading.Thread(
                target=_drop, args=([pg],), name="redgrain-group-release", daemon=True
            ).start()


def _drop(holder: list[Any]) -> None:
    holder.clear()


def form_group(
    client: Any,
    a: GroupAssignment,
    host: str,
    device: str,
    abandon: threading.Event,
    timeout_s: float,
) -> Group:
    """Rendezvous on Redis and build the group (blocks until every rank arrives; run on a thread)."""
    store = RedisStore(client, a.rendezvous, timeout_s, abandon)
    timeout = datetime.timedelta(seconds=timeout_s)
    if a.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg: Any = dist.ProcessGroupNCCL(store, a.rank, a.trainers, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        pg = dist.ProcessGroupGloo(store, a.rank, a.trainers, opts)
    return Group(pg, _HOOKS[a.spec.compression])


@immovable
@reentrant
@hash_placement
class AllreduceTrainerGrain(Grain):
    """A member of a job's all-reduce group (key = job/trainer-n); driven by the coordinator."""

    State = SnapshotState

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._abandon = threading.Event()
        self._core: TrainerCore | None = None
        self._redis: Any = None
        self._p = TrainerProgress(activation_id="", silo="")
        self._times: deque[tuple[float, int]] = deque(maxlen=_RATE_WINDOW)
        self._points: deque[StepPoint] = deque(maxlen=_POINTS)
        self._saved: list[int] = []
        self._saved_run = -1
        self._saves: set[asyncio.Task[None]] = set()
        self._evaluations = CheckpointEvaluations()

    async def on_activate(self) -> None:
        self._p = TrainerProgress(activation_id=self.activation_id, silo=str(self.silo))

    async def on_deactivate(self, reason: DeactivationReason) -> None:
        await self._abandon_loop()
        if self._redis is not None:
            self._redis.close()

    # --- the coordinator's API ---------------------------------------------
    async def join(self, assignment: GroupAssignment) -> None:
        """Leave any older group and start training as ``assignment`` says; returns at once."""
        await self._abandon_loop()
        a = assignment
        if a.run != self._saved_run:  # checkpoints of an earlier run of the job id are not this run's
            self._saved, self._saved_run = [], a.run
        held_run, held_step = self._core.held if self._core is not None else (-1, -1)
        self._p = TrainerProgress(
            activation_id=self.activation_id, silo=str(self.silo), generation=a.generation, rank=a.rank,
            status="running", step=a.start_step, held_run=held_run, held_step=held_step, trainers=a.trainers,
            saved_steps=list(self._saved),
        )  # fmt: skip
        self._times.clear()
        self._points.clear()
        self._abandon = threading.Event()
        self._task = self.start_task(
            self._loop(a, self._abandon), name=f"{self.key} group g{a.generation}"
        )

    async def stop(self) -> TrainerProgress:
        """Abandon the current group (a blocked collective returns at once); report the held state."""
        await self._abandon_loop()
        if self._p.status == "running":
            self._p.status = "idle"
        return await self.progress(1 << 62)

    async def release(self) -> None:
        """The job is over: leave the group, drop the model, deactivate."""
        await self._abandon_loop()
        self._core = None
        self._evaluations.clear()
        self.deactivate_on_idle()

    async def evaluate(self, job: str, spec: TrainingJob, run: int, step: int) -> Evaluation:
        """Evaluate the job's checkpoint ``step`` on this silo's device, beside training
        (:mod:`grains.training.evaluation`); from the weights this trainer holds when they are that
        step's (the job's last step, at its end), else read from the checkpoint."""
        core = self._core
        if core is not None and core.held == (run, step):
            snap = await self.run_in_thread(core.snapshot)
            if snap.step == step:  # no step ran meanwhile
                return await self._evaluations.evaluate_held(self, spec, snap)
        return await self._evaluations.evaluate(self, spec, job, run, step)

    async def progress(self, since_step: int = 0) -> TrainerProgress:
        """Counters of the current generation, and the per-step points from ``since_step`` on."""
        points = [p for p in self._points if p.step >= since_step]
        run, step = self._core.held if self._core is not None else (-1, -1)
        return self._p.model_copy(update={"points": points, "held_run": run, "held_step": step,
                                          "saved_steps": list(self._saved)})  # fmt: skip

    async def snapshot(self, run: int, step: int) -> TrainingSnapshot:
        """The parameters and optimizer state after ``step`` steps of ``run`` (a peer restores from it)."""
        core = self._core
        if core is None or core.held != (run, step):
            held = core.held if core is not None else None
            raise errors.ConfigError(f"{self.key} holds {held}, not step {step} of run {run}")
        snap = await self.run_in_thread(core.snapshot)
        if snap.step != step:  # a step ran meanwhile: the caller's generation is stale anyway
            raise errors.ConfigError(f"{self.key} moved past step {step}")
        return snap

    # --- the loop -------------------------------------------------------------
    async def _abandon_loop(self) -> None:
        task, self._task = self._task, None
        self._abandon.set()
        if task is not None and not task.done():
            # Not cancelled: the loop's thread sees the flag within _ABANDON_POLL (or when its
            # compute ends), and the loop must not touch the core again after we return.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(task)

    async def _loop(self, a: GroupAssignment, abandon: threading.Event) -> None:
        group: Group | None = None
        try:
            await self._prepare(a)
            if abandon.is_set():
                raise GroupAbandonedError("replaced before the group formed")
            if self._redis is None:
                client = workload(self).redis_client()
                if client is None:
                    raise errors.ConfigError(
                        "all-reduce training needs the cluster's Redis for its rendezvous"
                    )
                self._redis = sync_client_like(client)
            group = await self.run_in_thread(
                form_group,
                self._redis,
                a,
                self.silo.host,
                self.device,
                abandon,
                a.spec.step_timeout_s,
            )
            core = self._core
            assert core is not None
            core.segments = list(a.data_segments)
            for step in range(a.start_step, a.end_step):
                r = await self.run_in_thread(core.step, step, a.rank, a.trainers, group, abandon)
                self._record(step, r)
                if a.rank == 0 and checkpoint.checkpoint_due(a.spec, step + 1, a.end_step):
                    await self._checkpoint(a, core)
            # Done means saved too: the coordinator commits what the final report lists.
            await asyncio.gather(*self._saves, return_exceptions=True)
            self._p.status = "done"
        except GroupAbandonedError:
            self._p.status = "idle"
        except asyncio.CancelledError:
            abandon.set()
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which re-forms the group
            log.info(
                "%s: generation %d stopped at step %d: %s",
                self.key,
                a.generation,
                self._p.step,
                exc,
            )
            self._p.status = "failed"
            self._p.error = f"{type(exc).__name__}: {exc}"[:2000]
            self._p.fatal = is_fatal(exc)
            self._p.out_of_memory = is_out_of_memory(exc)
        finally:
            if group is not None:
                group.release()

    async def _prepare(self, a: GroupAssignment) -> None:
        """Bring the model to ``(a.run, a.start_step)``: keep it, copy it from a peer, or load it."""
        want = (a.run, a.start_step)
        if self._core is not None and self._core.spec != a.spec:
            self._core = None
        total = a.end_step or None
        if self._core is not None and self._core.held == want:
            await self.run_in_thread(self._core.follow, total)
            return
        if self._core is None:
            self._core = await self.run_in_thread(TrainerCore, a.spec, self.device, total)
        else:
            await self.run_in_thread(self._core.follow, total)
        core = self._core
        if a.source is not None and a.source != self.key:
            peer = self.get_grain(AllreduceTrainerGrain, a.source)
            snap = await peer.with_timeout(a.spec.step_timeout_s).snapshot(a.run, a.start_step)
            await self.run_in_thread(core.load, snap, a.run)
        elif a.restore_step is not None:
            snap = await checkpoint.load_model(
                self, a.job, a.run, a.restore_step, core.names, [*core.frozen, *core.buffers]
            )  # any mode's
            await self.run_in_thread(core.load, snap, a.run)
        elif a.start_step == 0:
            if core.held[1] > 0:  # trained in an earlier run: rebuild from the seed
                self._core = core = await self.run_in_thread(TrainerCore, a.spec, self.device, total)
            core.fresh(a.run)
        else:
            raise errors.ConfigError(
                f"{self.key}: no source for step {a.start_step} of run {a.run}"
            )
        self._p.held_run, self._p.held_step = core.held

    async def _checkpoint(self, a: GroupAssignment, core: TrainerCore) -> None:
        snap = await self.run_in_thread(core.snapshot)
        task = self.start_task(self._save(a, snap), name=f"{self.key} checkpoint {snap.step}")
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)

    async def _save(self, a: GroupAssignment, snap: TrainingSnapshot) -> None:
        try:
            await checkpoint.save_whole(self, a.job, a.run, snap, checkpoint.retained(a.spec), a.generation)
        except Exception:
            log.exception("%s: saving checkpoint %d failed", self.key, snap.step)
            return
        if a.run == self._saved_run:
            self._saved = [*self._saved, snap.step][-10:]

    def _record(self, step: int, r: StepResult) -> None:
        now = time.monotonic()
        self._times.append((now, r.samples))
        p = self._p
        p.step = step + 1
        p.steps_done += 1
        p.loss = r.loss
        if len(self._times) > 1:
            span = self._times[-1][0] - self._times[0][0]
            p.samples_per_s = sum(s for _, s in list(self._times)[1:]) / span if span > 0 else 0.0
        if self._core is not None and p.trainers > 1:
            # A ring all-reduce sends 2(w-1)/w of the buffer per rank (and receives as much:
            # counted once, as sent, so the job's bytes per step are the bytes on the wire).
            size = self._core.flat.numel() * (4 if self._core.spec.compression == "none" else 2)
            p.bytes_pushed += int(2 * (p.trainers - 1) / p.trainers * size)
        p.skipped += r.skipped
        p.exchange_s += r.exchange_s
        self._points.append(StepPoint(step=step, loss=r.loss, metrics=r.metrics, at=time.time()))
