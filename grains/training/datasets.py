"""Datasets that need no download, the factory lookup, and the batch schedule.

A dataset is named in a job by ``pkg.module:factory``; the factory is called
as ``factory(split="train"|"test", **dataset_args)`` and returns either a
map-style dataset (``__getitem__`` and ``__len__``) or a
``torch.utils.data.IterableDataset``. Items may be any nesting of tensors,
numbers, tuples, lists and dicts: a batch is the items put together by
:func:`collate` (torch's ``default_collate``, with tuples kept as tuples so
``(input, label)`` items give an ``(x, y)`` batch, as the tensor fast path
does). A dataset with a ``.tensors`` tuple (``TensorDataset``) is indexed a
batch at a time instead, one gather per tensor: 0.1 ms for 64 digits,
against 2 ms collating the same items one by one.

How items become batches, and which batch each trainer gets at each step, is
:mod:`grains.training.data.batches`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from grains.training.api.job import TrainingJob, resolve_path
from silo.errors import ConfigError

DIGITS_PATH = Path(__file__).parent / "data" / "digits.npz"


def digits(split: str = "train", test_fraction: float = 0.2, flatten: bool = True) -> TensorDataset:
    """The 8x8 digits (1,797 images), pixels scaled to [0, 1]; a fixed 80/20 split."""
    with np.load(DIGITS_PATH) as data:
        images = torch.from_numpy(data["images"].astype(np.float32) / 16.0)
        labels = torch.from_numpy(data["labels"].astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1797))
    n_test = int(len(labels) * test_fraction)
    idx = order[:n_test] if split == "test" else order[n_test:]
    x = images[idx]
    return TensorDataset(x.reshape(len(idx), -1) if flatten else x.unsqueeze(1), labels[idx])


def synthetic(
    split: str = "train",
    samples: int = 8192,
    test_samples: int = 2048,
    features: int = 784,
    classes: int = 10,
    spread: float = 3.0,
    seed: int = 0,
) -> TensorDataset:
    """Seeded Gaussian clusters: one random centre per class, unit noise around it.

    Lower ``spread`` makes the classes overlap more (harder); the same seed
    always gives the same data, split into disjoint train and test parts.
    """
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=g) * (spread / features**0.5)
    n = samples + test_samples
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centres[labels] + torch.randn(n, features, generator=g) / features**0.5
    part = slice(samples, n) if split == "test" else slice(0, samples)
    return TensorDataset(x[part].contiguous(), labels[part].contiguous())



def regression(
    split: str = "train",
    samples: int = 2048,
    test_samples: int = 512,
    features: int = 8,
    noise: float = 0.05,
    seed: int = 0,
) -> TensorDataset:
    """Seeded regression data: ``y = x @ w + 0.3 sin(2 x_0) + noise``, x standard normal.

    ``(x float32 [n, features], y float32 [n, 1])``, var(y) ~1.4. Least squares
    leaves the sine unexplained (test MSE 0.038); ``models:regressor`` reaches
    0.013 in 300 Adam steps (the noise floor is 0.0025 at the default noise).
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, 1, generator=g) / features**0.5
    n = samples + test_samples
    x = torch.randn(n, features, generator=g)
    y = x @ w + 0.3 * torch.sin(2 * x[:, :1]) + noise * torch.randn(n, 1, generator=g)
    part = slice(samples, n) if split == "test" else slice(0, samples)
    return TensorDataset(x[part].contiguous(), y[part].contiguous())


class TokenSequences(Dataset[dict[str, torch.Tensor]]):
    """Token sequences as ``{"input_ids": [length], "labels": [length]}`` items (next-token targets)."""

    def __init__(self, sequences: torch.Tensor) -> None:
        self.sequences = sequences  # [n, length + 1]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.sequences[i]
        return {"input_ids": s[:-1], "labels": s[1:]}


class TokenStream(IterableDataset[dict[str, torch.Tensor]]):
    """The items of a :class:`TokenSequences` in order, as a stream with no length."""

    def __init__(self, items: TokenSequences) -> None:
        self.items = items

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (self.items[i] for i in range(len(self.items)))


def tokens(
    split: str = "train",
    sequences: int = 2048,
    test_sequences: int = 256,
    length: int = 32,
    vocab: int = 32,
    seed: int = 0,
) -> TokenSequences:
    """Walks on a seeded sparse Markov chain: each token has two successors, equally likely.

    A model that learns the chain's table reaches the floor of ln 2 = 0.69
    nats per token from ln(vocab) = 3.47 at the start, so the loss of even a
    tiny transformer falls clearly within a hundred steps.
    """
    g = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab, generator=g)[:2] for _ in range(vocab)])
    n = sequences + test_sequences
    choice = torch.randint(0, 2, (n, length), generator=g)
    seq = torch.empty(n, length + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for i in range(length):
        seq[:, i + 1] = successors[seq[:, i], choice[:, i]]
    part = slice(sequences, n) if split == "test" else slice(0, sequences)
    return TokenSequences(seq[part].contiguous())


def tokens_stream(
    split: str = "train",
    sequences: int = 2048,
    test_sequences: int = 256,
    length: int = 32,
    vocab: int = 32,
    seed: int = 0,
) -> TokenStream:
    """:func:`tokens` as an ``IterableDataset`` without a length (a job on it needs ``steps``)."""
    return TokenStream(tokens(split, sequences, test_sequences, length, vocab, seed))


def load_dataset(spec: TrainingJob, split: str) -> Dataset[Any]:
    """The job's dataset for ``split``: map-style or IterableDataset; ConfigError if neither or empty."""
    factory = resolve_path(spec.dataset, "dataset")
    try:
        ds = factory(split=split, **spec.dataset_args)
    except Exception as exc:  # noqa: BLE001 - a user factory may raise anything
        raise ConfigError(
            f"dataset {spec.dataset}(split={split!r}, {spec.dataset_args}) failed: {type(exc).__name__}: {exc}"
        ) from None
    # IterableDataset inherits a __getitem__ that raises: test for it first.
    if not isinstance(ds, IterableDataset) and (not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__")):
        raise ConfigError(
            f"dataset {spec.dataset} returned {type(ds).__name__}, not a map-style dataset "
            "(__getitem__ and __len__) or a torch.utils.data.IterableDataset"
        )
    if dataset_size(ds) == 0:
        raise ConfigError(f"dataset {spec.dataset} split {split!r} is empty")
    return ds  # type: ignore[no-any-return]


def dataset_size(ds: Any) -> int | None:
    """Samples in ``ds``; None for an IterableDataset without a usable ``__len__``."""
    if isinstance(ds, IterableDataset):
        try:
            n = len(ds)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            return None
        return n if isinstance(n, int) and n >= 0 else None
    return len(ds)
