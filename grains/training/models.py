"""Built-in models and the factory lookup for any ``nn.Module`` by import path.

A model is named in a job by ``pkg.module:factory`` plus keyword arguments;
the factory is called under ``torch.manual_seed(job.seed)`` so every shard,
trainer and reference loop builds the same initial weights.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

from grains.training.job import TrainingJob, resolve_path
from silo.errors import ConfigError


def mlp(in_features: int = 64, hidden: Sequence[int] = (128,), classes: int = 10) -> nn.Module:
    """A ReLU multilayer perceptron (the digits default: 64 -> 128 -> 10)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def medium_mlp() -> nn.Module:
    """784 -> 1024 -> 1024 -> 10 (7.5 MB of fp32 parameters): the benchmark's medium model."""
    return mlp(784, (1024, 1024), 10)


def cnn(channels: int = 1, size: int = 8, classes: int = 10, width: int = 16) -> nn.Module:
    """A small CNN for little images (8x8 digits: two 3x3 convs, one pool, one linear)."""
    return nn.Sequential(
        nn.Unflatten(1, (channels, size, size)) if channels == 1 else nn.Identity(),
        nn.Conv2d(channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * (size // 2) ** 2, classes),
    )


_SEEDED_BUILD = threading.Lock()


def build_model(spec: TrainingJob) -> nn.Module:
    """The job's model with its seeded initial weights (same on every process)."""
    factory = resolve_path(spec.model, "model")
    # The seed lives in torch's one global generator: two grains building
    # models at once in the silo's thread pool would interleave its draws and
    # get different "seeded" weights. One build at a time per process.
    with _SEEDED_BUILD, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        try:
            model = factory(**spec.model_args)
        except Exception as exc:  # noqa: BLE001 - a user factory may raise anything
            raise ConfigError(f"model {spec.model}({spec.model_args}) failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {spec.model} returned {type(model).__name__}, not a torch.nn.Module")
    return model
