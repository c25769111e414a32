"""What training grains send each other and report (registered wire types)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from grains.immutable import immutable
from grains.training.api.job import TrainingJob
from grains.training.api.records import MicroBatchSpan, StageInfo
from grains.training.data.position import Segment

JobStatus = Literal["idle", "starting", "running", "completed", "failed", "cancelled"]


class TensorKinds(BaseModel):
    """Which of a holder's tensors are frozen parameters and which persistent buffers (the rest,
    of its names, are trainable), so it restores from a checkpoint without building the model."""

    frozen: list[str] = Field(default_factory=list)
    buffers: list[str] = Field(default_factory=list)


class ShardConfig(BaseModel):
    """A shard's part of the job; sent on (re)configuration with a new generation."""

    job: str
    index: int
    spec: TrainingJob
    names: list[str]
    """Tensors this shard owns (trainable and frozen parameters, persistent buffers), in model order."""
    shard_keys: list[str]
    """Keys of every shard of the job (the members of its checkpoints)."""
    trainers: int
    """Trainers pushing to this shard."""
    generation: int
    run: int = 0
    """Which start of the job this is; checkpoints of different runs never mix."""
    restore_step: int | None = None
    """Committed checkpoint to restore, or None to start from the seeded initial weights."""
    end_step: int = 0
    """The job's last step: always checkpointed (0: unknown, only every ``checkpoint_every``)."""
    kinds: TensorKinds | None = None
    """The kinds of this shard's tensors (None: not known; the shard builds the model to learn them)."""


@immutable
class ExchangeReply(BaseModel):
    """A shard's answer to a push/pull: its version and, if the caller's copy is stale, parameters.

    ``@immutable``: passed by reference to a trainer on the shard's silo. Neither side changes
    one after it is sent: the shard builds a new reply per call, and its published tensors are
    fresh for each version and never written to again (:meth:`ShardCore.publish`)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    version: int
    params: dict[str, torch.Tensor] | None = None
    """Trainable parameters (pull dtype) and buffers of ``version``; frozen parameters on a first pull."""
    staleness: int = 0
    """Updates applied between the version the pushed gradients were computed on and their apply."""
    gap: int = 0
    """ssp: how far ahead of the slowest trainer the caller was released."""


class ShardStatus(BaseModel):
    activation_id: str
    generation: int
    version: int
    next_steps: list[int]
    """Per trainer (by rank): the next step the shard expects from it."""
    saved_steps: list[int]
    """Checkpoint steps this shard has saved."""
    pushes: int = 0
    duplicates: int = 0
    """Pushes ignored because that (trainer, step) was already applied (retries)."""
    max_staleness: int = 0
    max_gap: int = 0
    skipped: int = 0
    """Steps whose update this shard skipped since it was configured (any trainer flagged them)."""
    silo: str = ""


class TrainerAssignment(BaseModel):
    """A parameter-server trainer's part in one generation (modes ``sync``, ``async``, ``ssp``)."""

    job: str
    rank: int
    """This trainer's index, 0 .. ``trainers`` - 1."""
    trainers: int
    spec: TrainingJob
    generation: int
    run: int = 0
    """Which start of the job this is (scopes the trainer's saved error-feedback residuals)."""
    start_step: int
    end_step: int
    shard_keys: list[str]
    shard_names: list[list[str]]
    data_segments: list[Segment] = Field(default_factory=list)
    """The job's data position (:mod:`grains.training.data.position`); empty: ``trainers`` trainers from step 0."""


class GroupAssignment(BaseModel):
    """An all-reduce trainer's part in one group generation (mode ``allreduce``)."""

    job: str
    run: int
    spec: TrainingJob
    generation: int
    """The group generation: a new one each time the coordinator re-forms the group."""
    rank: int
    trainers: int
    members: list[str]
    """Trainer keys by rank."""
    rendezvous: str
    """Redis key prefix of this generation's torch.distributed store."""
    backend: Literal["gloo", "nccl"] = "gloo"
    start_step: int
    end_step: int
    source: str | None = None
    """Trainer key holding the parameters and optimizer state of ``start_step`` (None: this one)."""
    restore_step: int | None = None
    """Committed checkpoint to load when no trainer holds ``start_step`` (None: seeded weights)."""
    data_segments: list[Segment] = Field(default_factory=list)
    """The job's data position (:mod:`grains.training.data.position`); empty: ``trainers`` trainers from step 0."""


@immutable
class StepPoint(BaseModel):
    """One trainer's figures of one step.

    ``@immutable``: a trainer's ``progress`` hands the coordinator on its silo the points by
    reference, not a codec copy of each (a point a step, read once a tick). A point is made
    once, when its step is committed, and nothing changes it after; its ``metrics`` are the
    step's own dict."""

    step: int
    loss: float
    metrics: dict[str, float] = Field(default_factory=dict)
    """What the job's step function returned beside the loss, on this trainer's batch
    (the default classification step: ``accuracy``)."""
    at: float = 0.0
    """Wall-clock time the step was committed."""


