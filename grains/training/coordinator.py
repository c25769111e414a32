"""CoordinatorGrain: owns a job (key = job id), runs it to the end, and brings it back after failures.

``start(spec)`` checks the spec (a bad one raises ConfigError before anything
starts), saves it and starts the run loop, a background task of the
activation; ``status()``, ``cancel()``, ``history()`` and ``parameters()`` are
answered while it runs. The loop hands the job to the driver of its mode and
asks it to look at the job's grains every ``_TICK_S``, repairing what it
finds (:mod:`grains.training.strategies.driver`):

- modes ``sync``, ``async``, ``ssp``: parameter shards and trainers; a
  lost trainer is restarted alone, a lost shard is a rollback to the last
  committed checkpoint (:mod:`grains.training.strategies.ps.driver`);
- mode ``allreduce``: a torch.distributed group of trainers, re-formed from
  the newest step a survivor holds whenever a member is lost or a trainer silo
  joins (:mod:`grains.training.strategies.allreduce.driver`).

The coordinator itself re-activated (its silo died): its state says the job
is running, so ``on_activate`` starts the loop again, and the driver
re-attaches to the grains the state names.

Elastic growth (both modes, :mod:`grains.training.strategies.elastic` answers which
silos may host trainers): with ``trainers = "auto"`` a trainer silo that joins
gets a trainer, in parameter-server mode at the next committed checkpoint, in
``allreduce`` mode at the next group generation.

What stays here is what every mode shares: the job's starts and runs (a new
generation at each start; a resume continues the run's checkpoint group), its
persisted state (one writer at a time), its status and history, the
dashboard's job record (whose cancel request ends the job), the loggers, and
the job's end. Two concepts live beside it, each in a module of its own:
:mod:`grains.training.job_evaluations` (an evaluation from due to recorded,
the best checkpoint, early stopping) and :mod:`grains.training.job_checkpoints`
(reading a step's weights, keeping the best, retention while evaluations are
due). The driver sees the coordinator only through ``_Job``, built with the
coordinator's own steps by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from grains.base import DeactivationReason, Grain
from grains.checkpoints import snapshots
from grains.placement import hash_placement, keep_alive
from grains.training import history
from grains.training.api.callbacks import Callbacks
from grains.training.api.job import TrainingJob, parse_job
from grains.training.api.job_state import JobState
from grains.training.api.messages import (
    HistoryPoint,
    JobStatus,
    ShardStatus,
    StepPoint,
    TrainerProgress,
    TrainingStatus,
)
from grains.training.api.records import StageInfo
from grains.training.data.position import DataSchedule, Segment
from grains.training.evaluation import Evaluator
from grains.training.job_checkpoints import JobCheckpoints
from grains.training.job_evaluations import JobEvaluations
from grains.training.loggers import JobLoggers
from grains.training.state import checkpoint
from grains.training.state.checkpoint import group
from grains.training.state.store import CheckpointStoreGrain
from grains.training.strategies.allreduce.driver import AllreduceDriver
from grains.training.strategies.driver import Driver
from grains.training.strategies.elastic import TrainerSilos
from grains.training.strategies.pipeline.driver import PipelineDriver
from grains.training.strategies.ps.driver import ParameterServerDriver
from grains.training.submit import check_job
from grains.workload import workload
from silo import errors

log = logging.getLogger("redgrain.training.coordinator")

_TICK_S = 0.2
_TERMINAL = ("completed", "failed", "cancelled")
_FORGET = "forget"
"""The reminder that forgets an ended job ``ttl_after_finished_s`` after it ended."""


def _job_group(job: str, name: str) -> bool:
    """Whether checkpoint group ``name`` is one of ``job``'s: a run's (``group(job, run)``) or a
    trainer's residuals in it (``residual_group``); never another job's whose id extends this one."""
    prefix = group(job, 0)[:-1]
    run, _, rest = name.removeprefix(prefix).partition(".")
    return name.startswith(prefix) and run.isdigit() and (not rest or rest.startswith("residual.") or rest == "best")


def _resumed_segments(old: JobState) -> list[Segment]:
    """The data position a resumed run starts from: the last run's at its newest committed step,
    in samples (so the new start may have another trainer count or batch size)."""
    if old.spec is None or not old.trainers or not old.committed:
        return []
    schedule = DataSchedule.of(old.train_size, old.spec.trainer_batch, old.data_segments, old.trainers)
    return schedule.from_step(max(old.committed[-1], schedule.segments[0].start_step)).segments


class _Job:
    """The coordinator as its driver sees it (:class:`grains.training.strategies.driver.JobContext`):
    the grain, and the coordinator's own steps the coordinator hands it by name (none of its
    internals are reached from here)."""

    def __init__(
        self,
        grain: Grain,
        state: Callable[[], JobState],
        save: Callable[[], Awaitable[None]],
        report: Callable[[dict[int, TrainerProgress], list[ShardStatus], list[str] | None, list[StageInfo] | None], Awaitable[None]],
        finish: Callable[[JobStatus], Awaitable[None]],
        committed: Callable[[int], Awaitable[None]],
        show_shard_silos: Callable[[list[str]], None],
    ) -> None:
        self._grain, self._state, self._save, self._report = grain, state, save, report
        self._finish, self._committed, self._show = finish, committed, show_shard_silos

    @property
    def grain(self) -> Grain:
        return self._grain

    @property
    def key(self) -> str:
        return self._grain.key

    @property
    def state(self) -> JobState:
        return self._state()

    async def save(self) -> None:
        await self._save()

    async def report(
        self, progress: dict[int, TrainerProgress], statuses: list[ShardStatus],
        trainer_silos: list[str] | None = None, stages: list[StageInfo] | None = None,
    ) -> None:  # fmt: skip
        await self._report(progress, statuses, trainer_silos, stages)

    async def finish(self, status: JobStatus) -> None:
        await self._finish(status)

    async def committed(self, step: int) -> None:
        await self._committed(step)

    def show_shard_silos(self, silos: list[str]) -> None:
        self._show(silos)


def _mean_metrics(each: list[dict[str, float]]) -> dict[str, float]:
    """Each name's mean over the trainers that report it."""
    sums: dict[str, list[float]] = {}
    for m in each:
        for k, v in m.items():
            sums.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in sums.items()}


