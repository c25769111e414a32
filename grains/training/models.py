"""Built-in models and the factory lookup for any ``nn.Module`` by import path.

A model is named in a job by ``pkg.module:factory`` plus keyword arguments;
the factory is called under ``torch.manual_seed(job.seed)`` so every shard,
trainer and reference loop builds the same initial weights.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from grains.training.api.job import TrainingJob, resolve_path
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


def cnn_bn(channels: int = 1, size: int = 8, classes: int = 10, width: int = 16, dropout: float = 0.25) -> nn.Module:
    """:func:`cnn` with BatchNorm after each conv and Dropout before the linear layer.

    Its running statistics are buffers, and Dropout differs between train()
    and eval(): the model that shows whether both survive distributed training.
    """
    return nn.Sequential(
        nn.Unflatten(1, (channels, size, size)) if channels == 1 else nn.Identity(),
        nn.Conv2d(channels, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * width * (size // 2) ** 2, classes),
    )


def regressor(features: int = 8, hidden: int = 64, outputs: int = 1) -> nn.Module:
    """A ReLU MLP with two hidden layers and a linear output, for regression."""
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, outputs),
    )


class TinyLM(nn.Module):
    """A causal transformer language model: token and learned position embeddings,
    pre-norm encoder layers under a causal mask, a linear head.

    ``forward(input_ids)`` gives logits ``[batch, time, vocab]``;
    ``forward(input_ids, labels)`` gives the mean cross-entropy over all
    positions (labels of -100 ignored), so a step can be ``model(**batch)``.
    No dropout, so a forward is a function of weights and batch alone.
    """

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, length: int) -> None:
        super().__init__()
        self.length = length
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(length, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        # Nested tensors do not apply to pre-norm layers (torch warns, and warnings fail tests).
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.length:
            raise ValueError(f"sequence of {t} tokens, longer than the model's {self.length} positions")
        positions = torch.arange(t, device=input_ids.device)
        h = self.embed(input_ids) + self.position(positions)
        # Built per call, not a buffer: a buffer would be state to sync and checkpoint.
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        logits: torch.Tensor = self.head(self.encoder(h, mask=mask, is_causal=True))
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def tiny_lm(vocab: int = 32, dim: int = 64, heads: int = 4, layers: int = 2, length: int = 32) -> nn.Module:
    """A :class:`TinyLM` (about 100k parameters: a step on 16 sequences of 32 takes a few ms on CPU)."""
    return TinyLM(vocab, dim, heads, layers, length)


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
