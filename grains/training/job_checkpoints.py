"""A training job's checkpoints as its coordinator reads and keeps them.

The holders of a job's state (shards, trainers, stages) write its checkpoints; the coordinator
reads them (a step's weights for ``state_dict(step=...)``, evaluation and the end of a job),
keeps the best one (``keep_best``) and applies retention while evaluations are due
(``checkpoint.retained``). Everything here goes through the job's
:class:`~grains.training.state.store.CheckpointStoreGrain` and the grain's checkpoint facility.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import torch

from grains.base import Grain
from grains.checkpoints import snapshots
from grains.ref import Ref
from grains.training.api.job_state import JobState
from grains.training.evaluation import Evaluator
from grains.training.state.checkpoint import TrainingSnapshot, group
from grains.training.state.store import CheckpointStoreGrain
from grains.training.strategies.driver import Driver
from silo import errors

log = logging.getLogger("redgrain.training.coordinator")

READ_TIMEOUT_S = 120.0
"""A whole checkpoint read or written through the job's store grain."""

Tensors = dict[str, torch.Tensor]


class JobCheckpoints:
    """Reads, the best checkpoint and retention of one coordinator's job.

    ``state`` reads the job's state as it is now (a new start replaces it); ``evaluator`` gives
    the job's model (parameter and buffer names); ``driver`` the running job's driver (the live
    weights, while the grains hold them).
    """

    def __init__(
        self,
        grain: Grain,
        state: Callable[[], JobState],
        evaluator: Callable[[], Awaitable[Evaluator]],
        driver: Callable[[], Driver],
    ) -> None:
        self._grain = grain
        self._state = state
        self._evaluator = evaluator
        self._driver = driver

    def _store(self) -> Ref[CheckpointStoreGrain]:
        return self._grain.get_grain(CheckpointStoreGrain, self._grain.key).with_timeout(READ_TIMEOUT_S)

    async def read(self, step: int) -> Tensors:
        """Parameters and buffers by name of committed checkpoint ``step``."""
        evaluator = await self._evaluator()
        snap: TrainingSnapshot = await self._store().read(self._state().run, step, evaluator.names, evaluator.extra)
        return {**snap.params, **snap.buffers}

    async def current(self) -> Tensors:
        """Parameters and buffers by name: live from the grains, or from the newest checkpoint."""
        s = self._state()
        if not s.released:
            return await self._driver().tensors()
        if not s.committed:
            return {}
        return await self.read(s.committed[-1])

    async def best(self) -> Tensors:
        """The checkpoint ``keep_best`` kept; ConfigError when there is none."""
        s = self._state()
        if s.best_step is None:
            keep = s.spec.keep_best if s.spec is not None else None
            raise errors.ConfigError(f"job {self._grain.key} has kept no best checkpoint (keep_best: {keep})")
        evaluator = await self._evaluator()
        snap = await self._store().read_best(s.run, s.best_step, evaluator.names, evaluator.extra)
        return {**snap.params, **snap.buffers}

    async def keep_best(self, step: int, value: float) -> None:
        """Checkpoint ``step`` becomes the job's best (its metric reached ``value``)."""
        s = self._state()
        evaluator = await self._evaluator()
        store = self._store()
        try:
            snap = await store.read(s.run, step, evaluator.names, evaluator.extra)
            await store.save_best(s.run, snap)
        except errors.RedgrainError as exc:
            log.warning("%s: checkpoint %d not kept as the best: %s", self._grain.key, step, exc)
            return
        s.best_step, s.best_value = step, value

    async def prune(self, evaluating: int | None) -> None:
        """With mid-run evaluation the coordinator applies retention (``checkpoint.retained``):
        it deletes the run's complete checkpoints that are neither among the newest
        ``keep_checkpoints`` nor due for (or in: ``evaluating``) an evaluation."""
        s = self._state()
        spec = s.spec
        if spec is None or not spec.eval_every or not s.committed:
            return
        g = group(self._grain.key, s.run)
        checkpoints = snapshots(self._grain)
        for info in await checkpoints.list(g):
            c = int(info.snapshot_id)
            if c in s.committed or c > s.committed[-1] or c in s.eval_pending or c == evaluating:
                continue
            await checkpoints.delete(g, info.snapshot_id)
