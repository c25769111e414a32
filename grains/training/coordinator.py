"""CoordinatorGrain: owns a job (key = job id), drives it, and brings it back after failures.

``start(spec)`` checks the spec (a bad one raises ConfigError before anything
starts), saves it and starts the driver, a background task of the activation;
``status()`` and ``cancel()`` are answered while it runs. The driver places
shards and trainers, then every ``_TICK_S`` asks each shard and trainer how
it is doing and repairs what it finds:

- a trainer lost, restarted or failed (shards intact): its slot is run again,
  from the step the shards expect from it; the others go on;
- a shard lost (its activation changed, or it refuses our generation): a
  *rollback*: a new generation, every shard restores the last committed
  checkpoint, every trainer restarts from that step;
- the coordinator itself re-activated (its silo died): its state says the job
  is running, so ``on_activate`` starts the driver again, which re-attaches
  to the shards and trainers, rolling back only if a shard was lost too.

Checkpoint step ``c`` is committed once every shard has saved it; the newest
``keep_checkpoints`` are kept. Progress goes to the dashboard's job record
each tick.

Elastic growth (both modes, :mod:`grains.training.elastic` answers which
silos may host trainers): with ``trainers = "auto"`` a trainer silo that joins
gets a trainer. In parameter-server mode that happens at the next committed
checkpoint (a new generation restores it with one more slot, so nothing is
lost); in ``allreduce`` mode at the next group generation.

Mode ``allreduce`` has no shards: the driver forms a torch.distributed group
of :class:`AllreduceTrainerGrain`s, one per trainer silo (at most
``trainers``), and re-forms it with a new generation whenever a member's silo
leaves, a member fails, or a trainer silo joins; the new group starts from the
newest step a survivor holds (see :mod:`grains.training.allreduce`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import torch
from pydantic import BaseModel, Field

from grains.base import DeactivationReason, Grain
from grains.placement import hash_placement, keep_alive
from grains.training import checkpointing, cluster
from grains.training.allreduce import AllreduceTrainerGrain
from grains.training.datasets import Batches, load_dataset
from grains.training.elastic import SiloLook, TrainerSilos
from grains.training.job import TrainingJob, check_job, parse_job
from grains.training.messages import (
    GroupAssignment,
    GroupChange,
    HistoryPoint,
    JobStatus,
    ShardConfig,
    ShardStatus,
    TrainerAssignment,
    TrainerProgress,
    TrainingStatus,
)
from grains.training.models import build_model
from grains.training.shard import ParamShardGrain
from grains.training.trainer import TrainerGrain
from silo import errors

log = logging.getLogger("redgrain.training.coordinator")

_TICK_S = 0.2
_CALL_TIMEOUT_S = 10.0
_HISTORY = 2000
_MAX_SLOT_FAILURES = 5
_TERMINAL = ("completed", "failed", "cancelled")
_CHANGES = 20


def split_by_bytes(sizes: dict[str, int], shards: int) -> list[list[str]]:
    """Tensors to shards, biggest first onto the lightest shard; model order kept within a shard."""
    order = {n: i for i, n in enumerate(sizes)}
    loads = [0] * shards
    parts: list[list[str]] = [[] for _ in range(shards)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], order[n])):
        i = min(range(shards), key=lambda k: (loads[k], k))
        parts[i].append(name)
        loads[i] += sizes[name]
    return [sorted(p, key=order.__getitem__) for p in parts if p]


class _Evaluator:
    """The model and test split for accuracy checks (built once per activation, used off the loop)."""

    def __init__(self, spec: TrainingJob) -> None:
        self.model = build_model(spec)
        self.params = dict(self.model.named_parameters())
        self.x, self.y = Batches(load_dataset(spec, "test")).all(limit=10_000)

    def accuracy(self, params: dict[str, torch.Tensor]) -> tuple[float, float]:
        with torch.no_grad():
            for n, t in params.items():
                self.params[n].copy_(t)
            out = self.model(self.x)
            loss = torch.nn.functional.cross_entropy(out, self.y)
            return float((out.argmax(1) == self.y).float().mean()), float(loss)


@keep_alive
@hash_placement
class CoordinatorGrain(Grain):
    class State(BaseModel):
        spec: TrainingJob | None = None
        status: JobStatus = "idle"
        generation: int = 0
        run: int = 0
        slots: int = 0
        total_steps: int = 0
        shard_keys: list[str] = Field(default_factory=list)
        shard_names: list[list[str]] = Field(default_factory=list)
        shard_activations: list[str] = Field(default_factory=list)
        trainer_keys: list[str] = Field(default_factory=list)
        trainer_silos: list[str] = Field(default_factory=list)
        """Silo each trainer key was placed on (allreduce: by rank)."""
        next_trainer: int = 0
        """Number for the next new trainer key (keys are never reused within a run)."""
        changes: list[GroupChange] = Field(default_factory=list)
        committed: list[int] = Field(default_factory=list)
        step: int = 0
        loss: float | None = None
        accuracy: float | None = None
        started_at: float = 0.0
        finished_at: float = 0.0
        restarts: int = 0
        rollbacks: int = 0
        error: str = ""
        history: list[HistoryPoint] = Field(default_factory=list)

    def __init__(self) -> None:
        self._driver: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._progress: dict[int, TrainerProgress] = {}
        self._slot_failures: dict[int, int] = {}
        self._cursor = 0
        self._live = TrainingStatus(job="")
        self._evaluator: _Evaluator | None = None
        self._last_eval_step = 0
        self._last_publish_failed = False
        self._silos: TrainerSilos | None = None

    async def on_activate(self) -> None:
        self._live = self._status_from_state()
        if self.state.status in ("starting", "running"):
            log.info("%s: re-activated with the job running; resuming", self.key)
            self._driver = self.start_task(self._drive(resume=True), name=f"{self.key} driver")

    async def on_deactivate(self, reason: DeactivationReason) -> None:
        self._driver = None

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
        old = self.state
        if job.resume and not old.committed:
            raise errors.ConfigError(f"job {self.key} has no committed checkpoint to resume from")
        self.state = self.State(
            spec=job, status="starting", generation=old.generation + 1, run=old.generation + 1, started_at=time.time()
        )
        if job.resume:
            # Same run, so the same checkpoint group: the new start (in any mode) restores
            # the newest committed step and keeps checkpointing next to it.
            s = self.state
            s.run, s.committed, s.next_trainer, s.changes = old.run, list(old.committed), old.next_trainer, old.changes
        await self._write()
        self._reset_memory()
        self._live = self._status_from_state()
        self._driver = self.start_task(self._drive(resume=False), name=f"{self.key} driver")
        return await self.status()

    async def status(self) -> TrainingStatus:
        """The job's progress: step, loss, accuracy, samples/s, bytes per step, checkpoints."""
        return self._live.model_copy(update={"coordinator_silo": str(self.silo)})

    async def cancel(self) -> TrainingStatus:
        """Stop the job: trainers stop, shards refuse further pushes; the state says cancelled."""
        if self.state.status in ("starting", "running"):
            driver, self._driver = self._driver, None
            if driver is not None and driver is not asyncio.current_task():
                driver.cancel()
                await asyncio.gather(driver, return_exceptions=True)
            await self._finish("cancelled")
        return await self.status()

    async def history(self) -> list[HistoryPoint]:
        """Per-tick progress points since the job started."""
        return list(self.state.history)

    async def parameters(self) -> dict[str, torch.Tensor]:
        """The current fp32 weights, gathered from every shard (for evaluation and tests)."""
        if self.state.spec is not None and self.state.spec.mode == "allreduce":
            return await self._group_parameters()
        out: dict[str, torch.Tensor] = {}
        for part in await asyncio.gather(*(s.parameters() for s in self._shards())):
            out.update(part)
        return out

    # --- the driver ---------------------------------------------------------
    def _reset_memory(self) -> None:
        self._progress.clear()
        self._slot_failures.clear()
        self._cursor = 0
        self._last_eval_step = 0

    def _ref(self, cls: type[Grain], key: str, timeout_s: float = _CALL_TIMEOUT_S) -> Any:
        ref: Any = self.get_grain(cls, key)
        return ref.with_timeout(timeout_s)

    def _shards(self) -> list[Any]:
        return [self._ref(ParamShardGrain, k) for k in self.state.shard_keys]

    def _trainers(self) -> list[Any]:
        return [self._ref(self._trainer_cls(), k) for k in self.state.trainer_keys]

    def _trainer_cls(self) -> type[Grain]:
        spec = self.state.spec
        return AllreduceTrainerGrain if spec is not None and spec.mode == "allreduce" else TrainerGrain

    def _watch(self) -> TrainerSilos:
        spec = self.state.spec
        assert spec is not None
        name = self._trainer_cls().__name__
        if self._silos is None or self._silos.type_name != name or self._silos.role != spec.trainer_role:
            self._silos = TrainerSilos(name, spec.trainer_role)
        return self._silos

    async def _drive(self, *, resume: bool) -> None:
        try:
            s = self.state
            placed = s.trainer_keys if s.spec is not None and s.spec.mode == "allreduce" else s.shard_keys
            if not resume or not placed:
                # Re-activated with a group in place: re-attach; the first tick re-forms it if a
                # member was lost with this silo.
                await self._place_and_start()
            while self.state.status in ("starting", "running"):
                try:
                    await self._tick()
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

    async def _place_and_start(self) -> None:
        spec = self.state.spec
        assert spec is not None
        if spec.mode == "allreduce":
            await self._start_group()
            return
        sizes = await self.run_in_thread(check_job, spec)
        shard_rows = cluster.hosting_silos(self, "ParamShardGrain")
        trainer_rows = cluster.trainer_silos(cluster.hosting_silos(self, "TrainerGrain"), spec.trainer_role)
        if not trainer_rows or not shard_rows:
            raise errors.ConfigError("no active silo hosts the training grains (start silos with --grains grains.training)")
        slots = len(trainer_rows) if spec.trainers == "auto" else int(spec.trainers)
        names = split_by_bytes(sizes, spec.shards)
        train_size = len(await self.run_in_thread(load_dataset, spec, "train"))  # type: ignore[arg-type]
        all_trainer_rows = cluster.hosting_silos(self, "TrainerGrain")
        # Shards start on the silos after the first trainers', so a 2-silo job spreads both.
        shard_keys = [
            cluster.key_on("ParamShardGrain", f"{self.key}/shard-{i}", shard_rows[(i + 1) % len(shard_rows)].silo, shard_rows)
            for i in range(len(names))
        ]
        trainer_keys = [
            cluster.key_on("TrainerGrain", f"{self.key}/trainer-{j}", trainer_rows[j % len(trainer_rows)].silo, all_trainer_rows)
            for j in range(slots)
        ]
        s = self.state
        s.slots, s.shard_keys, s.shard_names, s.trainer_keys = slots, shard_keys, names, trainer_keys
        s.trainer_silos = [str(trainer_rows[j % len(trainer_rows)].silo) for j in range(slots)]
        s.next_trainer = slots
        s.total_steps = spec.total_steps(train_size, slots)
        restore = s.committed[-1] if s.committed else None  # resuming: the previous start's checkpoint
        await self._configure_shards(restore)
        await asyncio.gather(*(self._run_slot(j, restore or 0) for j in range(slots)))
        s.status = "running"
        await self._write()

    async def _configure_shards(self, restore_step: int | None) -> None:
        s = self.state
        assert s.spec is not None
        cfgs = [
            ShardConfig(job=self.key, index=i, spec=s.spec, names=names, shard_keys=s.shard_keys, slots=s.slots,
                        generation=s.generation, run=s.run, restore_step=restore_step)
            for i, names in enumerate(s.shard_names)
        ]
        shards = [self._ref(ParamShardGrain, k, 120.0) for k in s.shard_keys]
        statuses: list[ShardStatus] = await asyncio.gather(*(sh.configure(c) for sh, c in zip(shards, cfgs, strict=True)))
        s.shard_activations = [st.activation_id for st in statuses]
        self._live.shard_silos = [st.silo for st in statuses]

    async def _run_slot(self, slot: int, start_step: int) -> None:
        s = self.state
        assert s.spec is not None
        a = TrainerAssignment(
            job=self.key, slot=slot, slots=s.slots, spec=s.spec, generation=s.generation, run=s.run,
            start_step=start_step, end_step=s.total_steps, shard_keys=s.shard_keys, shard_names=s.shard_names,
        )  # fmt: skip
        await self._ref(TrainerGrain, s.trainer_keys[slot], 120.0).run(a)

    async def _rollback(self, why: str) -> None:
        s = self.state
        assert s.spec is not None
        s.generation += 1
        s.rollbacks += 1
        restore = await self._restore_point()
        log.warning("%s: %s; rolling back to %s (generation %d)", self.key, why,
                    f"checkpoint {restore}" if restore is not None else "the start", s.generation)  # fmt: skip
        self._note_change(s.generation, why, s.slots, restore or 0)
        await self._write()
        await asyncio.gather(*(t.stop() for t in self._trainers()), return_exceptions=True)
        await self._configure_shards(restore)
        self._progress.clear()
        self._cursor = restore or 0
        await asyncio.gather(*(self._run_slot(j, restore or 0) for j in range(s.slots)))
        await self._write()

    async def _restore_point(self) -> int | None:
        """The checkpoint a rollback restores, and the later ones it abandons (deleted).

        Ours is ``committed[-1]``; but shards can complete several checkpoints between
        two of our ticks, so retention may already have dropped it while newer ones,
        which our list never saw (their shard's last status did not reach us), are
        complete in the store: then the store's newest is the one.
        """
        s = self.state
        restore = s.committed[-1] if s.committed else None
        if restore is None or not await checkpointing.exists(self, self.key, s.run, restore):
            newest = await checkpointing.newest_step(self, self.key, s.run)
            if newest is not None and (restore is None or newest > restore):
                log.info("%s: checkpoint %s is gone; the store's newest complete one is %d", self.key, restore, newest)
                await self._commit_step(newest)
                restore = newest
        if await checkpointing.drop_after(self, self.key, s.run, restore):
            log.info("%s: dropped checkpoints after %s (abandoned by the rollback)", self.key, restore)
        return restore

    async def _tick(self) -> None:
        s = self.state
        assert s.spec is not None
        if s.spec.mode == "allreduce":
            await self._tick_group()
            return
        shard_results = await asyncio.gather(*(sh.status() for sh in self._shards()), return_exceptions=True)
        if any(isinstance(r, BaseException) for r in shard_results):
            # Unreachable is not lost: a busy silo answers later, and a dead one's shard is
            # re-activated elsewhere by a later call, which then reports the wrong generation.
            return
        lost = [
            s.shard_keys[i]
            for i, r in enumerate(shard_results)
            if r.generation != s.generation or r.activation_id != s.shard_activations[i]  # type: ignore[union-attr]
        ]
        if lost:
            try:
                await self._rollback(f"shard(s) {', '.join(lost)} lost or behind")
            except errors.RedgrainError as exc:
                # A silo is dead but not yet declared so; the next tick tries again.
                log.warning("%s: rollback incomplete (%s); retrying", self.key, exc)
            return
        statuses: list[ShardStatus] = shard_results  # type: ignore[assignment]
        results = await asyncio.gather(
            *(t.progress(self._cursor) for t in self._trainers()), return_exceptions=True
        )
        done = 0
        restarted: list[tuple[int, int, str]] = []
        for j, r in enumerate(results):
            if isinstance(r, TrainerProgress) and r.generation == s.generation and r.status in ("running", "done"):
                if self._progress.get(j) is None or r.steps_done != self._progress[j].steps_done:
                    self._slot_failures[j] = 0
                self._progress[j] = r
                done += r.status == "done"
                continue
            if isinstance(r, BaseException):
                continue  # busy or dead: a later call answers, or re-activates it idle elsewhere
            why = r.error or r.status
            if r.status == "failed" and r.generation == s.generation:
                self._slot_failures[j] = self._slot_failures.get(j, 0) + 1
                if self._slot_failures[j] > _MAX_SLOT_FAILURES:
                    raise RuntimeError(f"trainer slot {j} keeps failing: {why}")
            start = min(st.next_steps[j] for st in statuses)
            log.warning("%s: trainer slot %d lost or stopped (%s); restarting it at step %d", self.key, j, why[:200], start)
            s.restarts += 1
            self._progress.pop(j, None)  # the lost run's counters; the restarted run reports anew
            restarted.append((j, start, why[:200]))
            with contextlib.suppress(errors.RedgrainError):
                await self._run_slot(j, start)
        if restarted:
            why = "; ".join(f"trainer slot {j} restarted at step {start} ({w})" for j, start, w in restarted)
            self._note_change(s.generation, why, s.slots, min(st for _, st, _ in restarted), [j for j, _, _ in restarted])
        self._note_first_step()
        committed = await self._commit(statuses)
        await self._report(statuses)
        if done == s.slots:
            await self._finish("completed")
        elif committed and s.spec.trainers == "auto":
            await self._grow_at_checkpoint()

    async def _commit(self, statuses: list[ShardStatus]) -> bool:
        common = set(statuses[0].saved_steps).intersection(*(st.saved_steps for st in statuses[1:]))
        # Every complete snapshot counts, not just the newest: a slow tick may find two at once.
        last = self.state.committed[-1] if self.state.committed else -1
        committed = False
        for step in sorted(c for c in common if c > last):
            committed = await self._commit_step(step) or committed
        return committed

    async def _commit_step(self, newest: int | None) -> bool:
        """Record checkpoint ``newest`` as committed; True when it is new."""
        s = self.state
        assert s.spec is not None
        if newest is None or (s.committed and newest <= s.committed[-1]):
            return False
        # The store keeps the newest keep_checkpoints complete snapshots; so do we.
        s.committed = [*s.committed, newest][-s.spec.keep_checkpoints :]
        await self._write()
        return True

    async def _grow_at_checkpoint(self) -> None:
        """Parameter-server mode, trainers 'auto': give each trainer silo that has none a trainer.

        Done right after a checkpoint is committed: a new generation restores it with the
        extra slots (the data re-split over them), so almost no work is lost.
        """
        s = self.state
        if len(s.trainer_silos) != len(s.trainer_keys):
            return  # placed by an older version: where the trainers are is not known
        look = self._watch().look(self)
        joined = look.without_trainer(s.trainer_silos)
        if not joined:
            return
        for row in joined:
            key = cluster.key_on("TrainerGrain", f"{self.key}/trainer-{s.next_trainer}", row.silo, look.hosting)
            s.next_trainer += 1
            s.trainer_keys.append(key)
            s.trainer_silos.append(row.address)
        s.slots = len(s.trainer_keys)
        why = f"trainer silo(s) {', '.join(r.address for r in joined)} joined"
        try:
            await self._rollback(why)
        except errors.RedgrainError as exc:
            log.warning("%s: growing to %d trainers incomplete (%s); retrying", self.key, s.slots, exc)

    def _note_change(
        self, generation: int, reason: str, world: int, start_step: int, slots: list[int] | None = None
    ) -> None:
        s = self.state
        change = GroupChange(
            generation=generation, reason=reason, at=time.time(), world=world, start_step=start_step, slots=slots or []
        )
        s.changes = [*s.changes, change][-_CHANGES:]

    # --- allreduce mode -------------------------------------------------------
    async def _start_group(self) -> None:
        s = self.state
        spec = s.spec
        assert spec is not None
        await self.run_in_thread(check_job, spec)
        look = self._watch().look(self)
        if not look.eligible:
            raise errors.ConfigError(
                "no active silo hosts the training grains (start silos with --grains grains.training)"
            )
        world = len(look.eligible) if spec.trainers == "auto" else min(int(spec.trainers), len(look.eligible))
        train_size = len(await self.run_in_thread(load_dataset, spec, "train"))  # type: ignore[arg-type]
        s.total_steps = spec.total_steps(train_size, world)
        s.trainer_keys, s.trainer_silos, s.slots = [], [], 0
        await self._reform("job started")
        s.status = "running"
        await self._write()

    def _wanted(self, look: SiloLook) -> int:
        spec = self.state.spec
        assert spec is not None
        return len(look.eligible) if spec.trainers == "auto" else min(int(spec.trainers), len(look.eligible))

    async def _tick_group(self) -> None:
        s = self.state
        look = self._watch().look(self)
        alive = look.alive
        lost = [k for k, silo in zip(s.trainer_keys, s.trainer_silos, strict=True) if silo not in alive]
        refs = [self._ref(AllreduceTrainerGrain, k) for k in s.trainer_keys]
        results = await asyncio.gather(*(r.progress(self._cursor) for r in refs), return_exceptions=True)
        broken: list[str] = []
        done = 0
        for rank, r in enumerate(results):
            if isinstance(r, BaseException):
                continue  # busy or dying: membership (or the next tick) tells
            if r.generation != s.generation or r.status in ("idle", "failed"):
                broken.append(f"{s.trainer_keys[rank]} {r.status}{': ' + r.error[:200] if r.error else ''}")
                continue
            self._progress[rank] = r
            done += r.status == "done"
        placed = [silo for silo in s.trainer_silos if silo in alive]
        joined = look.without_trainer(placed)[: max(0, self._wanted(look) - len(placed))]
        if lost or broken or joined or not s.trainer_keys:
            why = "; ".join(
                [f"lost {', '.join(lost)}"] * bool(lost)
                + [f"broken {', '.join(broken)}"] * bool(broken)
                + [f"silo(s) {', '.join(r.address for r in joined)} joined"] * bool(joined)
            ) or "no trainers"
            try:
                await self._reform(why)
            except errors.RedgrainError as exc:
                log.warning("%s: re-forming the group failed (%s); retrying", self.key, exc)
            return
        self._note_first_step()
        for step in sorted({c for p in self._progress.values() if p.rank == 0 for c in p.saved_steps}):
            await self._commit_step(step)  # every checkpoint rank 0 completed, oldest first
        await self._report([])
        if done == len(s.trainer_keys):
            await self._finish("completed")

    async def _reform(self, why: str) -> None:
        """Replace the group: stop the members, pick the new ones, start them from the newest state."""
        s = self.state
        spec = s.spec
        assert spec is not None
        watch = self._watch()
        look = watch.look(self)
        s.generation += 1
        await self._write()
        # Stop the old members first (never calling one whose silo is gone: that would
        # activate it again elsewhere); one that does not answer is left out.
        olds = [(k, silo) for k, silo in zip(s.trainer_keys, s.trainer_silos, strict=True) if silo in look.alive]
        # stop() returns once the member's step thread has left (its compute may take a while);
        # a hung member's silo is declared dead meanwhile, which fails the call.
        stopped = await asyncio.gather(
            *(self._ref(AllreduceTrainerGrain, k, spec.step_timeout_s).stop() for k, _ in olds),
            return_exceptions=True,
        )
        survivors: list[tuple[str, str, TrainerProgress]] = []
        for (key, silo), r in zip(olds, stopped, strict=True):
            if isinstance(r, TrainerProgress):
                survivors.append((key, silo, r))
            else:
                log.warning("%s: trainer %s on %s did not answer (%s); leaving it out", self.key, key, silo, r)
                watch.quarantine(silo)
        look = watch.look(self)
        eligible = {r.address for r in look.eligible}
        want = self._wanted(look)
        members: list[tuple[str, str]] = []
        for key, silo, _ in survivors:
            if silo in eligible and silo not in {m[1] for m in members} and len(members) < want:
                members.append((key, silo))
        for row in look.without_trainer([m[1] for m in members])[: max(0, want - len(members))]:
            key = cluster.key_on("AllreduceTrainerGrain", f"{self.key}/trainer-{s.next_trainer}", row.silo, look.hosting)
            s.next_trainer += 1
            members.append((key, row.address))
        # The newest state a survivor holds (members or not: any can serve a copy).
        held = [(p.held_step, key) for key, _, p in survivors if p.held_run == s.run and p.held_step >= 0]
        best_step, best_key = max(held, default=(-1, None))
        floor = s.committed[-1] if s.committed else 0
        if best_key is not None and best_step >= floor:
            start, source, restore = best_step, best_key, None
        elif s.committed:
            start, source, restore = floor, None, floor
        else:
            start, source, restore = 0, None, None
        s.trainer_keys = [k for k, _ in members]
        s.trainer_silos = [silo for _, silo in members]
        s.slots = len(members)
        self._progress.clear()
        self._cursor = start
        self._note_change(s.generation, why, len(members), start)
        await self._write()
        if not members:
            log.warning("%s: no trainer silo available; waiting for one", self.key)
            return
        log.info("%s: group generation %d: %d trainer(s) from step %d (%s)", self.key, s.generation,
                 len(members), start, why)  # fmt: skip
        backend = "nccl" if look.all_gpu(s.trainer_silos) else "gloo"
        await asyncio.gather(
            *(
                self._ref(AllreduceTrainerGrain, key, 60.0).join(
                    self._assignment(rank, backend, start, None if source == key else source, restore)
                )
                for rank, key in enumerate(s.trainer_keys)
            )
        )

    def _assignment(self, rank: int, backend: str, start: int, source: str | None, restore: int | None) -> GroupAssignment:
        s = self.state
        assert s.spec is not None
        # Generations only grow (across runs of a job id too), so each prefix is used by one group.
        rendezvous = self.rendezvous_prefix(self.key, s.generation)
        return GroupAssignment(
            job=self.key, run=s.run, spec=s.spec, generation=s.generation, rank=rank, world=len(s.trainer_keys),
            members=list(s.trainer_keys), rendezvous=rendezvous, backend=backend,  # type: ignore[arg-type]
            start_step=start, end_step=s.total_steps, source=source, restore_step=restore,
        )  # fmt: skip

    def _note_first_step(self) -> None:
        """Fill in when the current generation committed its first step (recovery time)."""
        s = self.state
        if not s.changes or s.changes[-1].generation != s.generation or s.changes[-1].first_step_at is not None:
            return
        change = s.changes[-1]
        if s.spec is not None and s.spec.mode != "allreduce":
            # Parameter-server mode: every restarted slot's new run has committed a step.
            slots = change.slots or list(range(s.slots))
            firsts = [self._progress[j].first_step_at if j in self._progress else None for j in slots]
            if all(t is not None for t in firsts):
                change.first_step_at = max(t for t in firsts if t is not None)
            return
        times = [pt.at for p in self._progress.values() for pt in p.points if pt.step == change.start_step]
        if len(times) == len(s.trainer_keys) and times:
            change.first_step_at = max(times)

    async def _group_parameters(self) -> dict[str, torch.Tensor]:
        """The weights from a group member holding the newest step."""
        s = self.state
        refs = [self._ref(AllreduceTrainerGrain, k) for k in s.trainer_keys]
        results = await asyncio.gather(*(r.progress(1 << 62) for r in refs), return_exceptions=True)
        held = [(r.held_step, i) for i, r in enumerate(results) if isinstance(r, TrainerProgress) and r.held_run == s.run]
        if not held:
            raise errors.ConfigError(f"job {self.key}: no trainer holds the parameters")
        step, i = max(held)
        snap = await refs[i].replica(s.run, step)
        return dict(snap.params)

    async def _report(self, statuses: list[ShardStatus]) -> None:
        s = self.state
        spec = s.spec
        assert spec is not None
        progress = list(self._progress.values())
        if progress:
            s.step = min(p.step for p in progress) if len(progress) == s.slots else s.step
            s.loss = sum(p.loss for p in progress) / len(progress)
            points = sorted((pt for p in progress for pt in p.points), key=lambda pt: pt.step)
            if points:
                self._cursor = points[-1].step + 1
        rate = sum(p.samples_per_s for p in progress)
        per_step = sum((p.bytes_pushed + p.bytes_pulled) / p.steps_done for p in progress if p.steps_done)
        if spec.eval_every and s.step - self._last_eval_step >= spec.eval_every:
            self._last_eval_step = s.step
            s.accuracy, _ = await self._evaluate()
        s.history.append(HistoryPoint(step=s.step, loss=s.loss or 0.0, accuracy=s.accuracy, samples_per_s=rate, at=time.time()))
        del s.history[:-_HISTORY]
        self._live = self._status_from_state(
            samples_per_s=rate,
            bytes_per_step=per_step,
            max_staleness=max([p.max_staleness for p in progress] + [st.max_staleness for st in statuses] + [0]),
            max_gap=max([p.max_gap for p in progress] + [st.max_gap for st in statuses] + [0]),
            trainer_silos=[self._progress[j].silo if j in self._progress else "" for j in range(s.slots)],
            shard_silos=[st.silo for st in statuses],
        )
        if await self._publish():
            log.info("%s: cancel requested through the dashboard", self.key)
            await self._finish("cancelled")

    async def _evaluate(self) -> tuple[float, float]:
        spec = self.state.spec
        assert spec is not None
        if self._evaluator is None:
            self._evaluator = await self.run_in_thread(_Evaluator, spec)
        params = await self.parameters()
        return await self.run_in_thread(self._evaluator.accuracy, params)

    async def _finish(self, status: JobStatus) -> None:
        s = self.state
        if s.status in _TERMINAL:
            return
        if status == "completed":
            s.accuracy, s.loss = await self._evaluate()
            s.step = s.total_steps
        s.status = status
        s.finished_at = time.time()
        await asyncio.gather(*(t.stop() for t in self._trainers()), return_exceptions=True)
        if status != "completed":
            await asyncio.gather(*(sh.stop(s.generation + 1) for sh in self._shards()), return_exceptions=True)
        await self._write()
        self._live = self._status_from_state(
            samples_per_s=self._live.samples_per_s,
            bytes_per_step=self._live.bytes_per_step,
            max_staleness=self._live.max_staleness,
            max_gap=self._live.max_gap,
            trainer_silos=self._live.trainer_silos,
            shard_silos=self._live.shard_silos,
        )
        await self._publish()
        log.info("%s: job %s at step %d (accuracy %s)", self.key, status, s.step, s.accuracy)

    def _status_from_state(self, **live: Any) -> TrainingStatus:
        s = self.state
        end = s.finished_at or time.time()
        return TrainingStatus(
            job=self.key, status=s.status, step=s.step, total_steps=s.total_steps, loss=s.loss,
            accuracy=s.accuracy, trainers=s.slots, shards=len(s.shard_keys), generation=s.generation, run=s.run,
            checkpoints=list(s.committed), restarts=s.restarts, rollbacks=s.rollbacks,
            elapsed_s=(end - s.started_at) if s.started_at else 0.0, error=s.error,
            trainer_keys=list(s.trainer_keys), shard_keys=list(s.shard_keys),
            mode=s.spec.mode if s.spec is not None else "", changes=list(s.changes), **live,
        )  # fmt: skip

    async def _write(self) -> None:
        async with self._write_lock:
            await self.write_state()

    async def _publish(self) -> bool:
        """Write the dashboard's job record; True when an admin asked to cancel the job."""
        from grains.training.progress import publish

        try:
            return await publish(self, self._live, self.state.spec, self.state.trainer_keys, self.state.shard_keys)
        except errors.RedgrainError as exc:
            if not self._last_publish_failed:
                log.warning("%s: publishing progress failed: %s", self.key, exc)
            self._last_publish_failed = True
            return False

