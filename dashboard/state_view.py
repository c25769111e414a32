"""Persisted grain state as JSON, without the grain classes.

The dashboard imports no user code, so it cannot build the registered
pydantic models or dataclasses a state holds. It decodes them as
``{"__type__": name, ...fields}`` instead, and shows tensors and arrays as
their dtype, shape and a numeric summary rather than every element.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import math
import uuid
from typing import Any

from grains.ids import GrainId, SiloAddress
from silo.codec import Codec, TypeRegistry

_MAX_ITEMS = 200  # per list / dict shown
_MAX_DEPTH = 12
_HEAD = 8  # leading elements of a tensor shown


@dataclasses.dataclass(frozen=True, slots=True)
class Opaque:
    """A registered value whose class the dashboard does not have."""

    name: str
    fields: Any


class _LenientCodec(Codec):
    def _build(self, name: str, fields: Any) -> Any:
        return Opaque(name, fields)


def decoder() -> Codec:
    """A codec that decodes any registered type as an ``Opaque``."""
    return _LenientCodec(TypeRegistry())


def to_json(value: Any, depth: int = 0) -> Any:
    """Any decoded value as something json.dumps accepts (bounded in size)."""
    if depth > _MAX_DEPTH:
        return "…"
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Opaque):
        inner = to_json(value.fields, depth + 1)
        return (
            {"__type__": value.name, **inner}
            if isinstance(inner, dict)
            else {"__type__": value.name, "value": inner}
        )
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for i, (k, v) in enumerate(value.items()):
            if i == _MAX_ITEMS:
                out["…"] = f"{len(value) - _MAX_ITEMS} more"
                break
            out[k if isinstance(k, str) else str(k)] = to_json(v, depth + 1)
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        shown = [to_json(v, depth + 1) for v in items[:_MAX_ITEMS]]
        if len(items) > _MAX_ITEMS:
            shown.append(f"… {len(items) - _MAX_ITEMS} more")
        return shown
    if isinstance(value, (bytes, bytearray, memoryview)):
        b = bytes(value[:32])
        return {"kind": "bytes", "size": len(value), "head": b.hex()}
    if isinstance(value, (uuid.UUID, dt.datetime, GrainId, SiloAddress)):
        return str(value)
    if isinstance(value, enum.Enum):
        return to_json(value.value, depth + 1)
    summary = _array_summary(value)
    if summary is not None:
        return summary
    return repr(value)[:200]


def _array_summary(value: Any) -> dict[str, Any] | None:
    kind = type(value).__module__.split(".")[0]
    if kind == "torch":
        import torch

        if not isinstance(value, torch.Tensor):
            return None
        dtype = str(value.dtype).removeprefix("torch.")
        flat = value.detach().reshape(-1)
        numeric = flat.is_floating_point() or flat.dtype in (torch.int8, torch.int16, torch.int32,
                                                              torch.int64, torch.uint8)  # fmt: skip
        stats = flat.double() if numeric and flat.numel() else None
        head = flat[:_HEAD].double().tolist() if numeric else flat[:_HEAD].tolist()
        return _summary("tensor", dtype, list(value.shape), flat.numel(), stats, head)
    if kind == "numpy":
        import numpy as np

        if not isinstance(value, np.ndarray):
            return None
        arr = value.reshape(-1)
        numeric = arr.dtype.kind in "biuf"
        values = arr.astype(np.float64) if numeric and arr.size else None
        head = [x.item() if hasattr(x, "item") else x for x in arr[:_HEAD]]
        return _summary("ndarray", str(value.dtype), list(value.shape), int(arr.size), values, head)
    return None


def _summary(
    kind: str, dtype: str, shape: list[int], numel: int, stats: Any, head: list[Any]
) -> dict[str, Any]:
    summary: dict[str, Any] = {"numel": numel, "head": [to_json(x) for x in head]}
    if stats is not None:
        summary.update(
            min=to_json(float(stats.min())),
            max=to_json(float(stats.max())),
            mean=to_json(float(stats.mean())),
            std=to_json(float(stats.std())) if numel > 1 else 0.0,
        )
    return {"kind": kind, "dtype": dtype, "shape": shape, "summary": summary}
