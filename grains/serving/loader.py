"""A replica's model: built, loaded with weights, in ``eval()``, and run one merged batch at a time.

:func:`from_job` builds the job's own model (its factory and arguments, from
the coordinator's spec) and loads the job's ``state_dict``; :func:`from_file`
builds ``spec.model`` and loads a ``torch.save``d ``state_dict`` (tensors
only: ``weights_only=True``). Both load strictly, so weights that do not fit
the model fail the load, never a request. Everything here runs off the event
loop (the replica calls it through ``run_in_thread``).

A :class:`LoadedModel` is never changed once built: a hot reload builds a new
one and the replica swaps its reference, so a batch already running finishes
on the weights it started with.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from grains.serving.errors import BadInputError, RequestTooLargeError
from grains.serving.spec import Datatype, ModelInfo, ServeSpec, TensorSpec
from grains.serving.tensors import Inputs, split
from grains.training.api.job import TrainingJob, resolve_path
from silo.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16, "INT32": torch.int32,
    "INT64": torch.int64, "FP16": torch.float16, "FP32": torch.float32, "FP64": torch.float64, "BF16": torch.bfloat16,
}  # fmt: skip
DATATYPES: dict[torch.dtype, Datatype] = {v: k for k, v in DTYPES.items()}  # type: ignore[misc]


def datatype_of(t: torch.Tensor) -> Datatype:
    dt = DATATYPES.get(t.dtype)
    if dt is None:
        raise BadInputError(f"tensors of dtype {t.dtype} cannot be served")
    return dt


class LoadedModel:
    """A model in ``eval()`` with its hooks and its tensors' description."""

    def __init__(
        self, model: nn.Module, info: ModelInfo, device: str,
        pre: Callable[[Any], Any] | None = None, post: Callable[[Any], Any] | None = None,
    ) -> None:  # fmt: skip
        self.model = model.eval()
        self.info = info
        self.device = torch.device(device)
        self._pre, self._post = pre, post

    # --- what a request must look like ------------------------------------------
    def check(self, inputs: Inputs) -> int:
        """The request's row count; BadInputError / RequestTooLargeError naming what is expected."""
        specs = self.info.inputs
        if isinstance(inputs, torch.Tensor):
            if len(specs) != 1:
                raise BadInputError(f"model {self.info.name} takes inputs {[s.name for s in specs]}, by name")
            named = {specs[0].name: inputs}
        elif isinstance(inputs, Mapping):
            named = dict(inputs)
        else:
            raise BadInputError(f"inputs must be a tensor or a dict of tensors, not {type(inputs).__name__}")
        want = {s.name for s in specs}
        if set(named) != want:
            raise BadInputError(f"model {self.info.name} takes inputs {sorted(want)}, got {sorted(named)}")
        rows: int | None = None
        for s in specs:
            t = named[s.name]
            if not isinstance(t, torch.Tensor):
                raise BadInputError(f"input {s.name} must be a tensor, not {type(t).__name__}")
            shape = list(t.shape)
            if t.dtype != DTYPES[s.datatype]:
                raise BadInputError(f"input {s.name}: datatype {DATATYPES.get(t.dtype, str(t.dtype))}, expected {s.datatype}"
                                    f" with shape {s.shape}")  # fmt: skip
            if len(shape) != len(s.shape) or any(w not in (-1, g) for w, g in zip(s.shape, shape, strict=True)):
                raise BadInputError(f"input {s.name}: shape {shape}, expected {s.shape} (-1: any size)")
            if shape[0] < 1 or (rows is not None and shape[0] != rows):
                raise BadInputError(f"input {s.name}: {shape[0]} rows; every input needs the same number, at least 1")
            rows = shape[0]
        assert rows is not None
        if rows > self.info.max_request_rows:
            raise RequestTooLargeError(f"{rows} rows in one request; model {self.info.name} takes at most"
                                       f" {self.info.max_request_rows}")  # fmt: skip
        return rows

    # --- a merged batch ------------------------------------------------------------
    def forward(self, items: Sequence[Inputs], rows: Sequence[int]) -> list[Inputs]:
        """One forward pass over the requests ``items`` stacked; each request's rows back."""
        names = [s.name for s in self.info.inputs]
        single = len(names) == 1
        merged: dict[str, torch.Tensor] = {}
        for n in names:
            parts = [it if isinstance(it, torch.Tensor) else it[n] for it in items]
            merged[n] = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.device, non_blocking=True)
        with torch.inference_mode():
            x: Any = merged[names[0]] if single else merged
            if self._pre is not None:
                x = self._pre(x)
            y = self.model(**x) if isinstance(x, dict) else self.model(x)
            if self._post is not None:
                y = self._post(y)
        return split(y, list(rows))


def _hook(path: str | None, what: str) -> Callable[[Any], Any] | None:
    return None if path is None else resolve_path(path, what)


