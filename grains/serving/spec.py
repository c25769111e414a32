"""What a deployment says: where the weights come from, the hooks, the batching knobs.

A :class:`ServeSpec` is stored by the model's :class:`~grains.serving.model.DeploymentGrain`
(key = the model's name) and read by every replica, so one ``deploy`` reaches
all silos. :class:`ModelInfo` is what a loaded replica reports about its
tensors: the Open Inference Protocol's model metadata, and the check every
request meets before it may join a batch. Torch-free: datatypes are the
protocol's names (``FP32``), mapped to torch in :mod:`grains.serving.loader`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from silo.errors import ConfigError

Datatype = Literal["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16"]


class TensorSpec(BaseModel):
    """One input or output: its name, datatype and shape, the batch dimension first as -1."""

    model_config = ConfigDict(frozen=True)

    name: str
    datatype: Datatype = "FP32"
    shape: list[int] = Field(description="With the batch dimension: [-1, 64] for rows of 64 values.")


class ServeSpec(BaseModel):
    """A served model. Weights from a training job (``job``) or from a ``state_dict`` file
    (``weights``, with the ``model`` factory that builds the module it fits)."""

    model_config = ConfigDict(frozen=True)

    job: str | None = Field(None, description="Serve this training job's weights; newer checkpoints are swapped in.")
    model: str | None = Field(None, description="Model factory `pkg.module:callable` (with `weights`).")
    model_args: dict[str, object] = Field(default_factory=dict)
    weights: str | None = Field(None, description="A torch.save'd state_dict, read on each replica's silo.")
    inputs: list[TensorSpec] | None = Field(
        None, description="The model's inputs (one: a tensor argument; several: keyword arguments). "
        "Default for a job: one FP32 input `input` shaped like its dataset's rows.",
    )
    preprocess: str | None = Field(None, description="`pkg.module:fn(inputs) -> model inputs`, on each merged batch.")
    postprocess: str | None = Field(None, description="`pkg.module:fn(outputs) -> outputs`, batch-first, on each batch.")
    max_batch_size: int = Field(64, ge=1, description="Most rows in one forward pass.")
    max_delay_ms: float = Field(
        0.0, ge=0.0, description="Longest a request waits for others to fill its batch when a forward slot is free "
        "(0: go at once; requests arriving during a forward pass join the next one anyway).",
    )
    max_concurrent_batches: int = Field(1, ge=1, description="Forward passes one replica runs at a time.")
    inline_below_ms: float = Field(
        10.0, ge=0.0, description="A forward pass measured shorter than this runs on the silo's event loop: on the "
        "executor the GIL hand-offs with the loop cost more than the pass (0: always on the executor; a silo shared "
        "with latency-sensitive grains may want less). Longer passes never hold the loop.",
    )
    max_request_rows: int = Field(1024, ge=1, description="Rows one request may carry (more: 413).")
    reload_poll_s: float = Field(1.0, gt=0.0, description="How often replicas look for newer weights.")

    @model_validator(mode="after")
    def _one_source(self) -> ServeSpec:
        if (self.job is None) == (self.weights is None):
            raise ValueError("give exactly one of `job` or `weights`")
        if self.weights is not None and self.model is None:
            raise ValueError("`weights` needs the `model` factory that builds the module they fit")
        if self.weights is not None and not self.inputs:
            raise ValueError("a model served from `weights` needs its `inputs` (name, datatype, shape)")
        for path, what in ((self.model, "model"), (self.preprocess, "preprocess"), (self.postprocess, "postprocess")):
            if path is not None and ":" not in path:
                raise ValueError(f"{what} must be an import path `pkg.module:name`, not {path!r}")
        return self


def parse_spec(spec: ServeSpec | dict[str, object]) -> ServeSpec:
    """A ServeSpec, or ConfigError saying what is wrong with it."""
    if isinstance(spec, ServeSpec):
        return spec
    try:
        return ServeSpec.model_validate(spec)
    except ValueError as exc:
        raise ConfigError(f"bad serve spec: {exc}") from None


class ModelInfo(BaseModel):
    """What a loaded replica serves: the model metadata of the Open Inference Protocol."""

    name: str
    version: str = Field(description="Weights version: `<job> step <n>` or the weights file's modification time.")
    step: int = Field(0, description="Training step of the weights (0: a file).")
    platform: str = "pytorch"
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int
    max_request_rows: int
