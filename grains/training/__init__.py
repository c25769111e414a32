"""Distributed training grains: a parameter server built from virtual actors.

Run silos with ``redgrain silo --grains grains.training`` and submit a job::

    job = TrainingJob(mode="sync", trainers=2, shards=2, steps=300)
    await client.get_grain(CoordinatorGrain, "digits-1").start(job)

The grain classes live in their own modules; their ``__module__`` is set to
this package (as trio does for its public names), so a silo started with
``--grains grains.training`` hosts all four (``AllreduceTrainerGrain``: the
trainers of mode ``allreduce``).
"""

from grains.training.allreduce import AllreduceTrainerGrain
from grains.training.checkpointing import ShardSnapshot
from grains.training.coordinator import CoordinatorGrain
from grains.training.job import TrainingJob, load_job_file, parse_job
from grains.training.messages import TrainingStatus
from grains.training.shard import ParamShardGrain
from grains.training.trainer import TrainerGrain

for _cls in (AllreduceTrainerGrain, CoordinatorGrain, ParamShardGrain, TrainerGrain):
    _cls.__module__ = __name__
del _cls

__all__ = [
    "AllreduceTrainerGrain",
    "CoordinatorGrain",
    "ParamShardGrain",
    "ShardSnapshot",
    "TrainerGrain",
    "TrainingJob",
    "TrainingStatus",
    "load_job_file",
    "parse_job",
]
