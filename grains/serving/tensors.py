"""What requests carry, and how several requests' rows travel as one: signature, merge, split.

A request is a tensor, or a dict of tensors, rows first. Requests merge
(client side in :mod:`grains.serving.coalescer`, on the replica in its
:class:`~grains.serving.batcher.DynamicBatcher`) only when their
:func:`signature` matches: the same input names, dtypes and shapes past the
row dimension, which is exactly what ``torch.cat`` along the rows accepts. A
model input declared with ``-1`` past the rows (``[-1, -1]``: rows of any
length) lets requests of different signatures reach one replica; each batch
still holds only one. Both sides use these functions, so "what may merge" is
decided in one place.

An :class:`Inference` is an answer with the weights that computed it, so a
caller can tell which checkpoint answered while versions swap under load.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Inputs = torch.Tensor | dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Inference:
    """A request's outputs and the version and step of the weights that computed all of them."""

    outputs: Inputs
    version: str
    step: int

    def split(self, rows: list[int]) -> list[Inference]:
        """One answer per merged request: its rows of the outputs, the same weights."""
        return [Inference(out, self.version, self.step) for out in split(self.outputs, rows)]


def signature(inputs: Any) -> tuple[int, Hashable] | None:
    """Rows and what must match to merge (None: not a tensor or a dict of same-row tensors)."""
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() < 1 or inputs.shape[0] < 1:
            return None
        return int(inputs.shape[0]), ("", inputs.dtype, tuple(inputs.shape[1:]))
    if isinstance(inputs, Mapping) and inputs and all(isinstance(v, torch.Tensor) for v in inputs.values()):
        rows = {int(v.shape[0]) if v.dim() else -1 for v in inputs.values()}
        if len(rows) != 1 or min(rows) < 1:
            return None
        return rows.pop(), tuple(sorted((str(k), v.dtype, tuple(v.shape[1:])) for k, v in inputs.items()))
    return None


def merge(items: Sequence[Inputs]) -> Inputs:
    """Requests of one signature (or one request's parts) stacked along the rows."""
    first = items[0]
    if len(items) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(items)  # type: ignore[arg-type]
    return {k: torch.cat([it[k] for it in items]) for k in first}  # type: ignore[index]


def split(y: Any, rows: list[int]) -> list[Inputs]:
    """The batch's outputs cut back into each request's rows (on the CPU)."""
    if isinstance(y, torch.Tensor):
        # Row slices of a contiguous output are contiguous views: each goes on the wire as it is.
        y = y.to("cpu").contiguous()
        return list(torch.split(y, rows)) if len(rows) > 1 else [y]
    if isinstance(y, Mapping):
        parts = {k: split(v, rows) for k, v in y.items()}
        return [{k: parts[k][i] for k in parts} for i in range(len(rows))]  # type: ignore[misc]
    raise TypeError(f"the model returned {type(y).__name__}; a served model returns a tensor or a dict of tensors")


def chunks(inputs: Inputs, rows: int, size: int) -> list[tuple[Inputs, int]]:
    """``inputs`` cut into pieces of at most ``size`` rows (views, no copy), with their row counts."""
    if rows <= size:
        return [(inputs, rows)]
    out: list[tuple[Inputs, int]] = []
    for start in range(0, rows, size):
        n = min(size, rows - start)
        if isinstance(inputs, torch.Tensor):
            out.append((inputs[start : start + n], n))
        else:
            out.append(({k: v[start : start + n] for k, v in inputs.items()}, n))
    return out
