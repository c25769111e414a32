"""The parameter-server driver (modes sync, async, ssp): shards, trainers, rollbacks.

The driver places the shards (the model's tensors split by bytes) and the
trainers (ranks 0 .. trainers-1), then every tick asks each shard and trainer
how it is doing and repairs what it finds:

- a trainer lost, restarted or failed (shards intact): it runs again at its
  rank, from the step the shards expect from it; the others go on (a trainer
  that fails more than ``_MAX_TRAINER_FAILURES`` times in a row fails the job);
- a shard lost (its activation changed, or it refuses our generation): a
  *rollback*: a new generation, every shard restores the last committed
  checkpoint, every trainer restarts from that step;
- the coordinator itself re-activated (its silo died): the driver re-attaches
  to the shards and trainers the state names, rolling back only if a shard
  was lost too.

Checkpoint step ``c`` is committed once every shard has saved it; the newest
``keep_checkpoints`` are kept. With ``trainers = "auto"`` a trainer silo that
joins gets a trainer at the next committed checkpoint: a new generation
restores it with one more trainer, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import torch

from grains.ref import Ref
from grains.training.api.messages import (
    JobStatus,
    ShardConfig,
    ShardStatus,
    TensorKinds,
    TrainerAssignment,
    TrainerProgress,
)
from grains.training.datasets import dataset_size, load_dataset
from grains.training.models import build_model
from grains.training.state import checkpoint
from grains.training.state.model_tensors import layout_of
from grains.training.strategies import cluster
from grains.training.strategies.driver import Driver, JobContext
from grains.training.strategies.elastic import TrainerSilos
from grains.training.strategies.ps.shard import ParamShardGrain
from grains.training.strategies.ps.trainer import TrainerGrain
from silo import errors

log = logging.getLogger("redgrain.training.coordinator")

_MAX_TRAINER_FAILURES = 5


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


class ParameterServerDriver(Driver):
    trainer_type = TrainerGrain

    def __init__(self, job: JobContext, silos: TrainerSilos) -> None:
        super().__init__(job, silos)
        self._failures: dict[int, int] = {}
        self._warming: dict[str, tuple[str, asyncio.Task[None]]] = {}
        """Trainers "auto": joined silo -> the key of its trainer-to-be and its warm-up (prepare)."""

    # --- what the coordinator asks ------------------------------------------
    def placed(self) -> bool:
        return bool(self.state.shard_keys)

    async def place_and_start(self) -> None:
        spec = self.state.spec
        assert spec is not None
        coord = self.job.grain
        model = await coord.run_in_thread(build_model, spec)  # start() ran check_job
        layout = layout_of(model)
        self.state.tensor_kinds = TensorKinds(frozen=list(layout.frozen), buffers=list(layout.buffers))
        shard_rows = cluster.hosting_silos(coord, "ParamShardGrain")
        trainer_rows = cluster.trainer_silos(cluster.hosting_silos(coord, "TrainerGrain"), spec.trainer_role)
        if not trainer_rows or not shard_rows:
            raise errors.ConfigError("no active silo hosts the training grains (start silos with --grains grains.training)")
        trainers = len(trainer_rows) if spec.trainers == "auto" else int(spec.trainers)
        names = split_by_bytes(layout.sizes(), spec.shards)
        train_size = dataset_size(await coord.run_in_thread(load_dataset, spec, "train"))
        all_trainer_rows = cluster.hosting_silos(coord, "TrainerGrain")
        # Shards start on the silos after the first trainers', so a 2-silo job spreads both.
        shard_keys = [
            cluster.key_on("ParamShardGrain", f"{self.key}/shard-{i}", shard_rows[(i + 1) % len(shard_rows)].silo, shard_rows)
            for i in range(len(names))
        ]
        trainer_keys = [
            cluster.key_on("TrainerGrain", f"{self.key}/trainer-{j}", trainer_rows[j % len(trainer_rows)].silo, all_trainer_rows)
            for j in range(trainers)
        ]
        s = self.state
        s.trainers, s.shard_keys, s.shard_names, s.trainer_keys = trainers, shard_keys, names, trainer_keys
        s.trainer_silos = [str(trainer_rows[j % len(trainer_rows)].silo) for j in range(trainers)]
        s.next_trainer = trainers
        s.train_size = train_size
        restore = s.committed[-1] if s.committed else None  # resuming: the previous start's checkpoint
        s.resumed_from = restore
        self.resize_data(restore or 0, trainers)  # a resume goes on from the restored step's data position
        if restore is None:  # each shard restores its slice instead of building the whole model
            restore = await self.commit_initial(await coord.run_in_thread(checkpoint.initial, model))
        del model
        await self._configure_shards(restore)
        await asyncio.gather(*(self._run_trainer(j, restore or 0) for j in range(trainers)))
        s.status = "running"
        await self.job.save()

    async def tick(self) -> None:
        s = self.state
        assert s.spec is not None
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
            *(t.progress(self.cursor) for t in self.trainers()), return_exceptions=True
        )
        done = 0
        restarted: list[tuple[int, int, str]] = []
        for j, r in enumerate(results):
            if isinstance(r, TrainerProgress) and r.generation == s.generation and r.status in ("running", "done"):
                if self.progress.get(j) is None or r.steps_done != self.progress[j].steps_done:
                    self._failures[j] = 0
                self.progress[j] = r
                done += r.status == "done"
                continue
            if isinstance(r, BaseException):
                continue  # busy or dead: a later call answers, or re-activates it idle elsewhere
            if any(j >= len(st.next_steps) for st in statuses):
                # A shard still inside configure() for this generation (a grow whose rollback
                # timed out while the restore ran) already reports the generation, not yet its
                # trainers: the next tick sees the configured shard and restarts the trainer then.
                continue
            why = r.error or r.status
            if r.status == "failed" and r.fatal:
                # Retrying would fail the same way (the step's contract, a non-finite loss, memory);
                # out of memory on one silo need not elsewhere: an elastic job sheds that trainer.
                if r.out_of_memory and len(s.trainer_silos) == s.trainers and self.shed(s.trainer_silos[j], why):
                    await self._drop_trainer(j, why)
                    return
                await self._commit(statuses)  # what every shard saved before the failure stays resumable
                raise self.failed_at(r.step, f"trainer {j}: {why}")
            if r.status == "failed" and r.generation == s.generation:
                self._failures[j] = self._failures.get(j, 0) + 1
                if self._failures[j] > _MAX_TRAINER_FAILURES:
                    await self._commit(statuses)
                    raise self.failed_at(r.step, f"trainer {j} keeps failing: {why}")
            start = min(st.next_steps[j] for st in statuses)
            log.warning("%s: trainer %d lost or stopped (%s); restarting it at step %d", self.key, j, why[:200], start)
            s.restarts += 1
            self.progress.pop(j, None)  # the lost run's counters; the restarted run reports anew
            restarted.append((j, start, why[:200]))
            with contextlib.suppress(errors.RedgrainError):
                await self._run_trainer(j, start)
        if restarted:
            why = "; ".join(f"trainer {j} restarted at step {start} ({w})" for j, start, w in restarted)
            self.note_change(s.generation, why, s.trainers, min(st for _, st, _ in restarted), [j for j, _, _ in restarted])
        self._note_first_step()
        committed = await self._commit(statuses)
        await self.report(statuses)
        if done == s.trainers and self.final_committed():
            await self.job.finish("completed")
        elif s.spec.trainers == "auto":
            self._warm_joined()
            if committed:
                await self._grow_at_checkpoint()

    async def tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers, gathered from every shard."""
        out: dict[str, torch.Tensor] = {}
        for part in await asyncio.gather(*(s.tensors() for s in self._shards())):
            out.update(part)
        return out

    async def release(self) -> None:
        await super().release()
        await asyncio.gather(*(sh.release() for sh in self._shards()), return_exceptions=True)

    async def stop(self, status: JobStatus) -> None:
        """Trainers stop; unless the job completed, shards refuse further pushes too."""
        await super().stop(status)
        if status != "completed":
            generation = self.state.generation + 1
            await asyncio.gather(*(sh.stop(generation) for sh in self._shards()), return_exceptions=True)

    # --- placement and repair -------------------------------------------------
    def _shards(self) -> list[Ref[ParamShardGrain]]:
        return [self.ref(ParamShardGrain, k) for k in self.state.shard_keys]

    async def _configure_shards(self, restore_step: int | None) -> None:
        s = self.state
        assert s.spec is not None
        cfgs = [
            ShardConfig(job=self.key, index=i, spec=s.spec, names=names, shard_keys=s.shard_keys, trainers=s.trainers,
                        generation=s.generation, run=s.run, restore_step=restore_step, end_step=s.total_steps,
                        kinds=self._kinds(names))
            for i, names in enumerate(s.shard_names)
        ]
        shards = [self.ref(ParamShardGrain, k, 120.0) for k in s.shard_keys]
        statuses: list[ShardStatus] = await asyncio.gather(*(sh.configure(c) for sh, c in zip(shards, cfgs, strict=True)))
        s.shard_activations = [st.activation_id for st in statuses]
        self.job.show_shard_silos([st.silo for st in statuses])

    def _kinds(self, names: list[str]) -> TensorKinds | None:
        kinds = self.state.tensor_kinds
        if kinds is None:
            return None
        own = set(names)
        return TensorKinds(frozen=[n for n in kinds.frozen if n in own], buffers=[n for n in kinds.buffers if n in own])

    async def _run_trainer(self, rank: int, start_step: int) -> None:
        s = self.state
        assert s.spec is not None
        a = TrainerAssignment(
            job=self.key, rank=rank, trainers=s.trainers, spec=s.spec, generation=s.generation, run=s.run,
            start_step=start_step, end_step=s.total_steps, shard_keys=s.shard_keys, shard_names=s.shard_names,
            data_segments=list(s.data_segments),
        )  # fmt: skip
        await self.ref(TrainerGrain, s.trainer_keys[rank], 120.0).run(a)

    async def _rollback(self, why: str) -> None:
        s = self.state
        assert s.spec is not None
        s.generation += 1
        s.rollbacks += 1
        # The abandoned generation stops first, within its current step: left running while the
        # restore point was found and the shards restored, it trained on for seconds (47 steps
        # thrown away in one grow) and saved checkpoints past the restore point.
        await asyncio.gather(*(t.stop() for t in self.trainers()), return_exceptions=True)
        restore = await self._restore_point()
        # The data position of the restored step goes on with the (maybe new) trainer count; an
        # epochs job's last step follows it, before the shards learn their end step.
        self.resize_data(restore or 0, s.trainers)
        log.warning("%s: %s; rolling back to %s (generation %d)", self.key, why,
                    f"checkpoint {restore}" if restore is not None else "the start", s.generation)  # fmt: skip
        self.note_change(s.generation, why, s.trainers, restore or 0)
        await self.job.save()
        await self._configure_shards(restore)
        self.progress.clear()
        self.cursor = restore or 0
        await asyncio.gather(*(self._run_trainer(j, restore or 0) for j in range(s.trainers)))
        await self.job.save()

    async def _restore_point(self) -> int | None:
        """The checkpoint a rollback restores, and the later ones it abandons (deleted).

        Ours is ``committed[-1]``; but shards can complete several checkpoints between
        two of our ticks, so retention may already have dropped it while newer ones,
        which our list never saw (their shard's last status did not reach us), are
        complete in the store: then the store's newest is the one.
        """
        s = self.state
        coord = self.job.grain
        restore = s.committed[-1] if s.committed else None
        if restore is None or not await checkpoint.exists(coord, self.key, s.run, restore):
            newest = await checkpoint.newest_step(coord, self.key, s.run)
            if newest is not None and (restore is None or newest > restore):
                log.info("%s: checkpoint %s is gone; the store's newest complete one is %d", self.key, restore, newest)
                await self.commit_step(newest)
                restore = newest
        if await checkpoint.drop_after(coord, self.key, s.run, restore):
            log.info("%s: dropped checkpoints after %s (abandoned by the rollback)", self.key, restore)
        return restore

    async def _commit(self, statuses: list[ShardStatus]) -> bool:
        common = set(statuses[0].saved_steps).intersection(*(st.saved_steps for st in statuses[1:]))
        # Every complete snapshot counts, not just the newest: a slow tick may find two at once.
        last = self.state.committed[-1] if self.state.committed else -1
        committed = False
        for step in sorted(c for c in common if c > last):
            committed = await self.commit_step(step) or committed
        return committed

    async def _grow_at_checkpoint(self) -> None:
        """Trainers 'auto': give each trainer silo that has none a trainer.

        Done right after a checkpoint is committed: a new generation restores it with the
        extra trainers (the data goes on from the next unseen sample), so almost no work is lost.
        """
        s = self.state
        if len(s.trainer_silos) != len(s.trainer_keys):
            return  # placed by an older version: where the trainers are is not known
        look = self.look()
        # Only silos whose trainer-to-be is warmed up (_warm_joined); the others join at a later checkpoint.
        warm = {a for a, (_, task) in self._warming.items() if task.done()}
        joined = [r for r in look.without_trainer(s.trainer_silos) if r.address in warm]
        if not joined:
            return
        for row in joined:
            key, _ = self._warming.pop(row.address)
            s.trainer_keys.append(key)
            s.trainer_silos.append(row.address)
        s.trainers = len(s.trainer_keys)
        why = f"trainer silo(s) {', '.join(r.address for r in joined)} joined"
        try:
            await self._rollback(why)
        except errors.RedgrainError as exc:
            log.warning("%s: growing to %d trainers incomplete (%s); retrying", self.key, s.trainers, exc)

    def _warm_joined(self) -> None:
        """Trainers 'auto': a trainer silo that joined gets its trainer-to-be at once, which builds
        the model and loads the data there once (``TrainerGrain.prepare``) while the job trains on;
        the job takes it in at the first checkpoint committed after that. Before, the job stopped
        for the joining trainer's first imports and data load (tiny BERT: 1.9-2.2 s from the
        decision to the first step on an idle machine, most of it ``import transformers``)."""
        s = self.state
        if len(s.trainer_silos) != len(s.trainer_keys):
            return  # placed by an older version: where the trainers are is not known
        look = self.look()
        joined = look.without_trainer(s.trainer_silos)
        present = {r.address for r in joined}
        for gone in [a for a in self._warming if a not in present]:
            self._warming.pop(gone)[1].cancel()
        for row in joined:
            if row.address not in self._warming:
                key = cluster.key_on("TrainerGrain", f"{self.key}/trainer-{s.next_trainer}", row.silo, look.hosting)
                s.next_trainer += 1
                task = self.job.grain.start_task(self._prepare(key), name=f"{self.key} warm-up {key}")
                self._warming[row.address] = (key, task)

    async def _prepare(self, key: str) -> None:
        spec = self.state.spec
        assert spec is not None
        try:
            await self.ref(TrainerGrain, key, 120.0).prepare(spec)
        except Exception as exc:  # noqa: BLE001 - the trainer's run reports what is wrong, as before
            log.info("%s: warming up trainer %s failed: %s", self.key, key, exc)

    async def _drop_trainer(self, rank: int, why: str) -> None:
        """Go on without trainer ``rank``: the others roll back to the last checkpoint with one
        trainer fewer, the data going on from there (as a joining trainer is taken in, in reverse)."""
        s = self.state
        key, silo = s.trainer_keys.pop(rank), s.trainer_silos.pop(rank)
        s.trainers = len(s.trainer_keys)
        with contextlib.suppress(errors.RedgrainError):
            await self.ref(TrainerGrain, key).release()
        self.progress.clear()
        self._failures.clear()
        try:
            await self._rollback(f"trainer {rank} on {silo} shed ({why[:200]})")
        except errors.RedgrainError as exc:
            log.warning("%s: shrinking to %d trainers incomplete (%s); retrying", self.key, s.trainers, exc)

    def _note_first_step(self) -> None:
        """Fill in when the current change's restarted trainers all committed a step (recovery time)."""
        s = self.state
        if not s.changes or s.changes[-1].generation != s.generation or s.changes[-1].first_step_at is not None:
            return
        change = s.changes[-1]
        ranks = change.ranks or list(range(s.trainers))
        firsts = [self.progress[j].first_step_at if j in self.progress else None for j in ranks]
        if all(t is not None for t in firsts):
            change.first_step_at = max(t for t in firsts if t is not None)