@keep_alive
@hash_placement
class CoordinatorGrain(Grain):
    State = JobState

    def __init__(self) -> None:
        self._loop: asyncio.Task[None] | None = None
        self._driver: Driver | None = None
        self._write_lock = asyncio.Lock()
        self._live = TrainingStatus(job="")
        self._callbacks: Callbacks | None = None
        self._checkpoints = JobCheckpoints(self, lambda: self.state, self._job_evaluator, self._job_driver)
        self._evaluations = JobEvaluations(self, lambda: self.state, self._checkpoints, self._job_driver,
                                           self._job_callbacks, self._recorded)  # fmt: skip
        self._last_publish_failed = False
        self._silos: TrainerSilos | None = None
        self._counted: dict[str, int] = {}
        """Steps already counted of each trainer run (activation/generation/rank -> steps_done)."""
        self._count_from_now = False
        """Re-activated: the runs found at the first tick were counted by the previous activation."""
        self._unpublished: list[HistoryPoint] = []
        """History points not yet written to the dashboard's stream (the next publish writes them)."""
        self._republish = False
        """The history lost points: the next publish rewrites the stream from it."""
        self._loggers: JobLoggers | None = None
        self._unlogged: list[HistoryPoint] = []
        """History points not yet handed to the job's loggers."""
        self._step_points: dict[int, dict[int, StepPoint]] = {}
        """Trainers' points (by step done, then rank) of steps not every trainer has completed."""

    async def on_activate(self) -> None:
        self._live = self._status_from_state()
        self._evaluations.last_step = self.state.eval_step or 0
        if self.state.status in ("starting", "running"):
            log.info("%s: re-activated with the job running; resuming", self.key)
            self._count_from_now = True
            self._loop = self.start_task(self._drive(resume=True), name=f"{self.key} driver")

    async def on_deactivate(self, reason: DeactivationReason) -> None:
        self._loop = None
        loggers, self._loggers = self._loggers, None
        if loggers is not None:
            await loggers.close()

    # --- the client API -----------------------------------------------------
    async def start(self, spec: TrainingJob | dict[str, Any]) -> TrainingStatus:
        """Check the spec and start the job; ConfigError (before anything starts) when it is bad."""
        job = parse_job(spec)
        if self.state.status in ("starting", "running"):
            if job == self.state.spec:
                return await self.status()
            raise errors.ConfigError(f"job {self.key} is already running with another spec; cancel it first")
        if "/" in self.key or ":" in self.key:
            raise errors.ConfigError(f"job id {self.key!r} may not contain '/' or ':'")
        await self.run_in_thread(check_job, job)
        await self.unregister_reminder(_FORGET)  # an ended run's; this one sets its own
        old = self.state
        if job.resuming and not old.committed:
            raise errors.ConfigError(f"job {self.key} has no committed checkpoint to resume from")
        if job.resume_from_step is not None:
            if job.resume_from_step not in old.committed:
                raise errors.ConfigError(
                    f"job {self.key} has no committed checkpoint at step {job.resume_from_step} (committed: {old.committed[-5:]})"
                )
            # The later checkpoints are abandoned, as a rollback to that step abandons them.
            old = old.model_copy(update={"committed": [c for c in old.committed if c <= job.resume_from_step]})
        if job.resuming:
            # What the last run's holders saved past its last commit is abandoned too: a rollback
            # that finds its restore point gone takes the store's newest, which must be this run's.
            await checkpoint.drop_after(self, self.key, old.run, old.committed[-1])
        self.state = self.State(
            spec=job, status="starting", generation=old.generation + 1, run=old.generation + 1, started_at=time.time(),
            steps_run=old.steps_run, samples_run=old.samples_run,  # counters of the job id: they only grow
        )
        if job.resuming:
            # Same run, so the same checkpoint group: the new start (in any mode) restores
            # the newest committed step and keeps checkpointing next to it.
            s = self.state
            s.run, s.committed, s.next_trainer, s.changes = old.run, list(old.committed), old.next_trainer, old.changes
            s.committed_at = {c: t for c, t in old.committed_at.items() if c in s.committed}
            s.data_segments = _resumed_segments(old)
            s.best_step, s.best_value = old.best_step, old.best_value
            s.mlflow_run_id = old.mlflow_run_id  # the run goes on: so does its MLflow run
            s.step = s.committed[-1]  # where it starts: its status never reads step 0 of a later epoch
        self._driver = None  # a new job, a new driver: nothing remembered from the last one
        self._evaluations.new_job()  # and its own model and test split (the last job's may differ)
        self._callbacks = None
        if job.init_from is not None and not job.resuming:
            # The starting weights become step 0 of the run: every mode restores it like any
            # checkpoint, and a rollback before the first checkpoint comes back to it.
            evaluator = await self._job_evaluator()
            snap = await self.run_in_thread(evaluator.init_snapshot, job.init_from, job)
            store = self.get_grain(CheckpointStoreGrain, self.key)
            await store.with_timeout(120.0).save_whole(self.state.run, snap, checkpoint.retained(job))
            self.state.committed = [0]
            self.state.committed_at = {0: time.time()}
        await self._write()
        self._evaluations.new_job()  # after step 0 of init_from: nothing due before it
        self._counted, self._count_from_now = {}, False
        self._unpublished, self._unlogged, self._step_points = [], [], {}
        if self._loggers is not None:
            await self._loggers.close()
        self._loggers = None  # the new run's own (its directory, its MLflow run)
        self._live = self._status_from_state()
        self._loop = self.start_task(self._drive(resume=False), name=f"{self.key} driver")
        return await self.status()

    async def status(self) -> TrainingStatus:
        """The job's progress: step, loss, accuracy, samples/s, bytes per step, checkpoints."""
        return self._live.model_copy(update={"coordinator_silo": str(self.silo)})

    async def cancel(self) -> TrainingStatus:
        """Stop the job: trainers stop, shards refuse further pushes; the state says cancelled."""
        if self.state.status in ("starting", "running"):
            loop, self._loop = self._loop, None
            if loop is not None and loop is not asyncio.current_task():
                loop.cancel()
                await asyncio.gather(loop, return_exceptions=True)
            await self._finish("cancelled")
        return await self.status()

    async def forget(self) -> TrainingStatus:
        """Delete the job from Redis: the checkpoints of every run, its progress record, history
        and rendezvous keys, and this coordinator's state (the job id can be started afresh).
        Refused with ConfigError while the job runs: cancel it first."""
        s = self.state
        if s.status in ("starting", "running"):
            raise errors.ConfigError(f"job {self.key} is {s.status}: cancel it before forgetting it")
        checkpoints = snapshots(self)
        for g in await checkpoints.groups():
            if _job_group(self.key, g):
                for pending in (False, True):
                    for info in await checkpoints.list(g, pending=pending):
                        await checkpoints.delete(g, info.snapshot_id)
        await workload(self).forget_progress(self.key)
        store = self.get_grain(CheckpointStoreGrain, self.key)
        with contextlib.suppress(errors.RedgrainError):
            await store.release()
        await self.clear_state()
        # Last: a silo killed part-way through leaves the reminder registered, and its next tick
        # forgets the rest (every step above is idempotent).
        await self.unregister_reminder(_FORGET)
        self.state = self.State()
        self._live = self._status_from_state()
        self._driver = None
        self._evaluations.new_job()
        log.info("%s: job forgotten", self.key)
        self.deactivate_on_idle()
        return await self.status()

    async def receive_reminder(self, name: str) -> None:
        if name != _FORGET:
            return
        if self.state.status in _TERMINAL and self.state.finished_at:
            await self.forget()
        else:  # started again since: the new run sets its own when it ends
            await self.unregister_reminder(_FORGET)

    async def job_spec(self) -> TrainingJob | None:
        """The spec of the job's latest start (None: never started); what serving builds the model from."""
        return self.state.spec

    async def history(self) -> list[HistoryPoint]:
        """The job's curves since it started, in step order: a training point per completed
        step, an evaluation point per evaluated checkpoint (:mod:`grains.training.history`)."""
        return list(self.state.history)

    async def parameters(self) -> dict[str, torch.Tensor]:
        """The current fp32 parameters (trainable and frozen): gathered from the job's grains while
        it runs, read from its final (or last committed) checkpoint once it has ended."""
        if self.state.spec is None:
            return {}
        evaluator = await self._job_evaluator()
        tensors = await self._checkpoints.current()
        names = set(dict(evaluator.model.named_parameters()))
        return {n: t for n, t in tensors.items() if n in names}

    async def state_dict(self, step: int | None = None, best: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict()`` (parameters and buffers, fp32, on the CPU), which
        ``model.load_state_dict(..., strict=True)`` accepts; ``{}`` before the job has weights.

        ``step`` reads that committed checkpoint instead of the newest weights: what a caller
        labels "step N" is then step N, even while the job trains on past it. ``best`` reads the
        checkpoint ``keep_best`` kept (``status().best_step``)."""
        if self.state.spec is None:
            return {}
        if best:
            tensors = await self._checkpoints.best()
        elif step is None:
            tensors = await self._checkpoints.current()
        elif step in self.state.committed:
            tensors = await self._checkpoints.read(step)
        else:
            raise errors.ConfigError(f"job {self.key} has no committed checkpoint at step {step} (committed: {self.state.committed[-5:]})")
        if not tensors:
            return {}
        evaluator = await self._job_evaluator()
        return await self.run_in_thread(evaluator.state_dict, tensors)

    # --- the run loop -------------------------------------------------------
    def _job_driver(self) -> Driver:
        """The current job's driver (made on first use; the trainer silos' watch outlives it)."""
        if self._driver is None:
            spec = self.state.spec
            assert spec is not None
            drivers: dict[str, type[AllreduceDriver | PipelineDriver | ParameterServerDriver]] = {
                "allreduce": AllreduceDriver, "pipeline": PipelineDriver,
            }  # fmt: skip
            cls = drivers.get(spec.mode, ParameterServerDriver)
            name = cls.trainer_type.__name__
            if self._silos is None or self._silos.type_name != name or self._silos.role != spec.trainer_role:
                self._silos = TrainerSilos(name, spec.trainer_role)
            self._driver = cls(self._as_job(), self._silos)
        return self._driver

    def _as_job(self) -> _Job:
        def show_shard_silos(silos: list[str]) -> None:
            self._live.shard_silos = silos

        return _Job(self, lambda: self.state, self._write, self._report, self._finish, self._on_commit, show_shard_silos)

    async def _drive(self, *, resume: bool) -> None:
        try:
            driver = self._job_driver()
            if not resume or not driver.placed():
                # Re-activated with grains in place: re-attach; the first tick repairs what
                # was lost with this silo. Placing reads membership fresh: this silo's view may
                # not have seen the latest joins yet (a pipeline then put two stages on one silo).
                await self.refresh_cluster_members()
                await driver.place_and_start()
            while self.state.status in ("starting", "running"):
                try:
                    await driver.tick()
                except errors.StateConflictError:
                    raise  # another activation owns the job now; this one is going away
                except errors.RedgrainError as exc:
                    # A call or Redis failed this tick (a silo dying, a slow peer): try again.
                    log.warning("%s: tick failed: %s", self.key, exc)
                if self.state.status in _TERMINAL:
                    break
                await asyncio.sleep(_TICK_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("%s: job failed", self.key)
            self.state.error = f"{type(exc).__name__}: {exc}"[:2000]
            await self._finish("failed")

    # --- what the drivers hand back -------------------------------------------
    async def _report(
        self,
        progress: dict[int, TrainerProgress],
        statuses: list[ShardStatus],
        trainer_silos: list[str] | None = None,
        stages: list[StageInfo] | None = None,
    ) -> None:
        """This tick's trainer progress (by rank) and shard statuses into the job's status."""
        s = self.state
        spec = s.spec
        assert spec is not None
        ps = list(progress.values())
        # A trainer that has not stepped yet (a start, a restart) reports loss 0.0: not a figure.
        stepped = [p for p in ps if p.steps_done]
        if ps:
            s.step = min(p.step for p in ps) if len(ps) == s.trainers else s.step
        if stepped:
            s.loss = sum(p.loss for p in stepped) / len(stepped)
            s.metrics = _mean_metrics([p.points[-1].metrics for p in stepped if p.points]) or s.metrics
        self._count(ps)
        rate = sum(p.samples_per_s for p in ps)
        per_step = sum((p.bytes_pushed + p.bytes_pulled) / p.steps_done for p in ps if p.steps_done)
        waits = [p.exchange_s / p.steps_done for p in ps if p.steps_done]
        exchange_ms = 1000 * sum(waits) / len(waits) if waits else 0.0
        done = self._evaluations.take()
        if done is not None:
            stop = await self._evaluations.after(*done)
            if stop is not None:
                await self._stop_early(done[0], stop)
                return
        for point in self._completed_steps(ps, rate):
            last = history.last_training_step(s.history)
            if history.add_training(s.history, point):
                self._recorded(point)
                self._republish = self._republish or (last is not None and point.step < last)  # points dropped
        self._evaluations.start_due()
        self._live = self._status_from_state(
            samples_per_s=rate,
            bytes_per_step=per_step,
            exchange_ms_per_step=exchange_ms,
            max_staleness=max([p.max_staleness for p in ps] + [st.max_staleness for st in statuses] + [0]),
            max_gap=max([p.max_gap for p in ps] + [st.max_gap for st in statuses] + [0]),
            trainer_silos=trainer_silos or [progress[j].silo if j in progress else "" for j in range(s.trainers)],
            stages=stages or [],
            shard_silos=[st.silo for st in statuses],
            skipped=max([p.skipped for p in ps] + [st.skipped for st in statuses] + [0]),
        )
        await self._log()
        if await self._publish():
            log.info("%s: cancel requested through the dashboard", self.key)
            await self._finish("cancelled")

    def _recorded(self, point: HistoryPoint) -> None:
        """A point the history gained: for the dashboard's stream and the loggers."""
        self._unpublished.append(point)
        if self.state.spec is not None and self.state.spec.loggers:
            self._unlogged.append(point)

    def _job_loggers(self) -> JobLoggers | None:
        s = self.state
        if s.spec is None or not s.spec.loggers:
            return None
        if self._loggers is None:
            # Steps past the history's newest were logged by no one who kept them (a resume from an
            # older checkpoint, a silo that died before its state write): TensorBoard drops them.
            after = history.last_training_step(s.history) or s.step
            self._loggers = JobLoggers(s.spec, self.key, s.run, s.mlflow_run_id or None, self.run_in_thread, after)
        return self._loggers

    async def _log(self, *, checkpoint: int | None = None, end: JobStatus | None = None) -> None:
        """The history's new points to the loggers (and a checkpoint, or the job's end); a
        logger's failure becomes a warning of the job's."""
        loggers = self._job_loggers()
        if loggers is None:
            return
        s = self.state
        points, self._unlogged = self._unlogged, []
        await loggers.points(points, s.total_steps)
        if checkpoint is not None:
            await loggers.checkpoint(checkpoint)
        if end is not None:
            await loggers.end(end, s.step)
            self._loggers = None
        s.mlflow_run_id = loggers.mlflow_run_id or s.mlflow_run_id
        failed = loggers.take_failures()
        if failed:
            s.warnings = [*s.warnings, *failed][-20:]
            self._live = self._live.model_copy(update={"warnings": list(s.warnings)})

    def _completed_steps(self, ps: list[TrainerProgress], rate: float) -> list[HistoryPoint]:
        """A training point for each step every trainer has completed since the last one: the
        mean of the trainers' points of that step (a trainer's reported points wait here until
        the slowest trainer is past them). A point's step counts steps done, as ``state.step``."""
        s = self.state
        last = history.last_training_step(s.history) or 0
        if s.step < last:  # went back (a rollback): what waits past it was abandoned
            self._step_points = {k: v for k, v in self._step_points.items() if k <= s.step}
            last = s.step
        for p in ps:
            for pt in p.points:
                if pt.step + 1 > last:
                    self._step_points.setdefault(pt.step + 1, {})[p.rank] = pt
        out = []
        for k in sorted(k for k in self._step_points if k <= s.step):
            pts = list(self._step_points.pop(k).values())
            out.append(HistoryPoint(step=k, loss=sum(pt.loss for pt in pts) / len(pts), samples_per_s=rate,
                                    metrics=_mean_metrics([pt.metrics for pt in pts]), at=max(pt.at for pt in pts) or time.time()))  # fmt: skip
        return out

    def _count(self, ps: list[TrainerProgress]) -> None:
        """Add the trainers' new steps since the last tick to the job's counters."""
        s = self.state
        assert s.spec is not None
        new = 0
        for p in ps:
            run = f"{p.activation_id}/{p.generation}/{p.rank}"
            before = self._counted.get(run, p.steps_done if self._count_from_now else 0)
            new += max(0, p.steps_done - before)
            self._counted[run] = p.steps_done
        self._count_from_now = False
        if new and s.trainers:
            s.steps_run += new / s.trainers
            s.samples_run += new * s.spec.trainer_batch

    async def _finish(self, status: JobStatus) -> None:
        s = self.state
        if s.status in _TERMINAL:
            return
        if status == "completed":
            if not s.stopped_early:
                stop = await self._evaluations.catch_up()
                if stop is not None:
                    await self._truncate(stop[0], f"stopped at step {stop[0]} by callback {stop[1]}")
            if not s.stopped_early:
                await self._evaluations.final()
            s.step = s.total_steps
        s.status = status
        s.finished_at = time.time()
        driver = self._job_driver()
        await driver.stop(status)
        # The job's state stays readable from its checkpoints: free the grains' memory.
        await driver.release()
        s.released = True
        if s.spec is not None and s.spec.callbacks:
            # Before the end is written or published: whoever sees the job ended (a client's
            # poll, the CLI) may count on its callbacks' on_end having run, as HF's Trainer
            # calls on_train_end before train() returns.
            try:
                callbacks = await self._job_callbacks()
                await self.run_in_thread(callbacks.on_end, status, s.step)
            except Exception as exc:  # noqa: BLE001 - the job has ended; nothing is left to fail
                log.warning("%s: %s", self.key, exc)
        await self._log(end=status)
        await self._write()
        self._live = self._status_from_state(
            samples_per_s=self._live.samples_per_s,
            bytes_per_step=self._live.bytes_per_step,
            exchange_ms_per_step=self._live.exchange_ms_per_step,
            stages=self._live.stages,
            max_staleness=self._live.max_staleness,
            max_gap=self._live.max_gap,
            trainer_silos=self._live.trainer_silos,
            shard_silos=self._live.shard_silos,
            skipped=self._live.skipped,
        )
        await self._publish()
        ttl = s.spec.ttl_after_finished_s if s.spec is not None else None
        if ttl is not None:
            # A durable reminder, so the job is forgotten on time whatever becomes of this silo.
            # The period is the retry of a forget cut short (its silo killed): soon, not a ttl later.
            await self.register_reminder(_FORGET, period_s=min(max(ttl, 1.0), 60.0), due_s=ttl)
        log.info("%s: job %s at step %d (evaluation %s)", self.key, status, s.step, s.eval_metrics)

    async def _write(self) -> None:
        async with self._write_lock:
            await self.write_state()

    # --- status ---------------------------------------------------------------
    async def _job_evaluator(self) -> Evaluator:
        return await self._evaluations.evaluator()

    async def _on_commit(self, step: int) -> None:
        """Checkpoint ``step`` was committed: due for evaluation, retention, the callbacks' ``on_checkpoint``."""
        self._evaluations.committed(step)
        await self._log(checkpoint=step)
        await self._checkpoints.prune(self._evaluations.evaluating)
        if self.state.spec is not None and self.state.spec.callbacks:
            callbacks = await self._job_callbacks()
            await self.run_in_thread(callbacks.on_checkpoint, step)

    async def _job_callbacks(self) -> Callbacks:
        spec = self.state.spec
        assert spec is not None
        if self._callbacks is None:
            self._callbacks = await self.run_in_thread(Callbacks, spec.callbacks)
        return self._callbacks

    async def _stop_early(self, step: int, callback: str) -> None:
        """A callback stopped the job at evaluated step ``step``: it completes as of that step."""
        await self._truncate(step, f"stopped at step {step} by callback {callback}")
        await self._finish("completed")

    async def _truncate(self, step: int, why: str) -> None:
        """The job ends at committed checkpoint ``step``: later ones are dropped, as a rollback drops them."""
        s = self.state
        log.info("%s: %s", self.key, why)
        s.stopped_early = why
        # The evaluated checkpoint is the result (retention may have moved past it in our list).
        s.committed = sorted({c for c in s.committed if c <= step} | {step})[-s.spec.keep_checkpoints :] if s.spec else [step]
        s.committed_at = {c: s.committed_at.get(c, time.time()) for c in s.committed}
        s.total_steps = step
        s.eval_pending = []
        history.truncate(s.history, step)  # the steps trained past it were abandoned with their checkpoints
        self._unlogged = [h for h in self._unlogged if h.step <= step]
        self._republish = True
        self._evaluations.stop()
        with contextlib.suppress(errors.RedgrainError):
            await checkpoint.drop_after(self, self.key, s.run, step)

    def _position(self) -> tuple[float, int, int]:
        """The data position at the current step: passes so far, and the epoch and offset it reads."""
        s = self.state
        if s.spec is None or not s.trainers:
            return 0.0, 0, 0
        schedule = DataSchedule.of(s.train_size, s.spec.trainer_batch, s.data_segments, s.trainers)
        step = max(s.step, schedule.segments[0].start_step)  # a resumed run's, before its first report
        epoch, offset, _ = schedule.position(step)
        return schedule.epochs_at(step), epoch, offset

    def _status_from_state(self, **live: Any) -> TrainingStatus:
        s = self.state
        end = s.finished_at or time.time()
        epochs, data_epoch, data_offset = self._position()
        return TrainingStatus(
            job=self.key, status=s.status, step=s.step, total_steps=s.total_steps, loss=s.loss,
            accuracy=s.accuracy, metrics=dict(s.metrics), eval_metrics=dict(s.eval_metrics), eval_step=s.eval_step,
            eval_silo=s.eval_silo, eval_device=s.eval_device,
            epoch=epochs, data_epoch=data_epoch, data_offset=data_offset, steps_run=s.steps_run, samples_run=s.samples_run, trainers=s.trainers, shards=len(s.shard_keys), generation=s.generation, run=s.run,
            checkpoints=list(s.committed), resumed_from=s.resumed_from, restarts=s.restarts, rollbacks=s.rollbacks, stopped_early=s.stopped_early, best_step=s.best_step,
            best_metric=(s.spec.keep_best or "").rpartition(":")[0] if s.spec is not None else "", best_value=s.best_value,
            elapsed_s=(end - s.started_at) if s.started_at else 0.0, error=s.error, warnings=list(s.warnings),
            trainer_keys=list(s.trainer_keys), shard_keys=list(s.shard_keys),
            mode=s.spec.mode if s.spec is not None else "", changes=list(s.changes), **live,
        )  # fmt: skip

    async def _publish(self) -> bool:
        """Write the dashboard's job record and the history's new points; True when an admin
        asked to cancel the job."""
        from grains.training.progress import publish

        s = self.state
        restart, self._republish = self._republish, False
        points, self._unpublished = (list(s.history) if restart else self._unpublished), []
        try:
            return await publish(workload(self), self._live, s.spec, s.trainer_keys, s.shard_keys, points=points,
                                 restart=restart, checkpoint_at=s.committed_at)  # fmt: skip
        except errors.RedgrainError as exc:
            # The next publish tries them again.
            self._unpublished, self._republish = [*points, *self._unpublished][-history.LIMIT :], restart
            if not self._last_publish_failed:
                log.warning("%s: publishing progress failed: %s", self.key, exc)
            self._last_publish_failed = True
            return False