def _describe(model: nn.Module, inputs: list[TensorSpec], spec: ServeSpec, name: str, device: str,
              pre: Callable[[Any], Any] | None, post: Callable[[Any], Any] | None) -> list[TensorSpec]:  # fmt: skip
    """The outputs' description, from one forward pass on a zero row (which also proves the model runs)."""
    info = ModelInfo(name=name, version="", inputs=inputs, outputs=[], max_batch_size=spec.max_batch_size,
                     max_request_rows=spec.max_request_rows)  # fmt: skip
    probe = LoadedModel(model, info, device, pre, post)
    row = {s.name: torch.zeros([1, *[max(1, d) for d in s.shape[1:]]], dtype=DTYPES[s.datatype]) for s in inputs}
    (out,) = probe.forward([row if len(row) > 1 else row[inputs[0].name]], [1])
    if isinstance(out, torch.Tensor):
        return [TensorSpec(name="output", datatype=datatype_of(out), shape=[-1, *out.shape[1:]])]
    return [TensorSpec(name=k, datatype=datatype_of(v), shape=[-1, *v.shape[1:]]) for k, v in out.items()]


def _finish(model: nn.Module, state: Mapping[str, torch.Tensor], inputs: list[TensorSpec], spec: ServeSpec,
            name: str, version: str, step: int, device: str) -> LoadedModel:  # fmt: skip
    model.load_state_dict(dict(state), strict=True)
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    pre, post = _hook(spec.preprocess, "preprocess"), _hook(spec.postprocess, "postprocess")
    outputs = _describe(model, inputs, spec, name, device, pre, post)
    info = ModelInfo(name=name, version=version, step=step, inputs=inputs, outputs=outputs,
                     max_batch_size=spec.max_batch_size, max_request_rows=spec.max_request_rows)  # fmt: skip
    return LoadedModel(model, info, device, pre, post)


_PROBE_ITEMS = 8
"""Test items collated one at a time to read the inputs: dimensions that differ between them are -1."""


def job_inputs(job: TrainingJob) -> list[TensorSpec]:
    """The model's inputs as the job feeds them: items of its test split, each collated alone
    by the job's ``collate_fn`` (else torch's default), their features described (a tuple
    batch's first element; a mapping's entries but ``labels``). A dimension that differs
    between items (a padded sequence's length) is ``-1``. ConfigError naming ``--input`` when
    the features are not tensors (token lists with no ``collate_fn`` to pad them)."""
    from itertools import islice

    from grains.training.data.batches import collate, collate_function
    from grains.training.datasets import load_dataset

    ds: Any = load_dataset(job, "test")
    items = [ds[i] for i in range(min(_PROBE_ITEMS, len(ds)))] if hasattr(ds, "__len__") else list(islice(ds, _PROBE_ITEMS))
    collate_fn = collate_function(job) or collate
    try:
        each = [_features(collate_fn([item])) for item in items]
    except Exception as exc:  # noqa: BLE001 - a user's dataset or collate_fn may raise anything
        raise ConfigError(
            f"the model's inputs cannot be read from the test split of {job.dataset} ({type(exc).__name__}: {exc});"
            " name them with --input NAME:DATATYPE:SHAPE (e.g. --input input_ids:INT64:-1,-1)"
        ) from None
    first = each[0]
    out = []
    for name, t in first.items():
        dims = [d if all(len(f[name].shape) == t.dim() and f[name].shape[i] == d for f in each) else -1
                for i, d in enumerate(t.shape)]  # fmt: skip
        out.append(TensorSpec(name=name, datatype=datatype_of(t), shape=[-1, *dims[1:]]))
    return out


def _features(batch: Any) -> dict[str, torch.Tensor]:
    """A collated batch's model inputs by name (``input`` for a lone tensor)."""
    x = batch[0] if isinstance(batch, tuple | list) else batch
    found = {k: v for k, v in x.items() if k != "labels"} if isinstance(x, Mapping) else {"input": x}
    for name, v in found.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            raise TypeError(f"feature {name!r} of a collated batch is {type(v).__name__}"
                            f"{'' if not isinstance(v, torch.Tensor) else ' of no dimension'}, not a batch of tensors")  # fmt: skip
    if not found:
        raise TypeError("a collated batch has no features")
    return found


def from_job(job: TrainingJob, state: Mapping[str, torch.Tensor], spec: ServeSpec, name: str, step: int,
             device: str) -> LoadedModel:  # fmt: skip
    from grains.training.models import build_model

    inputs = list(spec.inputs) if spec.inputs else job_inputs(job)
    return _finish(build_model(job), state, inputs, spec, name, f"{spec.job} step {step}", step, device)


def weights_stamp(path: str) -> float:
    """The weights file's modification time: a newer file is a newer version."""
    return os.stat(path).st_mtime


def from_file(spec: ServeSpec, name: str, device: str) -> LoadedModel:
    assert spec.model is not None and spec.weights is not None and spec.inputs
    factory = resolve_path(spec.model, "model")
    model = factory(**spec.model_args)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {spec.model} returned {type(model).__name__}, not a torch.nn.Module")
    stamp = weights_stamp(spec.weights)
    state = torch.load(spec.weights, map_location="cpu", weights_only=True)
    version = f"{os.path.basename(spec.weights)} @ {stamp:.3f}"
    return _finish(model, state, list(spec.inputs), spec, name, version, 0, device)