class TrainerProgress(BaseModel):
    activation_id: str
    silo: str
    generation: int = -1
    rank: int = -1
    """The trainer's index (a parameter-server trainer, an all-reduce rank, a hybrid pipeline copy)."""
    status: Literal["idle", "running", "done", "failed"] = "idle"
    step: int = 0
    """Next step this trainer will run."""
    loss: float = 0.0
    samples_per_s: float = 0.0
    steps_done: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    max_staleness: int = 0
    mean_staleness: float = 0.0
    max_gap: int = 0
    error: str = ""
    fatal: bool = False
    """The failure would repeat if retried (the step broke its contract, a non-finite loss with
    on_nonfinite='fail', out of memory): the job fails at once with ``error``."""
    exchange_s: float = 0.0
    """Time this run waited for its exchanges (parameter server: the shards' replies, after the
    step's compute; allreduce: the collectives)."""
    out_of_memory: bool = False
    """The failure was out of memory: an elastic job sheds this trainer's silo instead of failing."""
    skipped: int = 0
    """Steps whose update was skipped (non-finite loss with on_nonfinite='skip', fp16 overflow)."""
    first_step_at: float | None = None
    """Wall-clock time this run's first step was committed (parameter-server mode)."""
    points: list[StepPoint] = Field(default_factory=list)
    held_run: int = -1
    """All-reduce: the run whose state this trainer holds (-1: none)."""
    held_step: int = -1
    """All-reduce: the step whose parameters and optimizer state this trainer holds (-1: none)."""
    saved_steps: list[int] = Field(default_factory=list)
    """All-reduce: checkpoint steps this trainer saved (complete snapshots)."""
    trainers: int = 0
    """All-reduce: the group's size (0: not said)."""


class GroupChange(BaseModel):
    """One recovery or resize: an all-reduce group re-formed; in parameter-server mode a
    rollback to a checkpoint (a shard lost, a trainer added) or trainers restarted.

    Kept in the coordinator's state: ``trainers`` and ``ranks`` are read under their old
    names ``world`` and ``slots`` too."""

    generation: int
    reason: str
    at: float
    """When the coordinator decided it."""
    trainers: int = Field(validation_alias=AliasChoices("trainers", "world"))
    """Trainers from ``start_step`` on."""
    start_step: int
    first_step_at: float | None = None
    """When the new group (or the restarted trainers) committed its first step (None: not yet)."""
    ranks: list[int] = Field(default_factory=list, validation_alias=AliasChoices("ranks", "slots"))
    """Parameter-server mode: the ranks of the trainers restarted (empty: every trainer)."""


class HistoryPoint(BaseModel):
    """One point of the job's curves (:mod:`grains.training.history`): a training point
    (``loss``, ``metrics``: the trainers' mean at ``step``) or an evaluation point
    (``eval_metrics``: the evaluation of checkpoint ``step``), never both."""

    step: int
    loss: float | None = None
    """Training loss at ``step`` (None on an evaluation point)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Training metrics of the step function, averaged over the trainers (empty on an evaluation point)."""
    eval_metrics: dict[str, float] | None = None
    """The evaluation of checkpoint ``step`` (None: a training point)."""
    samples_per_s: float = 0.0
    at: float = 0.0


