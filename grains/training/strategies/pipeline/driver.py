"""The pipeline driver (mode pipeline): stages on silos, stage 0 runs the steps, rollbacks.

The driver cuts the model into ``stages`` (:mod:`grains.training.strategies.pipeline.partition`),
writes the seeded initial weights as step 0 of the run (each stage then
restores only its part), places one
:class:`~grains.training.strategies.pipeline.stage.PipelineStageGrain` per stage, on distinct
silos with room for it where there are enough
(:mod:`grains.training.strategies.pipeline.placement`: the trainer silos first), and
configures them; stage 0 then runs every step (see
:mod:`grains.training.strategies.pipeline.stage`). Each tick asks every stage how it is doing:

- a stage lost (its activation changed, or it refuses our generation) or
  stage 0's run failed: a *rollback*, as for a lost parameter shard: a new
  generation, every stage restores the last committed checkpoint (all stages
  are checkpointed at the same step), stage 0 runs on from there;
- a failure that would repeat (stage 0 reports it fatal) fails the job.

Checkpoint ``c`` is committed once every stage has saved it. The stages'
keys are the job's ``trainer_keys`` (the status and dashboard list them).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from grains.training.api.job import TrainingJob
from grains.training.api.messages import StageConfig, StageStatus, TrainerProgress
from grains.training.api.records import StageInfo
from grains.training.datasets import dataset_size, load_dataset
from grains.training.models import build_model
from grains.training.state import checkpoint
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.strategies import cluster
from grains.training.strategies.driver import Driver, JobContext
from grains.training.strategies.elastic import TrainerSilos
from grains.training.strategies.pipeline import partition
from grains.training.strategies.pipeline.partition import measured_costs
from grains.training.strategies.pipeline.placement import place_stages
from grains.training.strategies.pipeline.stage import PipelineStageGrain
from silo import errors

log = logging.getLogger("redgrain.training.coordinator")

_MAX_FAILURES = 5


def cut(spec: TrainingJob) -> tuple[list[tuple[int, int]], list[int], TrainingSnapshot]:
    """The job's stages (by parameter bytes, by layer times measured on one micro-batch, or at its
    split points), each stage's bytes, and the seeded initial weights as step 0."""
    model = build_model(spec)
    costs = None
    if spec.balance == "time" and not spec.split_points:
        from grains.training.data.batches import Batches

        x, _ = Batches(load_dataset(spec, "train")).batch(spec.batch_size // spec.microbatches, 1, 0, 0, spec.seed)
        costs = measured_costs(model, x)
    layers, sizes = partition.cut(model, spec, costs)
    return layers, sizes, checkpoint.initial(model)


class PipelineDriver(Driver):
    trainer_type = PipelineStageGrain
    trainers_evaluate = False  # a stage holds its layers only: the coordinator evaluates

    def __init__(self, job: JobContext, silos: TrainerSilos) -> None:
        super().__init__(job, silos)
        self._layers: list[tuple[int, int]] = []
        self._activations: list[str] = []
        self._failures = 0

    async def place_and_start(self) -> None:
        s = self.state
        spec = s.spec
        assert spec is not None
        coord = self.job.grain
        layers, sizes, initial = await coord.run_in_thread(cut, spec)
        s.stage_layers = layers
        look = self.look()
        rows = look.eligible or look.hosting
        if not rows:
            raise errors.ConfigError("no active silo hosts the training grains (start silos with --grains grains.training)")
        stages = len(layers)
        trainers = max(1, len(rows) // stages) if spec.trainers == "auto" else int(spec.trainers)
        placement = place_stages(rows, [partition.stage_need(n, spec) for _ in range(trainers) for n in sizes])
        if placement.short:
            log.warning("%s: no silo has the free memory stage(s) %s need; placed where the most is left",
                        self.key, [j % stages for j in placement.short])  # fmt: skip
        keys, silos = [], []
        for j, row in enumerate(placement.rows):
            r, i = divmod(j, stages)
            base = f"{self.key}/stage-{i}" if trainers == 1 else f"{self.key}/r{r}/stage-{i}"
            keys.append(cluster.key_on("PipelineStageGrain", base, row.silo, look.hosting))
            silos.append(row.address)
        s.trainer_keys, s.trainer_silos = keys, silos
        s.trainers = trainers
        s.train_size = dataset_size(await coord.run_in_thread(load_dataset, spec, "train"))
        restore = s.committed[-1] if s.committed else None
        s.resumed_from = restore
        self.resize_data(restore or 0, trainers)  # a resume goes on from the restored step's data position
        if restore is None:  # each stage builds only its part (on the meta device) and fills it
            restore = await self.commit_initial(initial)
        del initial
        self._layers = layers
        await self._configure(restore)
        s.status = "running"
        await self.job.save()

    async def tick(self) -> None:
        s = self.state
        if not self._layers:  # re-activated: the cut made at the start
            self._layers = [tuple(x) for x in s.stage_layers]  # type: ignore[misc]
        refs = [self.ref(PipelineStageGrain, k) for k in s.trainer_keys]
        results = await asyncio.gather(*(st.status(self.cursor) for st in refs), return_exceptions=True)
        if any(isinstance(r, BaseException) for r in results):
            return  # unreachable is not lost: a dead silo's stage re-activates on the next call
        statuses: list[StageStatus] = results  # type: ignore[assignment]
        stages = len(self._layers)
        heads = statuses[::stages]  # stage 0 of each trainer
        lost = [
            s.trainer_keys[i] for i, st in enumerate(statuses)
            if st.generation != s.generation or (self._activations and st.activation_id != self._activations[i])
        ]  # fmt: skip
        gone = sorted({s.trainer_keys.index(k) // stages for k in lost})
        if lost and 0 < len(gone) < s.trainers and await self._shrink(gone, f"{', '.join(lost)} lost"):
            return
        for r, head in enumerate(heads):
            if head.status == "failed" and head.generation == s.generation:
                if head.fatal:
                    raise self.failed_at(head.step, f"pipeline stage failed: {head.error}")
                self._failures += 1
                if self._failures > _MAX_FAILURES:
                    raise self.failed_at(head.step, f"the pipeline keeps failing: {head.error}")
                lost.append(f"trainer {r}'s run ({head.error[:200]})")
        if lost:
            try:
                await self._rollback(f"{', '.join(lost)} lost or failed")
            except errors.RedgrainError as exc:
                log.warning("%s: rollback incomplete (%s); retrying", self.key, exc)
            return
        if all(h.steps_done for h in heads):
            self._failures = 0
        self.progress = {r: self._progress(h, r) for r, h in enumerate(heads)}
        self._note_first_step(heads)
        first = statuses[:stages]  # rank 0's stages hold the checkpoints
        common = set(first[0].saved_steps).intersection(*(st.saved_steps for st in first[1:]))
        for step in sorted(c for c in common if c > (s.committed[-1] if s.committed else -1)):
            await self.commit_step(step)
        stage_info = [
            StageInfo(key=s.trainer_keys[j], silo=st.silo, rank=j // stages, index=j % stages,
                      forward_ms=st.forward_ms, backward_ms=st.backward_ms, timeline=st.timeline,
                      param_bytes=st.param_bytes)
            for j, st in enumerate(statuses)
        ]  # fmt: skip
        await self.report([], [st.silo for st in statuses], stage_info)  # every stage's silo, in pipeline order
        if all(h.status == "done" for h in heads) and self.final_committed():
            await self.job.finish("completed")

    async def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        first = self.state.trainer_keys[: self._stages()]  # rank 0's: every trainer holds the same
        for part in await asyncio.gather(*(self.ref(PipelineStageGrain, k).tensors() for k in first)):
            out.update(part)
        return out

    # --- placement and repair -------------------------------------------------
    def _stages(self) -> int:
        s = self.state
        assert s.spec is not None
        return len(s.trainer_keys) // max(1, s.trainers)

    def _progress(self, head: StageStatus, rank: int) -> TrainerProgress:
        """A trainer's stage 0 figures as that trainer (what the status and history read)."""
        return TrainerProgress(
            activation_id=head.activation_id, silo=head.silo, generation=head.generation, rank=rank,
            status=head.status if head.status != "failed" else "running", step=head.step, loss=head.loss,  # type: ignore[arg-type]
            samples_per_s=head.samples_per_s, steps_done=head.steps_done, points=head.points,
            skipped=head.skipped,
        )  # fmt: skip

    async def _configure(self, restore: int | None, keep_from: int | None = None) -> None:
        s = self.state
        assert s.spec is not None
        stages, trainers = len(self._layers), max(1, s.trainers)
        chains = [s.trainer_keys[r * stages : (r + 1) * stages] for r in range(trainers)]
        cfgs = [
            StageConfig(job=self.key, run=s.run, index=i, spec=s.spec, layers=layers, stage_keys=chains[r],
                        rank=r, peer_keys=[c[i] for c in chains], checkpoint_keys=chains[0],
                        generation=s.generation, start_step=keep_from if keep_from is not None else restore or 0,
                        end_step=s.total_steps, restore_step=restore, keep=keep_from is not None,
                        data_segments=list(s.data_segments))
            for r in range(trainers) for i, layers in enumerate(self._layers)
        ]  # fmt: skip
        refs = [self.ref(PipelineStageGrain, k, 120.0) for k in s.trainer_keys]
        # The later stages first: a trainer's stage 0 starts sending as soon as it is configured.
        later = [j for j in range(len(refs)) if j % stages]
        heads = [j for j in range(len(refs)) if not j % stages]
        done: dict[int, StageStatus] = {}
        for group in (later, heads):
            for j, st in zip(group, await asyncio.gather(*(refs[j].configure(cfgs[j]) for j in group)), strict=True):
                done[j] = st
        self._activations = [done[j].activation_id for j in range(len(refs))]

    def _note_first_step(self, heads: list[StageStatus]) -> None:
        """Fill in when every trainer committed the first step after the latest change (recovery time)."""
        s = self.state
        if not s.changes or s.changes[-1].generation != s.generation or s.changes[-1].first_step_at is not None:
            return
        change = s.changes[-1]
        times = [pt.at for h in heads for pt in h.points if pt.step == change.start_step]
        if len(times) == len(heads):
            change.first_step_at = max(times)

    async def _shrink(self, gone: list[int], why: str) -> bool:
        """Hybrid: go on with the trainers that lost nothing, from the step they hold, without a
        rollback; False when their stages do not all hold the same step (then roll back)."""
        s = self.state
        stages = len(self._layers)
        keep = [r for r in range(s.trainers) if r not in gone]
        keys = [s.trainer_keys[r * stages + i] for r in keep for i in range(stages)]
        silos = [s.trainer_silos[r * stages + i] for r in keep for i in range(stages)]
        s.generation += 1
        await self.job.save()
        refs = [self.ref(PipelineStageGrain, k) for k in keys]
        await asyncio.gather(*(r.stop() for r in refs), return_exceptions=True)
        held = await asyncio.gather(*(r.status() for r in refs), return_exceptions=True)
        steps = {h.step for h in held if isinstance(h, StageStatus)}
        if len(steps) != 1 or any(isinstance(h, BaseException) for h in held):
            log.warning("%s: %s; the surviving trainers hold steps %s: rolling back", self.key, why, sorted(steps))
            return False
        (step,) = steps
        lost_keys = [k for r in gone for k in s.trainer_keys[r * stages : (r + 1) * stages]]
        s.trainer_keys, s.trainer_silos, s.trainers = keys, silos, len(keep)
        self.resize_data(step, s.trainers)  # fewer trainers from ``step``: on from the next unseen sample
        log.warning("%s: %s; going on with %d trainer(s) from step %d (generation %d)", self.key, why, s.trainers,
                    step, s.generation)  # fmt: skip
        self.note_change(s.generation, f"{why}; shrank to {s.trainers} trainer(s)", s.trainers, step)
        await self.job.save()
        await asyncio.gather(*(self.ref(PipelineStageGrain, k).release() for k in lost_keys), return_exceptions=True)
        self.progress.clear()
        self.cursor = step
        await self._configure(None, keep_from=step)
        await self.job.save()
        return True

    async def _rollback(self, why: str) -> None:
        s = self.state
        s.generation += 1
        s.rollbacks += 1
        # The abandoned generation stops first (within its step), not after the restore point
        # is found and later checkpoints dropped: it would train on and save past them.
        await asyncio.gather(*(self.ref(PipelineStageGrain, k).stop() for k in s.trainer_keys), return_exceptions=True)
        restore = s.committed[-1] if s.committed else None
        if restore is None or not await checkpoint.exists(self.job.grain, self.key, s.run, restore):
            newest = await checkpoint.newest_step(self.job.grain, self.key, s.run)
            if newest is not None:
                await self.commit_step(newest)
                restore = newest
        await checkpoint.drop_after(self.job.grain, self.key, s.run, restore)
        self.resize_data(restore or 0, s.trainers)
        log.warning("%s: %s; rolling back to %s (generation %d)", self.key, why,
                    f"checkpoint {restore}" if restore is not None else "the start", s.generation)  # fmt: skip
        self.note_change(s.generation, why, s.trainers, restore or 0)
        await self.job.save()
        self.progress.clear()
        self.cursor = restore or 0
        await self._configure(restore)
        await self.job.save()
