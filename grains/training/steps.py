"""The default training step and evaluation: classification of ``(input, label)`` batches.

A job names its own with ``step = "pkg.module:fn"`` and ``evaluate =
"pkg.module:fn"`` (see docs/training.md, "Bring your own training step");
these are what it gets otherwise, and examples of the contract:

- a step is ``fn(model, batch) -> loss`` or ``-> (loss, {"name": float})``:
  the loss a scalar tensor to call ``backward()`` on, the metrics plain
  numbers (or 0-d tensors) about this batch;
- pipeline mode's loss (``loss = "pkg.module:fn"``, run on the last stage)
  is ``fn(output, target) -> loss`` or ``-> (loss, {"name": float})``;
- an evaluation is ``fn(model, batch) -> {"name": float}``, means over the
  batch; redgrain runs it in ``eval()`` mode under ``torch.no_grad()`` over the
  whole test split and averages each metric weighted by the batch's samples.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _split(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, dict) and "input" in batch and "label" in batch:
        return batch["input"], batch["label"]
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    what = f"a dict with keys {sorted(batch)}" if isinstance(batch, dict) else type(batch).__name__
    raise TypeError(
        f"the default classification step takes (input, label) batches, not {what}: name your own step"
    )


def classification_step(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on ``model(input)`` (logits over classes); reports the batch's accuracy."""
    x, y = _split(batch)
    out = model(x)
    loss = F.cross_entropy(out.float(), y)
    return loss, {"accuracy": float((out.detach().argmax(1) == y).float().mean())}


def classification_loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Pipeline mode's default loss, run on the last stage: cross-entropy on the logits, and the accuracy."""
    loss = F.cross_entropy(output.float(), target)
    return loss, {"accuracy": float((output.detach().argmax(1) == target).float().mean())}


def classification_metrics(model: nn.Module, batch: Any) -> dict[str, float]:
    """Loss and accuracy of one test batch."""
    x, y = _split(batch)
    out = model(x).float()
    return {"loss": float(F.cross_entropy(out, y)), "accuracy": float((out.argmax(1) == y).float().mean())}