class TrainingStatus(BaseModel):
    """The job as the coordinator sees it: what `status()` returns and the CLI shows."""

    job: str
    status: JobStatus = "idle"
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    """Training loss: the mean of the trainers' latest steps."""
    accuracy: float | None = None
    """Evaluation accuracy (``eval_metrics["accuracy"]``) when the evaluation reports one."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Training metrics by name (latest, mean over trainers), beside ``loss``."""
    eval_metrics: dict[str, float] = Field(default_factory=dict)
    """The latest evaluation on the test split, by name (the default: ``loss``, ``accuracy``)."""
    eval_step: int | None = None
    """The step the latest evaluation ran at (a committed checkpoint's)."""
    eval_silo: str | None = None
    """The silo that ran the latest evaluation (a trainer's, or the coordinator's: pipeline mode,
    or no trainer could answer)."""
    eval_device: str | None = None
    """The device it ran on (that silo's)."""
    epoch: float = 0.0
    """Passes over the training set so far (0 for a dataset without a length)."""
    data_epoch: int = 0
    """The epoch whose permutation the current step reads (0 for a dataset without a length)."""
    data_offset: int = 0
    """Where the current step's samples begin in that epoch (a stream: the offset in the stream)."""
    steps_run: float = 0.0
    """Global steps executed so far, redone ones included (a counter: never goes back on a rollback)."""
    samples_run: int = 0
    """Training samples processed so far, redone steps included (a counter)."""
    samples_per_s: float = 0.0
    bytes_per_step: float = 0.0
    """Bytes of tensors on the wire per global step (pushes + pulls of all trainers)."""
    exchange_ms_per_step: float = 0.0
    """Mean over trainers of the time a step waited for its exchange (wire, shards, slower peers)."""
    max_staleness: int = 0
    max_gap: int = 0
    trainers: int = 0
    shards: int = 0
    generation: int = 0
    run: int = 0
    """Which start of this job id it is (a finished job may be started again)."""
    checkpoints: list[int] = Field(default_factory=list)
    resumed_from: int | None = None
    """The checkpoint step this start of the job restored (None: it began from its initial weights)."""
    restarts: int = 0
    """Trainers restarted after one was lost."""
    rollbacks: int = 0
    skipped: int = 0
    """Steps of the current generation whose update was skipped everywhere (a non-finite loss with
    on_nonfinite='skip', an fp16 overflow)."""
    stopped_early: str = ""
    """Why the job ended before its last step (a callback's request); empty otherwise."""
    best_step: int | None = None
    """``keep_best``: the step of the best evaluation, kept as ``state_dict(best=True)``."""
    best_metric: str = ""
    """``keep_best``'s metric (``eval.accuracy``); empty without ``keep_best``."""
    best_value: float | None = None
    """Its value at ``best_step``."""
    """Times every grain went back to the last checkpoint (a shard or the coordinator was lost)."""
    elapsed_s: float = 0.0
    error: str = ""
    warnings: list[str] = Field(default_factory=list)
    """What went wrong without failing the job (a logger turned off), oldest first (last 20)."""
    mode: str = ""
    changes: list[GroupChange] = Field(default_factory=list)
    """All-reduce group re-formings and elastic trainer additions, oldest first (last 20)."""
    coordinator_silo: str = ""
    stages: list[StageInfo] = Field(default_factory=list)
    """Pipeline mode: every stage's silo, per-micro-batch times and latest step's timeline."""
    trainer_keys: list[str] = Field(default_factory=list)
    shard_keys: list[str] = Field(default_factory=list)
    trainer_silos: list[str] = Field(default_factory=list)
    shard_silos: list[str] = Field(default_factory=list)


class StageConfig(BaseModel):
    """A pipeline stage's part of the job (mode ``pipeline``); sent with a new generation."""

    job: str
    run: int
    index: int
    spec: TrainingJob
    layers: tuple[int, int]
    """The slice ``[start, end)`` of the model's ``nn.Sequential`` children this stage runs."""
    stage_keys: list[str]
    """Keys of this trainer's stages, in pipeline order (rank 0's: the members of the job's checkpoints)."""
    rank: int = 0
    """Which trainer (copy of the whole pipeline) this stage belongs to (hybrid parallelism: ``trainers`` copies)."""
    peer_keys: list[str] = Field(default_factory=list)
    """This stage in every trainer, by rank (one entry: one trainer)."""
    checkpoint_keys: list[str] = Field(default_factory=list)
    """Rank 0's stage keys: the members of the job's checkpoints."""
    generation: int
    start_step: int = 0
    end_step: int = 0
    restore_step: int | None = None
    """Committed checkpoint to restore (None: the seeded initial weights)."""
    keep: bool = False
    """Go on from the state this stage holds (at ``start_step``): the hybrid job shrank to fewer
    trainers without a rollback."""
    data_segments: list[Segment] = Field(default_factory=list)
    """The job's data position (:mod:`grains.training.data.position`); empty: one segment of
    ``len(peer_keys)`` trainers from step 0."""


class StageStatus(BaseModel):
    activation_id: str
    generation: int
    silo: str = ""
    status: Literal["idle", "running", "done", "failed"] = "idle"
    """Stage 0 runs the job's steps; the others report ``running`` while configured."""
    step: int = 0
    """Steps applied (the next step to run)."""
    loss: float = 0.0
    saved_steps: list[int] = Field(default_factory=list)
    error: str = ""
    fatal: bool = False
    forward_ms: float = 0.0
    """Mean compute time of one micro-batch's forward on this stage."""
    backward_ms: float = 0.0
    timeline: list[MicroBatchSpan] = Field(default_factory=list)
    """This stage's spans in its latest applied step."""
    param_bytes: int = 0
    """Bytes of the parameters this stage holds (its share of the model)."""
    points: list[StepPoint] = Field(default_factory=list)
    """Stage 0: per-step loss points from the asked step on."""
    samples_per_s: float = 0.0
    steps_done: int = 0
    skipped: int = 0
    """Steps of this generation whose update was skipped (non-finite loss, on_nonfinite='skip')."""


class StaleGenerationError(Exception):
    """The job moved on (rollback or restart); the caller belongs to an older generation."""


class Evaluation(BaseModel):
    """One evaluation of a committed checkpoint: its step, the metrics, and where it ran."""

    step: int
    metrics: dict[str, float]
    silo: str
    device: str
