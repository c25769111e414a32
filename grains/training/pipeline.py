"""Cutting a model into pipeline stages (mode ``pipeline``).

The model must be an ``nn.Sequential``: stage ``i`` runs the slice
``[start_i, end_i)`` of its children, and parameter names stay those of the
whole model (``"3.weight"``), so parameter groups, checkpoints and the
exported ``state_dict`` read the same in every mode. Cuts are balanced by
parameter bytes: the children are cut where the running sum of bytes crosses
``k / stages`` of the total, each stage getting at least one child.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from silo.errors import ConfigError


def stage_layers(model: nn.Module, stages: int, costs: list[float] | None = None) -> list[tuple[int, int]]:
    """The ``[start, end)`` child slices of ``stages`` stages, balanced by parameter bytes (or by
    ``costs``, one per child: measured times, see :func:`measured_costs`)."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"pipeline mode cuts an nn.Sequential into stages; the model is a {type(model).__name__}"
        )
    children = list(model.children())
    if stages > len(children):
        raise ConfigError(f"pipeline: {stages} stages but the model has only {len(children)} layers")
    sizes = costs if costs is not None else [float(sum(p.numel() * p.element_size() for p in c.parameters())) for c in children]
    total = sum(sizes) or 1.0
    cuts: list[int] = []
    running = 0.0
    for i, size in enumerate(sizes[:-1]):
        running += size
        # Cut after child i once the running share reaches the next stage boundary, keeping
        # enough children for the stages still to come.
        k = len(cuts) + 1
        left = len(children) - (i + 1)
        if k < stages and (running >= k * total / stages or left == stages - k):
            cuts.append(i + 1)
    bounds = [0, *cuts, len(children)]
    layers = [(bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1)]
    if len(layers) != stages or any(a >= b for a, b in layers):
        raise ConfigError(f"pipeline: cannot cut {len(children)} layers into {stages} stages")
    return layers


def measured_costs(model: nn.Module, sample: Any, repeats: int = 3) -> list[float]:
    """Each child's forward plus backward time on ``sample`` (one micro-batch), best of ``repeats``."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError("pipeline mode cuts an nn.Sequential into stages")
    costs = []
    x = sample
    for child in model.children():
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = child(inp)
            if y.requires_grad:
                y.float().sum().backward()
            best = min(best, time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        costs.append(best)
        with torch.no_grad():
            x = child(x)
    return costs


def stage_names(model: nn.Module, layers: tuple[int, int]) -> list[str]:
    """Full-model names of the parameters and persistent buffers of one stage."""
    a, b = layers
    return [n for n in model.state_dict() if a <= int(n.split(".", 1)[0]) < b]
