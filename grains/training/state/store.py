"""CheckpointStoreGrain: a job's checkpoints read and written whole, when no shard or trainer holds them.

A finished job's trainers and shards deactivate and free their memory; what
the job trained stays readable from its final checkpoint, which this grain
reads for the coordinator (``parameters()``, ``state_dict()`` of a finished
job) and for the trainer that evaluates a checkpoint. It also writes a
job's starting weights (the seeded model, or ``init_from``) as step 0 of its
run, a snapshot with this grain as its one member, which every mode restores
like any other checkpoint (each shard or stage takes its part of it). Its state is the checkpoint format's, so
the snapshot codec decodes any job's members for it; it holds nothing between
calls and is collected when idle.
"""

from __future__ import annotations

from grains.base import Grain
from grains.checkpoints import snapshots
from grains.training.state import checkpoint
from grains.training.state.checkpoint import SnapshotState, TrainingSnapshot


class CheckpointStoreGrain(Grain):
    """Key: the job id."""

    State = SnapshotState

    async def save_whole(self, run: int, snapshot: TrainingSnapshot, keep: int) -> bool:
        """Save ``snapshot`` as the whole model at its step (True: the snapshot is complete)."""
        return await checkpoint.save_whole(self, self.key, run, snapshot, keep)

    async def read(self, run: int, step: int, names: list[str], extra: list[str]) -> TrainingSnapshot:
        """Trainable parameters ``names`` (with optimizer state) and ``extra`` at checkpoint ``step``."""
        return await checkpoint.load_model(self, self.key, run, step, names, extra)

    async def save_best(self, run: int, snapshot: TrainingSnapshot) -> bool:
        """Keep ``snapshot`` as the job's best checkpoint (``keep_best``), replacing the last one."""
        self.state.snapshot = snapshot
        try:
            return await snapshots(self).save(checkpoint.best_group(self.key, run), snapshot.step, keep=1)
        finally:
            self.state.snapshot = None

    async def release(self) -> None:
        """The job is forgotten: go now rather than when idle."""
        self.deactivate_on_idle()

    async def read_best(self, run: int, step: int, names: list[str], extra: list[str]) -> TrainingSnapshot:
        """The checkpoint ``save_best`` kept at ``step``."""
        return await checkpoint.load_model(self, self.key, run, step, names, extra, checkpoint.best_group(self.key, run))
