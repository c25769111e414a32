"""The training job spec: what a user submits, validated before anything starts.

A spec travels to the coordinator as a registered pydantic model and is kept
in its state. :func:`grains.training.submit.check_job` goes beyond field validation: it imports the
model and dataset factories and builds the model once, so an unknown import
path or a model that does not fit the data fails with a ConfigError at
submit time, not minutes later on some silo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from silo.errors import ConfigError

Mode = Literal["sync", "async", "ssp", "allreduce", "pipeline"]
Precision = Literal["fp32", "bf16", "fp16"]
OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adamw")
"""Short optimizer names; anything else must be the import path of a torch.optim.Optimizer subclass."""
DEFAULT_STEP = "grains.training.steps:classification_step"
DEFAULT_EVALUATE = "grains.training.steps:classification_metrics"
DEFAULT_LOSS = "grains.training.steps:classification_loss"
"""Pipeline mode's loss when the job names none: cross-entropy on the last stage's output."""
LOGGER_NAMES = ("tensorboard", "mlflow")
"""What ``loggers`` may name (:mod:`grains.training.loggers`)."""


class TrainingJob(BaseModel):
    """One training job. Every field has a default, so ``TrainingJob()`` trains an MLP on digits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("grains.training.models:mlp", description="Model factory, `pkg.module:callable`.")
    model_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the model factory.")
    dataset: str = Field(
        "grains.training.datasets:digits",
        description="Dataset factory `pkg.module:callable`, called with split='train'|'test' and dataset_args.",
    )
    dataset_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the dataset factory.")
    step: str = Field(
        DEFAULT_STEP,
        description="Training step `pkg.module:fn`, fn(model, batch) -> loss or (loss, {name: float}).",
    )
    evaluate: str = Field(
        DEFAULT_EVALUATE,
        description="Evaluation `pkg.module:fn`, fn(model, batch) -> {name: float}; run in eval() under no_grad.",
    )
    eval_batch_size: int = Field(512, gt=0, description="Batch size of evaluation over the whole test split.")
    collate_fn: str | None = Field(
        None,
        description="`pkg.module:fn`, fn(list of dataset items) -> batch (e.g. padding variable-length text per"
        " batch); default: torch's default_collate, tuples kept.",
    )
    optimizer: str = Field(
        "sgd", description="sgd | momentum | adam | adamw, or the import path of a torch.optim.Optimizer subclass."
    )
    optimizer_args: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments of the optimizer (override lr, momentum, ...)."
    )
    param_groups: list[dict[str, Any]] = Field(
        default_factory=list,
        description='Parameter groups: [{"match": "<glob on names>" | [globs], <optimizer overrides>}], first match wins.',
    )
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="Used by optimizer='momentum'.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's and AdamW's betas.")
    eps: float = Field(1e-8, gt=0, description="Adam's and AdamW's epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay (AdamW's default when 0 here: 0.01 is not assumed).")
    lr_schedule: str | None = Field(
        None,
        description="A torch.optim.lr_scheduler class, or a function returning one (HF's"
        " get_linear_schedule_with_warmup), `pkg.module:name`, stepped once per global step.",
    )
    lr_schedule_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of lr_schedule.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps before (or instead of) lr_schedule.")
    clip_grad_norm: float | None = Field(
        None, gt=0, description="Clip the global gradient norm to this (as torch.nn.utils.clip_grad_norm_)."
    )
    on_nonfinite: Literal["fail", "skip"] = Field(
        "fail", description="A NaN or inf loss: fail the job, or skip that step's update."
    )
    init_from: str | None = Field(
        None, description="A saved state_dict file (torch.save) to start from; read by the coordinator's silo."
    )
    init_optimizer: bool = Field(
        False,
        description="With init_from: the file is {'model': state_dict, 'optimizer': optimizer.state_dict()} and the"
        " job starts with that optimizer's per-parameter state (momentum, Adam's moments).",
    )
    batch_size: int = Field(64, gt=0, description="Samples per trainer per step (global batch = trainers x this).")
    steps: int | None = Field(None, gt=0, description="Global steps to run (each trainer runs this many).")
    epochs: float | None = Field(None, gt=0, description="Alternative to steps: passes over the training set.")
    trainers: int | Literal["auto"] = Field(2, description="Trainer count, or 'auto': one per trainer silo.")
    shards: int = Field(1, gt=0, description="Parameter shards (parameters split by tensor, balanced by bytes).")
    mode: Mode = Field(
        "sync",
        description="sync | async | ssp (parameter server) | allreduce (torch.distributed group of trainers, no shards)"
        " | pipeline (the model cut into stages on different silos).",
    )
    staleness: int = Field(2, ge=0, description="ssp: how many steps a trainer may run ahead of the slowest.")
    delay_compensation: float = Field(
        2.0, ge=0,
        description="async/ssp with Adam, AdamW, NAdam or RAdam: lambda of the delay-compensated gradient"
        " g + lambda * g*g/sqrt(v) * (w_now - w_pulled) (DC-ASGD-a); 0: pushes are applied as computed.",
    )  # fmt: skip
    stages: int = Field(
        2, ge=1, description="pipeline: stages the model is cut into (with split_points: their number plus one)."
    )
    split_points: list[str] = Field(
        default_factory=list,
        description="pipeline: names of the submodules where a new stage begins (any module, cut by torch.fx);"
        " empty: the model is an nn.Sequential cut between children.",
    )
    loss: str | None = Field(
        None,
        description="pipeline: the loss `pkg.module:fn`, fn(output, target) -> loss or (loss, {name: float}), run on"
        " the last stage (default: cross-entropy).",
    )
    microbatches: int = Field(4, ge=1, description="pipeline: micro-batches per step (they must divide batch_size).")
    schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="pipeline: gpipe (all forwards, then all backwards) or 1f1b.")
    balance: Literal["bytes", "time"] = Field(
        "bytes", description="pipeline: balance the stages by parameter bytes, or by each layer's measured time."
    )
    compression: str = Field(
        "none", description="Gradient compression: none | fp16 | bf16 | topk:<ratio>[:fp16] (allreduce: none | fp16 | bf16)."
    )
    precision: Precision = Field(
        "fp32", description="fp32 | bf16 | fp16: autocast on trainers (fp16 with a gradient scaler on CUDA)."
    )
    autocast_bf16: bool = Field(False, description="Deprecated spelling of precision='bf16'.")
    loss_scale: float = Field(
        2.0**16, gt=0, description="fp16: the initial loss scale (torch.amp.GradScaler's default); halved on an overflow."
    )
    loss_scale_growth_interval: int = Field(
        2000, gt=0, description="fp16: clean steps after which the loss scale doubles (GradScaler's default)."
    )
    grad_accumulation: int = Field(
        1, ge=1,
        description="Chunks of batch_size samples each trainer accumulates per step: a step takes batch_size x this"
        " samples per trainer and equals one step on a batch that many times larger (pipeline: use microbatches).",
    )
    loader_workers: int = Field(0, ge=0, description="DataLoader worker processes per trainer (map-style datasets).")
    checkpoint_every: int = Field(50, ge=0, description="Consistent checkpoint every N steps (0: never).")
    keep_checkpoints: int = Field(2, gt=0, description="Committed checkpoints to retain.")
    ttl_after_finished_s: float | None = Field(
        7 * 24 * 3600.0,
        ge=0,
        description="Once the job has ended (completed, failed, cancelled), forget it after this"
        " long: its checkpoints, records and state leave Redis (as `redgrain jobs forget` does)."
        " None: keep it until forgotten. Export what you need first (`--save`, `state_dict()`).",
    )
    eval_every: int = Field(0, ge=0, description="Evaluate on the test split every N steps (0: only at the end).")
    seed: int = 0
    step_timeout_s: float = Field(120.0, gt=0, description="Longest a trainer waits on one shard exchange.")
    trainer_role: str = Field("trainer", description="Role whose silos host trainers, when any silo has it.")
    resume: bool = Field(
        False,
        description="Continue this job id's last run from its newest committed checkpoint (saved in any mode).",
    )
    resume_from_step: int | None = Field(
        None, ge=0,
        description="Continue this job id's last run from committed checkpoint N (not the newest): the later"
        " ones are abandoned, as a rollback abandons them. Implies resume.",
    )
    callbacks: list[str] = Field(
        default_factory=list,
        description="Callback classes or objects `pkg.module:name` with on_eval(step, metrics) (True stops the job:"
        " early stopping), on_checkpoint(step), on_end(status, step); run on the coordinator's silo.",
    )
    keep_best: str | None = Field(
        None,
        description="`eval.<metric>:max|min`: also keep the checkpoint whose mid-run evaluation was best"
        " (state_dict(best=True)), beside the newest ones.",
    )

    loggers: list[str] = Field(
        default_factory=list,
        description="Where the job's metrics, learning rate and checkpoint events are also written: tensorboard"
        " (event files in log_dir/<job>/run-<run>), mlflow (a run in mlflow_tracking_uri). Written by the"
        " coordinator's silo; a logger that fails is turned off with a warning, the job goes on.",
    )
    log_dir: str = Field(
        "runs", min_length=1,
        description="The loggers' directory on the coordinator's silo; a relative one is resolved against"
        " that silo process's working directory (give an absolute path on a shared disk in a cluster).",
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="The mlflow logger's tracking URI (a server, a file: URI); default: a file store in log_dir/mlruns."
    )

    @field_validator("loggers")
    @classmethod
    def _loggers(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in LOGGER_NAMES:
                raise ValueError(f"unknown logger {name!r}: use {' or '.join(map(repr, LOGGER_NAMES))}")
        if len(set(v)) != len(v):
            raise ValueError(f"loggers {v} name a logger twice")
        return v

    @field_validator("callbacks")
    @classmethod
    def _callbacks(cls, v: list[str]) -> list[str]:
        return [_import_path(p) for p in v]

    @field_validator("keep_best")
    @classmethod
    def _keep_best(cls, v: str | None) -> str | None:
        if v is not None:
            what, _, goal = v.rpartition(":")
            if not what.startswith("eval.") or len(what) <= 5 or goal not in ("max", "min"):
                raise ValueError(f"keep_best {v!r}: use 'eval.<metric>:max' or 'eval.<metric>:min', e.g. 'eval.accuracy:max'")
        return v

    @property
    def resuming(self) -> bool:
        """This start continues the job id's last run (``resume`` or ``resume_from_step``)."""
        return self.resume or self.resume_from_step is not None

    @property
    def best_metric(self) -> tuple[str, bool] | None:
        """``keep_best``'s metric name and whether larger is better."""
        if self.keep_best is None:
            return None
        what, _, goal = self.keep_best.rpartition(":")
        return what.removeprefix("eval."), goal == "max"

    @field_validator("trainers")
    @classmethod
    def _trainers(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("a job needs at least one trainer (or 'auto')")
        return v

    @field_validator("compression")
    @classmethod
    def _compression(cls, v: str) -> str:
        parse_compression(v)
        return v

    @field_validator("model", "dataset", "step", "evaluate")
    @classmethod
    def _path(cls, v: str) -> str:
        return _import_path(v)

    @field_validator("lr_schedule", "loss", "collate_fn")
    @classmethod
    def _schedule_path(cls, v: str | None) -> str | None:
        return None if v is None else _import_path(v)

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: str) -> str:
        return v if v in OPTIMIZER_NAMES else _import_path(v)

    @field_validator("param_groups")
    @classmethod
    def _groups(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, g in enumerate(v):
            match = g.get("match")
            globs = [match] if isinstance(match, str) else match
            if not isinstance(globs, list) or not globs or not all(isinstance(m, str) and m for m in globs):
                raise ValueError(f"param_groups[{i}] needs 'match': a glob on parameter names, or a list of globs")
            if "params" in g:
                raise ValueError(f"param_groups[{i}]: parameters are chosen by 'match', not 'params'")
        return v

    @model_validator(mode="before")
    @classmethod
    def _stages_of_split_points(cls, data: Any) -> Any:
        # split_points fix the stage count; `stages` may be left out, or must agree.
        if isinstance(data, dict) and isinstance(data.get("split_points"), list) and data["split_points"]:
            n = len(data["split_points"]) + 1
            if "stages" not in data:
                return {**data, "stages": n}
            if data["stages"] != n:
                raise ValueError(f"split_points {data['split_points']} cut the model into {n} stages, not stages={data['stages']}")
        return data

    @field_validator("split_points")
    @classmethod
    def _points(cls, v: list[str]) -> list[str]:
        if any(not isinstance(p, str) or not p for p in v):
            raise ValueError("split_points are names of submodules (model.named_modules()), e.g. 'layer2' or 'blocks.3'")
        if len(set(v)) != len(v):
            raise ValueError(f"split_points {v} name a submodule twice")
        return v

    @model_validator(mode="after")
    def _length(self) -> TrainingJob:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.mode == "pipeline":
            if self.batch_size % self.microbatches:
                raise ValueError(f"pipeline: microbatches={self.microbatches} does not divide batch_size={self.batch_size}")
            if self.step != DEFAULT_STEP:
                raise ValueError(
                    "pipeline: a step sees the whole model, which no stage holds; the loss runs on the last stage:"
                    " name it with loss = 'pkg.module:fn', fn(output, target) -> loss or (loss, {name: float})"
                    " (evaluate still runs on the whole model)"
                )
            if self.split_points and self.balance == "time":
                raise ValueError("pipeline: split_points fix the cut; balance = 'time' balances an nn.Sequential's cut")
            if self.compression not in ("none", "fp16", "bf16"):
                raise ValueError("pipeline: compression compresses activations and their gradients: none, fp16 or bf16")
            if self.amp == "fp16":
                raise ValueError("pipeline: precision fp16 needs one loss scale across stages, not built yet; use bf16")
            if self.grad_accumulation != 1:
                raise ValueError("pipeline: a step already accumulates its micro-batches; raise microbatches, not grad_accumulation")
        else:
            if self.split_points:
                raise ValueError(f"split_points cut a pipeline; mode is {self.mode!r}")
            if self.loss is not None:
                raise ValueError(f"loss is pipeline mode's hook (run on the last stage); mode {self.mode!r} takes a step")
        if self.init_optimizer and self.init_from is None:
            raise ValueError("init_optimizer reads the optimizer state of init_from's file: give init_from")
        if self.autocast_bf16 and self.precision == "fp16":
            raise ValueError("autocast_bf16 and precision='fp16' disagree; use precision alone")
        if self.mode == "allreduce" and parse_compression(self.compression).kind not in ("none", "fp16", "bf16"):
            raise ValueError(
                f"compression {self.compression!r} needs a parameter server; allreduce takes none, fp16 or bf16"
            )
        return self

    @property
    def trainer_batch(self) -> int:
        """Samples one trainer takes per step: ``batch_size x grad_accumulation``."""
        return self.batch_size * self.grad_accumulation

    @property
    def amp(self) -> Precision:
        """The precision trainers run at (``autocast_bf16`` is the old spelling of bf16)."""
        return "bf16" if self.autocast_bf16 else self.precision

    def total_steps(self, train_size: int | None, trainers: int) -> int:
        """Global steps of the job: ``steps``, or epochs over the global batch (default 1 epoch)."""
        if self.steps is not None:
            return self.steps
        if train_size is None:
            raise ConfigError("a dataset without a length (an IterableDataset) needs 'steps', not epochs")
        per_epoch = max(1, train_size // (self.trainer_batch * trainers))
        return max(1, math.ceil((self.epochs or 1.0) * per_epoch))


def _import_path(v: str) -> str:
    mod, sep, attr = v.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"{v!r} is not an import path of the form 'pkg.module:name'")
    return v


def parse_job(data: dict[str, Any] | TrainingJob) -> TrainingJob:
    """A TrainingJob from a mapping (TOML, JSON), with pydantic's errors as one ConfigError."""
    if isinstance(data, TrainingJob):
        return data
    try:
        return TrainingJob.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'job'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise ConfigError(f"bad training job spec: {problems}") from None


def load_job_file(path: str) -> tuple[str | None, TrainingJob]:
    """Read a job TOML: top-level fields of TrainingJob, plus an optional ``job`` id."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read job file {path}: {exc}") from exc
    job_id = data.pop("job", None)
    return (str(job_id) if job_id is not None else None), parse_job(data)


def resolve_path(path: str, what: str) -> Any:
    """The callable named by ``pkg.module:attr``; ConfigError saying why when it does not resolve."""
    import importlib

    mod_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {path!r}: cannot import module {mod_name!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{what} {path!r}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ConfigError(f"{what} {path!r} is not callable")
    return obj


# --- compression: what the spec's ``compression`` string means (the engine: loop/compression.py)
@dataclass(frozen=True, slots=True)
class CompressionSpec:
    kind: Literal["none", "fp16", "bf16", "topk"]
    ratio: float = 1.0
    """Share of each tensor's entries top-k sends (1.0 for the dense kinds)."""
    value_dtype: torch.dtype = torch.float32
    """The dtype top-k's values travel in (``topk:<ratio>:fp16``: float16); the dense
    kinds' dtype follows from ``kind``."""

    @property
    def pull_dtype(self) -> torch.dtype:
        """The dtype shards send parameters in for this compression."""
        return {"none": torch.float32, "bf16": torch.bfloat16}.get(self.kind, torch.float16)


def parse_compression(text: str) -> CompressionSpec:
    """``none`` | ``fp16`` | ``bf16`` | ``topk:<ratio>`` | ``topk:<ratio>:fp16`` with
    0 < ratio <= 1; ConfigError otherwise."""
    t = text.strip().lower()
    if t in ("none", "fp16", "bf16"):
        return CompressionSpec(t)  # type: ignore[arg-type]
    parts = [p.strip() for p in t.split(":")]
    if parts[0] == "topk" and len(parts) in (2, 3) and (len(parts) == 2 or parts[2] == "fp16"):
        try:
            ratio = float(parts[1])
        except ValueError:
            ratio = -1.0
        if 0.0 < ratio <= 1.0:  # also false for nan
            return CompressionSpec("topk", ratio, torch.float16 if len(parts) == 3 else torch.float32)
    raise ConfigError(
        f"bad compression {text!r}: use none, fp16, bf16, topk:<ratio> or topk:<ratio>:fp16"
        " with 0 < ratio <= 1 (e.g. topk:0.01)"
    )
