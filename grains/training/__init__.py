"""Distributed training grains: a parameter server built from virtual actors.

Run silos with ``redgrain silo --grains grains.training`` and submit a job::

    job = TrainingJob(mode="sync", trainers=2, shards=2, steps=300)
    await client.get_grain(CoordinatorGrain, "digits-1").start(job)

The grain classes live in their own modules and load on first use (PEP 562):
importing the package, or its torch-free ``records`` module (the dashboard
does), does not import torch. A silo started with ``--grains
grains.training`` hosts every grain named in ``__all__``
(``AllreduceTrainerGrain``: the trainers of mode ``allreduce``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from silo.lazy import lazy_exports

if TYPE_CHECKING:
    from grains.training.allreduce import AllreduceTrainerGrain
    from grains.training.checkpointing import ShardSnapshot
    from grains.training.coordinator import CoordinatorGrain
    from grains.training.job import TrainingJob, load_job_file, parse_job
    from grains.training.messages import TrainingStatus
    from grains.training.shard import ParamShardGrain
    from grains.training.stage import PipelineStageGrain
    from grains.training.store import CheckpointStoreGrain
    from grains.training.trainer import TrainerGrain

_LAZY = {
    "AllreduceTrainerGrain": "grains.training.allreduce",
    "CheckpointStoreGrain": "grains.training.store",
    "CoordinatorGrain": "grains.training.coordinator",
    "ParamShardGrain": "grains.training.shard",
    "PipelineStageGrain": "grains.training.stage",
    "ShardSnapshot": "grains.training.checkpointing",
    "TrainerGrain": "grains.training.trainer",
    "TrainingJob": "grains.training.job",
    "TrainingStatus": "grains.training.messages",
    "load_job_file": "grains.training.job",
    "parse_job": "grains.training.job",
}

__all__ = [
    "AllreduceTrainerGrain",
    "CheckpointStoreGrain",
    "CoordinatorGrain",
    "ParamShardGrain",
    "PipelineStageGrain",
    "ShardSnapshot",
    "TrainerGrain",
    "TrainingJob",
    "TrainingStatus",
    "load_job_file",
    "parse_job",
]

__getattr__ = lazy_exports(__name__, _LAZY)
