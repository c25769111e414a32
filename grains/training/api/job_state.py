"""A training job's persisted state: what its coordinator writes, and its driver reads and updates.

The coordinator grain's ``State`` (``CoordinatorGrain.State is JobState``). It
lives here, under the strategies and the coordinator, so a driver can name the
type it updates through its :class:`~grains.training.strategies.driver.JobContext`
without importing the coordinator (no import cycle, not even an annotation's).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import AliasChoices, BaseModel, Field

from grains.training.api.job import TrainingJob
from grains.training.api.messages import GroupChange, HistoryPoint, JobStatus, TensorKinds
from grains.training.data.position import Segment


class JobState(BaseModel):
    """One job as its coordinator keeps it in Redis (one writer at a time)."""

    __wire_aliases__: ClassVar[tuple[str, ...]] = ("CoordinatorGrain.State",)
    """Its name while it was the coordinator's nested class: states written then still load."""

    spec: TrainingJob | None = None
    status: JobStatus = "idle"
    generation: int = 0
    run: int = 0
    trainers: int = Field(0, validation_alias=AliasChoices("trainers", "slots"))
    """Trainers taking each step now (read under its old name ``slots`` too)."""
    total_steps: int = 0
    shard_keys: list[str] = Field(default_factory=list)
    shard_names: list[list[str]] = Field(default_factory=list)
    tensor_kinds: TensorKinds | None = None
    """The model's frozen parameters and buffers (shards restore without building the model)."""
    shard_activations: list[str] = Field(default_factory=list)
    trainer_keys: list[str] = Field(default_factory=list)
    trainer_silos: list[str] = Field(default_factory=list)
    """Silo each trainer key was placed on (allreduce: by rank)."""
    next_trainer: int = 0
    """Number for the next new trainer key (keys are never reused within a run)."""
    changes: list[GroupChange] = Field(default_factory=list)
    committed: list[int] = Field(default_factory=list)
    committed_at: dict[int, float] = Field(default_factory=dict)
    """When each committed checkpoint was committed (unix seconds)."""
    step: int = 0
    loss: float | None = None
    accuracy: float | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    eval_metrics: dict[str, float] = Field(default_factory=dict)
    eval_step: int | None = None
    eval_silo: str | None = None
    eval_device: str | None = None
    eval_pending: list[int] = Field(default_factory=list)
    """Committed checkpoints due for a mid-run evaluation, not yet evaluated."""
    train_size: int | None = None
    """Samples in the training split (None: a dataset without a length); for the epoch."""
    data_segments: list[Segment] = Field(default_factory=list)
    """The data position (:mod:`grains.training.data.position`), extended by the drivers
    whenever the trainer count changes; empty: one segment of ``trainers`` trainers from step 0."""
    resumed_from: int | None = None
    steps_run: float = 0.0
    """Global steps executed, redone ones included (never decreases)."""
    samples_run: int = 0
    stage_layers: list[tuple[int, int]] = Field(default_factory=list)
    """Pipeline mode: the model's child slice each stage runs (the cut is made once per start)."""
    shed_silos: list[str] = Field(default_factory=list)
    """Trainer silos this job stopped using after a trainer ran out of memory there."""
    released: bool = False
    """The job's grains were told to free their memory: its tensors are read from its last checkpoint."""
    started_at: float = 0.0
    finished_at: float = 0.0
    restarts: int = 0
    rollbacks: int = 0
    stopped_early: str = ""
    """Why the job ended before its last step (a callback's request), empty otherwise."""
    best_step: int | None = None
    """``keep_best``: the step of the best evaluation, whose checkpoint is kept."""
    best_value: float | None = None
    error: str = ""
    warnings: list[str] = Field(default_factory=list)
    """What went wrong without failing the job (a logger turned off), last 20."""
    mlflow_run_id: str = ""
    """The mlflow logger's run of this run of the job (a re-activated coordinator logs on in it)."""
    history: list[HistoryPoint] = Field(default_factory=list)
