"""Cutting a model into pipeline stages (mode ``pipeline``), and building one stage's module.

Two ways to cut, both keeping the whole model's parameter names
(``"3.weight"``, ``"blocks.2.fc.weight"``), so parameter groups,
checkpoints and the exported ``state_dict`` read the same in every mode:

- an ``nn.Sequential`` without ``split_points``: stage ``i`` runs the slice
  ``[start_i, end_i)`` of its children, cut where the running sum of
  parameter bytes (or of measured times, ``balance = "time"``) crosses
  ``k / stages`` of the total, each stage getting at least one child;
- any module with ``split_points``: cut at those submodules by torch.fx
  (:mod:`grains.training.strategies.pipeline.split`); stage ``i``'s "layers" are then ``(i,
  i + 1)``, the ``i``-th piece of the split.

A stage builds only its own part (:func:`stage_module`): the model is built
on the **meta device** (shapes, no storage), cut, and only the stage's
modules are given memory (``to_empty``) and filled from a checkpoint: a
pipeline job's seeded initial weights are written once as step 0 of its run
(:func:`initial_snapshot`, by the coordinator's silo, which holds the whole
model anyway to evaluate and export it), so no stage silo ever holds more
than its share. A model whose stage has non-persistent buffers (values a
checkpoint does not hold) or whose factory fails on the meta device is
built for real instead, whole, and cut.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from grains.training.api.job import TrainingJob, resolve_path
from grains.training.loop.optim import trainable
from grains.training.models import build_model
from grains.training.state.model_tensors import frozen_parameters, persistent_buffers
from grains.training.strategies.pipeline.split import chain, split, stage_sizes
from silo.errors import ConfigError


class Slice(nn.Module):
    """Children ``[a, b)`` of an ``nn.Sequential``, registered under their names in it (``"4"``)."""

    def __init__(self, model: nn.Sequential, layers: tuple[int, int]) -> None:
        super().__init__()
        a, b = layers
        for name, child in list(model.named_children())[a:b]:
            self.add_module(name, child)

    def forward(self, x: Any) -> Any:
        for child in self._modules.values():
            x = child(x)  # type: ignore[misc]
        return x


def stage_layers(model: nn.Module, stages: int, costs: list[float] | None = None) -> list[tuple[int, int]]:
    """The ``[start, end)`` child slices of ``stages`` stages, balanced by parameter bytes (or by
    ``costs``, one per child: measured times, see :func:`measured_costs`)."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"pipeline mode cuts an nn.Sequential into stages, or any module at its named split_points;"
            f" the model is a {type(model).__name__} and the job names no split_points"
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


def cut_modules(model: nn.Module, spec: TrainingJob, layers: list[tuple[int, int]] | None = None) -> list[nn.Module]:
    """Every stage's module of ``model`` (sharing its tensors), cut as the job says."""
    if spec.split_points:
        return list(split(model, spec.split_points))
    assert isinstance(model, nn.Sequential)
    return [Slice(model, ab) for ab in (layers or stage_layers(model, spec.stages))]


def cut(model: nn.Module, spec: TrainingJob, costs: list[float] | None = None) -> tuple[list[tuple[int, int]], list[int]]:
    """The job's stages (see the module doc) and each one's bytes of parameters and buffers."""
    if spec.split_points:
        modules = cut_modules(model, spec)
        return [(i, i + 1) for i in range(len(modules))], stage_sizes(modules)
    layers = stage_layers(model, spec.stages, costs)
    return layers, stage_sizes([Slice(model, ab) for ab in layers])  # type: ignore[arg-type]


def check_cut(model: nn.Module, spec: TrainingJob, sample: Any) -> None:
    """At submit: the cut can be made, and the stages run one after another on ``sample`` (a micro-batch)."""
    layers, _ = cut(model, spec)
    if len(layers) != spec.stages:
        raise ConfigError(f"pipeline: the cut gives {len(layers)} stages, the job asks for {spec.stages}")
    if spec.split_points:
        was = model.training
        try:
            with torch.no_grad():
                chain(cut_modules(model, spec, layers), sample)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's forward may raise anything
            raise ConfigError(f"pipeline: the stages cut at {spec.split_points} fail on the first batch: {type(exc).__name__}: {exc}") from None
        finally:
            model.train(was)


def _build_on_meta(spec: TrainingJob) -> nn.Module | None:
    """The job's model with no storage (shapes only); None when its factory cannot build it so."""
    factory = resolve_path(spec.model, "model")
    try:
        with torch.device("meta"):
            model = factory(**spec.model_args)
    except Exception:  # noqa: BLE001 - a factory that reads data or checks values: build it for real
        return None
    return model if isinstance(model, nn.Module) else None


def _has_transient_buffers(module: nn.Module) -> bool:
    """Non-persistent buffers: values a checkpoint does not hold, which ``to_empty`` would lose."""
    return any(getattr(m, "_non_persistent_buffers_set", None) for m in module.modules())


def stage_module(spec: TrainingJob, index: int, layers: tuple[int, int], device: str, from_checkpoint: bool) -> nn.Module:
    """Stage ``index``'s module on ``device``. With ``from_checkpoint`` (its tensors are about to be
    loaded), built on the meta device and only this stage given memory, its values undefined;
    otherwise (or when the meta build does not serve) from the seeded whole model."""
    if from_checkpoint:
        meta = _build_on_meta(spec)
        if meta is not None:
            module = cut_modules(meta, spec, [layers] if not spec.split_points else None)
            mine = module[0] if not spec.split_points else module[index]
            if not _has_transient_buffers(mine):
                return mine.to_empty(device=device)
    model = build_model(spec)
    pieces = cut_modules(model, spec, [layers] if not spec.split_points else None)
    return (pieces[0] if not spec.split_points else pieces[index]).to(device)


def tensor_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """A stage's trainable parameters (in its order: the optimizer's), and its frozen parameters and buffers."""
    return [n for n, _ in trainable(module)], [n for n, _ in frozen_parameters(module)] + [n for n, _ in persistent_buffers(module)]


def stage_need(param_bytes: int, spec: TrainingJob) -> int:
    """Memory a stage holding ``param_bytes`` of parameters and buffers needs at least: the tensors,
    their gradients and the optimizer's state (SGD none, momentum one copy, Adam two; another
    optimizer is counted as two). Activations are not counted (they depend on the batch)."""
    state = {"sgd": 0, "momentum": 1}.get(spec.optimizer, 2)
    return param_bytes * (2 + state)
