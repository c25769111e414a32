"""What a CoordinatorGrain asks of its job's driver, and what the two drivers share.

A coordinator owns one job and keeps its state (:class:`~grains.training.api.job_state.JobState`:
placement, generation, committed checkpoints, recovery records). How the job
is placed, watched and repaired depends on its mode, and that is a driver's:

- :class:`~grains.training.strategies.ps.driver.ParameterServerDriver` (modes ``sync``,
  ``async``, ``ssp``): parameter shards and trainers; a lost trainer is
  restarted alone, a lost shard rolls every grain back to the last committed
  checkpoint;
- :class:`~grains.training.strategies.allreduce.driver.AllreduceDriver` (mode
  ``allreduce``): a torch.distributed group of trainers, re-formed with a new
  generation whenever a member is lost or a trainer silo joins.

The coordinator's run loop (one background task of its activation) calls
:meth:`Driver.place_and_start` when nothing is placed yet, then
:meth:`Driver.tick` until the job ends; :meth:`Driver.stop` stops the job's
grains when it ends and :meth:`Driver.release` frees them, :meth:`Driver.tensors` serves
evaluation and export. A driver
works on the coordinator's state in place, and hands back to the coordinator
what is the coordinator's: saving that state (``_write``, one writer at a
time), turning the trainers' progress into the job's status, history and
dashboard record (``_report``) and ending the job (``_finish``).

A driver lives for one job in one activation. What it remembers (each
trainer's last progress, the step from which trainers report history) is
rebuilt from the trainers themselves after the coordinator re-activates.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from grains.base import Grain
from grains.ref import Ref
from grains.training.api.job_state import JobState
from grains.training.api.messages import GroupChange, JobStatus, ShardStatus, TrainerProgress
from grains.training.api.records import StageInfo
from grains.training.data.position import DataSchedule
from grains.training.state import checkpoint
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.state.store import CheckpointStoreGrain
from grains.training.strategies.elastic import SiloLook, TrainerSilos

log = logging.getLogger("redgrain.training.coordinator")

G = TypeVar("G", bound=Grain)

FINAL_CHECKPOINT_WAIT_S = 60.0
"""How long a finished job waits for its final checkpoint to be saved before completing without it."""
CALL_TIMEOUT_S = 10.0
INITIAL_SAVE_TIMEOUT_S = 120.0
"""The seeded model written whole to the job's store as checkpoint 0."""
"""Deadline of the driver's calls to shards and trainers (placement calls get longer ones)."""
_CHANGES = 20


class JobContext(Protocol):
    """What a driver may ask of the job it runs, and nothing more (the coordinator hands one to
    its driver). The grain API (calls, threads, membership, the checkpoint store) is the
    coordinator grain's own public one; what is the coordinator's business (saving its state,
    turning progress into status, ending the job) goes through these methods, never through
    its internals."""

    @property
    def grain(self) -> Grain:
        """The coordinator grain: ``get_grain``, ``run_in_thread``, membership, snapshots."""

    @property
    def key(self) -> str:
        """The job id."""

    @property
    def state(self) -> JobState:
        r"""The job's persisted state, which the driver updates in place and then :meth:`save`\ s."""

    async def save(self) -> None:
        """Write the job's state (one writer at a time)."""

    async def report(
        self, progress: dict[int, TrainerProgress], statuses: list[ShardStatus],
        trainer_silos: list[str] | None = None, stages: list[StageInfo] | None = None,
    ) -> None:  # fmt: skip
        """This tick's progress into the job's status, history and dashboard record."""

    async def finish(self, status: JobStatus) -> None:
        """End the job with ``status``."""

    async def committed(self, step: int) -> None:
        """Checkpoint ``step`` was committed (retention, callbacks)."""

    def show_shard_silos(self, silos: list[str]) -> None:
        """Where the job's shards are, for its status before the next report."""


