"""Distributed training grains: a parameter server built from virtual actors.

Run silos with ``redgrain silo --grains grains.training`` and submit a job::

    job = TrainingJob(mode="sync", trainers=2, shards=2, steps=300)
    await client.get_grain(CoordinatorGrain, "digits-1").start(job)

The package is split by concept, each layer importing only those below it
(``.importlinter``): ``coordinator`` (owns a job) > ``strategies/{ps,
allreduce, pipeline}`` (how each mode runs it) > ``state`` (the one snapshot
format) > ``loop`` (the one step runner) > ``data`` (the data position,
batches) > ``models``, ``datasets``, ``steps`` (the built-ins job specs name
by import path) > ``api`` (the job spec, wire types, records).

The grain classes live in their own modules and load on first use (PEP 562):
importing the package, or its torch-free ``api.records`` module (the dashboard
does), does not import torch. A silo started with ``--grains
grains.training`` hosts every grain named in ``__all__``
(``AllreduceTrainerGrain``: the trainers of mode ``allreduce``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from silo.lazy import lazy_exports

if TYPE_CHECKING:
    from grains.training.api.job import TrainingJob, load_job_file, parse_job
    from grains.training.api.messages import TrainingStatus
    from grains.training.coordinator import CoordinatorGrain
    from grains.training.state.checkpoint import TrainingSnapshot
    from grains.training.state.store import CheckpointStoreGrain
    from grains.training.strategies.allreduce.trainer import AllreduceTrainerGrain
    from grains.training.strategies.pipeline.stage import PipelineStageGrain
    from grains.training.strategies.ps.shard import ParamShardGrain
    from grains.training.strategies.ps.trainer import TrainerGrain

_LAZY = {
    "AllreduceTrainerGrain": "grains.training.strategies.allreduce.trainer",
    "CheckpointStoreGrain": "grains.training.state.store",
    "CoordinatorGrain": "grains.training.coordinator",
    "ParamShardGrain": "grains.training.strategies.ps.shard",
    "PipelineStageGrain": "grains.training.strategies.pipeline.stage",
    "TrainingSnapshot": "grains.training.state.checkpoint",
    "TrainerGrain": "grains.training.strategies.ps.trainer",
    "TrainingJob": "grains.training.api.job",
    "TrainingStatus": "grains.training.api.messages",
    "load_job_file": "grains.training.api.job",
    "parse_job": "grains.training.api.job",
}

__all__ = [
    "AllreduceTrainerGrain",
    "CheckpointStoreGrain",
    "CoordinatorGrain",
    "ParamShardGrain",
    "PipelineStageGrain",
    "TrainerGrain",
    "TrainingJob",
    "TrainingSnapshot",
    "TrainingStatus",
    "load_job_file",
    "parse_job",
]

__getattr__ = lazy_exports(__name__, _LAZY)
