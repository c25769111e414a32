"""The all-reduce driver (mode allreduce): one torch.distributed group, re-formed on every change.

Mode ``allreduce`` has no shards: the driver forms a group of
:class:`~grains.training.strategies.allreduce.trainer.AllreduceTrainerGrain`\\ s, one per trainer
silo (at most ``trainers``), and re-forms it with a new generation whenever a
member's silo leaves, a member fails, or a trainer silo joins (with
``trainers = "auto"``, or while the group is below the requested size).

Re-forming stops the survivors first (each reports the step it holds), then
starts the new members from the newest step a survivor holds: members behind
copy it from the one that holds it; the last committed checkpoint is the
fallback when no survivor is at least that far (see
:mod:`grains.training.strategies.allreduce.trainer`). A trainer whose call fails is quarantined a
while, so a dying silo that is not yet declared dead is not picked again at
once. Checkpoints are rank 0's: each one it completed is committed, oldest
first. A coordinator that re-activates with a group in place re-attaches to
it; its first tick re-forms the group if a member was lost with its silo.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from grains.training.api.messages import GroupAssignment, TrainerProgress
from grains.training.datasets import dataset_size, load_dataset
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.strategies import cluster
from grains.training.strategies.allreduce.trainer import AllreduceTrainerGrain
from grains.training.strategies.driver import Driver
from grains.training.strategies.elastic import SiloLook
from grains.workload import workload
from silo import errors

log = logging.getLogger("redgrain.training.coordinator")


class AllreduceDriver(Driver):
    trainer_type = AllreduceTrainerGrain

    # --- what the coordinator asks ------------------------------------------
    async def place_and_start(self) -> None:
        s = self.state
        spec = s.spec
        assert spec is not None
        coord = self.job.grain
        look = self.look()
        if not look.eligible:
            raise errors.ConfigError(
                "no active silo hosts the training grains (start silos with --grains grains.training)"
            )
        trainers = len(look.eligible) if spec.trainers == "auto" else min(int(spec.trainers), len(look.eligible))
        train_size = dataset_size(await coord.run_in_thread(load_dataset, spec, "train"))
        s.total_steps = spec.total_steps(train_size, trainers)
        s.train_size = train_size
        s.trainer_keys, s.trainer_silos, s.trainers = [], [], 0
        s.resumed_from = s.committed[-1] if s.committed else None
        await self._reform("job started")
        s.status = "running"
        await self.job.save()

    async def tick(self) -> None:
        s = self.state
        look = self.look()
        alive = look.alive
        lost = [k for k, silo in zip(s.trainer_keys, s.trainer_silos, strict=True) if silo not in alive]
        refs = [self.ref(AllreduceTrainerGrain, k) for k in s.trainer_keys]
        results = await asyncio.gather(*(r.progress(self.cursor) for r in refs), return_exceptions=True)
        broken: list[str] = []
        done = 0
        for rank, r in enumerate(results):
            if isinstance(r, BaseException):
                continue  # busy or dying: membership (or the next tick) tells
            # A fatal failure would repeat if retried; out of memory on one silo need not elsewhere.
            fatal = r.generation == s.generation and r.status == "failed" and r.fatal
            if fatal and not (r.out_of_memory and self.shed(s.trainer_silos[rank], r.error)):
                # What rank 0 saved before the failure stays resumable.
                await self._commit_saved([p for p in results if isinstance(p, TrainerProgress) and p.generation == s.generation])
                raise self.failed_at(r.step, f"trainer {s.trainer_keys[rank]}: {r.error}")
            if r.generation != s.generation or r.status in ("idle", "failed"):
                broken.append(f"{s.trainer_keys[rank]} {r.status}{': ' + r.error[:200] if r.error else ''}")
                continue
            self.progress[rank] = r
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
        await self._commit_saved(list(self.progress.values()))
        await self.report([])
        if done == len(s.trainer_keys) and self.final_committed():
            await self.job.finish("completed")

    async def _commit_saved(self, progress: list[TrainerProgress]) -> None:
        """Commit every checkpoint rank 0 completed, oldest first."""
        for step in sorted({c for p in progress if p.rank == 0 for c in p.saved_steps}):
            await self.commit_step(step)

    async def tensors(self) -> dict[str, torch.Tensor]:
        snap = await self._newest()
        return {**snap.params, **snap.buffers}

    async def _newest(self) -> TrainingSnapshot:
        """The state of a group member holding the newest step."""
        s = self.state
        refs = [self.ref(AllreduceTrainerGrain, k) for k in s.trainer_keys]
        results = await asyncio.gather(*(r.progress(1 << 62) for r in refs), return_exceptions=True)
        held = [(r.held_step, i) for i, r in enumerate(results) if isinstance(r, TrainerProgress) and r.held_run == s.run]
        if not held:
            raise errors.ConfigError(f"job {self.key}: no trainer holds the parameters")
        step, i = max(held)
        snap: TrainingSnapshot = await refs[i].snapshot(s.run, step)
        return snap

    # --- the group ------------------------------------------------------------
    def _wanted(self, look: SiloLook) -> int:
        spec = self.state.spec
        assert spec is not None
        return len(look.eligible) if spec.trainers == "auto" else min(int(spec.trainers), len(look.eligible))

    async def _reform(self, why: str) -> None:
        """Replace the group: stop the members, pick the new ones, start them from the newest state."""
        s = self.state
        spec = s.spec
        assert spec is not None
        watch = self.silos
        look = self.look()
        s.generation += 1
        await self.job.save()
        # Stop the old members first (never calling one whose silo is gone: that would
        # activate it again elsewhere); one that does not answer is left out.
        olds = [(k, silo) for k, silo in zip(s.trainer_keys, s.trainer_silos, strict=True) if silo in look.alive]
        # stop() returns once the member's step thread has left (its compute may take a while);
        # a hung member's silo is declared dead meanwhile, which fails the call.
        stopped = await asyncio.gather(
            *(self.ref(AllreduceTrainerGrain, k, spec.step_timeout_s).stop() for k, _ in olds),
            return_exceptions=True,
        )
        survivors: list[tuple[str, str, TrainerProgress]] = []
        for (key, silo), r in zip(olds, stopped, strict=True):
            if isinstance(r, TrainerProgress):
                survivors.append((key, silo, r))
            else:
                log.warning("%s: trainer %s on %s did not answer (%s); leaving it out", self.key, key, silo, r)
                watch.quarantine(silo)
        look = self.look()
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
        s.trainers = len(members)
        if members:  # the group's size from ``start`` on: the data goes on from the next unseen sample
            self.resize_data(start, len(members))
        self.progress.clear()
        self.cursor = start
        self.note_change(s.generation, why, len(members), start)
        await self.job.save()
        if not members:
            log.warning("%s: no trainer silo available; waiting for one", self.key)
            return
        log.info("%s: group generation %d: %d trainer(s) from step %d (%s)", self.key, s.generation,
                 len(members), start, why)  # fmt: skip
        backend = "nccl" if look.all_gpu(s.trainer_silos) else "gloo"
        await asyncio.gather(
            *(
                self.ref(AllreduceTrainerGrain, key, 60.0).join(
                    self._assignment(rank, backend, start, None if source == key else source, restore)
                )
                for rank, key in enumerate(s.trainer_keys)
            )
        )

    def _assignment(self, rank: int, backend: str, start: int, source: str | None, restore: int | None) -> GroupAssignment:
        s = self.state
        assert s.spec is not None
        # Generations only grow (across runs of a job id too), so each prefix is used by one group.
        rendezvous = workload(self.job.grain).rendezvous_prefix(self.key, s.generation)
        return GroupAssignment(
            job=self.key, run=s.run, spec=s.spec, generation=s.generation, rank=rank, trainers=len(s.trainer_keys),
            members=list(s.trainer_keys), rendezvous=rendezvous, backend=backend,  # type: ignore[arg-type]
            start_step=start, end_step=s.total_steps, source=source, restore_step=restore,
            data_segments=list(s.data_segments),
        )  # fmt: skip

    def _note_first_step(self) -> None:
        """Fill in when every member of the current generation committed its first step."""
        s = self.state
        if not s.changes or s.changes[-1].generation != s.generation or s.changes[-1].first_step_at is not None:
            return
        change = s.changes[-1]
        times = [pt.at for p in self.progress.values() for pt in p.points if pt.step == change.start_step]
        if len(times) == len(s.trainer_keys) and times:
            change.first_step_at = max(times)