class Driver(abc.ABC):
    """One mode's way of running a job, through its :class:`JobContext` ``job``."""

    trainer_type: ClassVar[type[Grain]]
    """The grain type of the job's trainers (also what ``silos`` watches)."""
    trainers_evaluate: ClassVar[bool] = True
    """Whether a trainer grain holds the whole model, so it can evaluate the job's checkpoints on
    its silo (``evaluate(job, spec, run, step)``); pipeline stages hold a part."""

    def __init__(self, job: JobContext, silos: TrainerSilos) -> None:
        self.job = job
        self.silos = silos
        self.progress: dict[int, TrainerProgress] = {}
        """Each trainer's last progress of the current generation, by rank."""
        self.cursor = 0
        """Trainers report the history points from this step on (the ones not yet seen)."""
        self._final_wait: float | None = None

    # --- what the coordinator asks ------------------------------------------
    def placed(self) -> bool:
        """Whether the state names grains to re-attach to (a re-activated coordinator's): its
        trainers (a parameter server's shards say it instead)."""
        return bool(self.state.trainer_keys)

    @abc.abstractmethod
    async def place_and_start(self) -> None:
        """Place the job's grains, start them, and set the job running."""

    @abc.abstractmethod
    async def tick(self) -> None:
        """Look at every grain once, repair what is lost, commit, report; finish when done."""

    @abc.abstractmethod
    async def tensors(self) -> dict[str, torch.Tensor]:
        """The current fp32 parameters and buffers by name (the model's state)."""

    async def stop(self, status: JobStatus) -> None:
        """The job ended with ``status``: stop its trainers (errors ignored: they may be gone)."""
        await asyncio.gather(*(t.stop() for t in self.trainers()), return_exceptions=True)

    async def release(self) -> None:
        """The job ended and its state is in its checkpoints: its grains free their memory."""
        await asyncio.gather(*(t.release() for t in self.trainers()), return_exceptions=True)

    def final_committed(self) -> bool:
        """Whether the job's last step is a committed checkpoint (a completed job's result)."""
        s = self.state
        if s.total_steps in s.committed:
            return True
        if self._final_wait is None:
            self._final_wait = time.monotonic()
        if time.monotonic() - self._final_wait > FINAL_CHECKPOINT_WAIT_S:
            # Saving it keeps failing (storage): complete anyway, with the grains kept.
            log.warning("%s: the final checkpoint (step %d) was not saved; completing without it", self.key, s.total_steps)
            return True
        return False

    # --- shared by both modes -----------------------------------------------
    @property
    def state(self) -> JobState:
        return self.job.state

    def failed_at(self, step: int, why: str) -> RuntimeError:
        """The error that fails the job, its status set to ``step``: the step the failing trainer
        was running, which the last tick's report may not have reached (a job failed at step 20
        read "step 0/60")."""
        self.state.step = step
        return RuntimeError(why)

    @property
    def key(self) -> str:
        return self.job.key

    def ref(self, cls: type[G], key: str, timeout_s: float = CALL_TIMEOUT_S) -> Ref[G]:
        return self.job.grain.get_grain(cls, key).with_timeout(timeout_s)

    def look(self) -> SiloLook:
        """Membership for this job: trainer silos, less those it shed (out of memory there)."""
        return self.silos.look(self.job.grain).excluding(self.state.shed_silos)

    def shed(self, silo: str, why: str) -> bool:
        """An elastic job (``trainers = "auto"``) stops placing trainers on ``silo`` after a trainer
        ran out of memory there; False when the job cannot shed it (fixed trainer count, or the
        last trainer silo): then the job fails with ``why``."""
        s = self.state
        assert s.spec is not None
        if s.spec.trainers != "auto" or silo in s.shed_silos or len(self.look().eligible) <= 1:
            return False
        log.warning("%s: shedding trainer silo %s: %s", self.key, silo, why[:200])
        s.shed_silos = [*s.shed_silos, silo]
        return True

    def trainers(self) -> list[Any]:
        return [self.ref(self.trainer_type, k) for k in self.state.trainer_keys]

    async def commit_initial(self, initial: TrainingSnapshot) -> int:
        """Save the seeded weights ``initial`` as the run's committed checkpoint 0 (a fresh start),
        so every holder restores its part of a checkpoint instead of building the whole model for
        it; a rollback before the first checkpoint comes back to it. Returns 0."""
        s = self.state
        assert s.spec is not None
        store = self.ref(CheckpointStoreGrain, self.key, INITIAL_SAVE_TIMEOUT_S)
        await store.save_whole(s.run, initial, checkpoint.retained(s.spec))
        s.committed, s.committed_at = [0], {0: time.time()}
        return 0

    def evaluator(self, timeout_s: float) -> Any | None:
        """The grain that evaluates the job's checkpoints where the job trains: the rank-0
        trainer's (:mod:`grains.training.evaluation`); None: the coordinator evaluates."""
        keys = self.state.trainer_keys
        return self.ref(self.trainer_type, keys[0], timeout_s) if self.trainers_evaluate and keys else None

    def resize_data(self, step: int, trainers: int) -> None:
        """From ``step`` on, ``trainers`` trainers take the data, from the next unseen sample there
        (:mod:`grains.training.data.position`); later segments, abandoned by a rollback, are
        dropped. An epochs job's last step follows, so it ends after its epochs whatever the
        trainer count did; a steps job's stays ``steps``."""
        s = self.state
        spec = s.spec
        assert spec is not None
        schedule = DataSchedule.of(s.train_size, spec.trainer_batch, s.data_segments, trainers)
        try:
            schedule = schedule.resized(step, trainers)
        except ValueError:  # restored before the first segment (a resume's); start the position there
            first = schedule.segments[0]
            log.warning("%s: step %d is before the data position's first step %d", self.key, step, first.start_step)
            schedule = schedule.model_copy(update={"segments": [first.model_copy(update={"start_step": step, "trainers": trainers})]})
        s.data_segments = list(schedule.segments)
        s.total_steps = spec.steps if spec.steps is not None else schedule.end_step(spec.epochs or 1.0)

    def note_change(
        self, generation: int, reason: str, trainers: int, start_step: int, ranks: list[int] | None = None
    ) -> None:
        """Record one recovery or resize (the newest ``_CHANGES`` are kept)."""
        s = self.state
        change = GroupChange(
            generation=generation, reason=reason, at=time.time(), trainers=trainers, start_step=start_step, ranks=ranks or []
        )
        s.changes = [*s.changes, change][-_CHANGES:]

    async def commit_step(self, newest: int | None) -> bool:
        """Record checkpoint ``newest`` as committed; True when it is new."""
        s = self.state
        assert s.spec is not None
        if newest is None or (s.committed and newest <= s.committed[-1]):
            return False
        # The store keeps the newest keep_checkpoints complete snapshots; so do we.
        s.committed = [*s.committed, newest][-s.spec.keep_checkpoints :]
        s.committed_at = {c: s.committed_at.get(c, time.time()) for c in s.committed}
        await self.job.save()
        await self.job.committed(newest)
        return True

    async def report(
        self, shards: list[ShardStatus], trainer_silos: list[str] | None = None, stages: list[StageInfo] | None = None
    ) -> None:
        """Hand this tick's progress to the coordinator's status; ask for newer points next time."""
        steps = [pt.step for p in self.progress.values() for pt in p.points]
        if steps:
            self.cursor = max(steps) + 1
        await self.job.report(self.progress, shards, trainer_silos, stages)
