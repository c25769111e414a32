"""The training job spec: what a user submits, validated before anything starts.

A spec travels to the coordinator as a registered pydantic model and is kept
in its state. :func:`check_job` goes beyond field validation: it imports the
model and dataset factories and builds the model once, so an unknown import
path or a model that does not fit the data fails with a ConfigError at
submit time, not minutes later on some silo.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from grains.training.compression import parse_compression
from silo.errors import ConfigError

Mode = Literal["sync", "async", "ssp", "allreduce"]
OptimizerName = Literal["sgd", "momentum", "adam"]


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
    optimizer: OptimizerName = "sgd"
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="Used by optimizer='momentum'.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's betas.")
    eps: float = Field(1e-8, gt=0, description="Adam's epsilon.")
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(64, gt=0, description="Samples per trainer per step (global batch = trainers x this).")
    steps: int | None = Field(None, gt=0, description="Global steps to run (each trainer runs this many).")
    epochs: float | None = Field(None, gt=0, description="Alternative to steps: passes over the training set.")
    trainers: int | Literal["auto"] = Field(2, description="Trainer count, or 'auto': one per trainer silo.")
    shards: int = Field(1, gt=0, description="Parameter shards (parameters split by tensor, balanced by bytes).")
    mode: Mode = Field(
        "sync",
        description="sync | async | ssp (parameter server) | allreduce (torch.distributed group of trainers, no shards).",
    )
    staleness: int = Field(2, ge=0, description="ssp: how many steps a trainer may run ahead of the slowest.")
    compression: str = Field(
        "none", description="Gradient compression: none | fp16 | bf16 | topk:<ratio> (allreduce: none | fp16 | bf16)."
    )
    autocast_bf16: bool = Field(False, description="Run trainers' forward/backward under bf16 autocast.")
    checkpoint_every: int = Field(50, ge=0, description="Consistent checkpoint every N steps (0: never).")
    keep_checkpoints: int = Field(2, gt=0, description="Committed checkpoints to retain.")
    eval_every: int = Field(0, ge=0, description="Evaluate on the test split every N steps (0: only at the end).")
    seed: int = 0
    step_timeout_s: float = Field(120.0, gt=0, description="Longest a trainer waits on one shard exchange.")
    trainer_role: str = Field("trainer", description="Role whose silos host trainers, when any silo has it.")
    resume: bool = Field(
        False,
        description="Continue this job id's last run from its newest committed checkpoint (saved in any mode).",
    )

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

    @field_validator("model", "dataset")
    @classmethod
    def _path(cls, v: str) -> str:
        mod, sep, attr = v.partition(":")
        if not sep or not mod or not attr:
            raise ValueError(f"{v!r} is not an import path of the form 'pkg.module:factory'")
        return v

    @model_validator(mode="after")
    def _length(self) -> TrainingJob:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.mode == "allreduce" and parse_compression(self.compression).kind not in ("none", "fp16", "bf16"):
            raise ValueError(
                f"compression {self.compression!r} needs a parameter server; allreduce takes none, fp16 or bf16"
            )
        return self

    def total_steps(self, train_size: int, trainers: int) -> int:
        """Global steps of the job: ``steps``, or epochs over the global batch (default 1 epoch)."""
        if self.steps is not None:
            return self.steps
        per_epoch = max(1, train_size // (self.batch_size * trainers))
        return max(1, math.ceil((self.epochs or 1.0) * per_epoch))


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


def check_job(spec: TrainingJob) -> dict[str, int]:
    """Resolve the factories and build the model once; returns parameter sizes by name.

    Raises ConfigError with the reason when the model or dataset path does not
    resolve, a factory fails, or the model has no parameters.
    """
    from grains.training.datasets import load_dataset
    from grains.training.models import build_model

    load_dataset(spec, "train")  # resolves and builds; small built-ins are cached
    model = build_model(spec)
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    if not sizes:
        raise ConfigError(f"model {spec.model} has no parameters to train")
    return sizes


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
