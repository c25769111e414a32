"""Datasets that need no download, the factory lookup, and the batch schedule.

A dataset is named in a job by ``pkg.module:factory``; the factory is called
as ``factory(split="train"|"test", **dataset_args)`` and returns any
``torch.utils.data.Dataset`` of ``(input, label)`` pairs. Datasets that hold
tensors (``TensorDataset``) are indexed a batch at a time; others are
gathered item by item off the event loop.

The batch schedule is the contract that makes sync mode equal to plain
training: epoch ``e`` shuffles the training set with ``torch.randperm(n,
generator=seed + e)``; global step ``t`` (epoch ``t // S``, ``S = n // (k *
B)`` steps per epoch, the remainder dropped) takes the slice ``[(t % S) * k *
B, (t % S + 1) * k * B)`` of that permutation, and trainer slot ``j`` gets
the ``j``-th ``B`` of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from grains.training.job import TrainingJob, resolve_path
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


def load_dataset(spec: TrainingJob, split: str) -> Dataset[Any]:
    factory = resolve_path(spec.dataset, "dataset")
    try:
        ds = factory(split=split, **spec.dataset_args)
    except Exception as exc:  # noqa: BLE001 - a user factory may raise anything
        raise ConfigError(
            f"dataset {spec.dataset}(split={split!r}, {spec.dataset_args}) failed: {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ConfigError(f"dataset {spec.dataset} returned {type(ds).__name__}, not a sized torch Dataset")
    if len(ds) == 0:
        raise ConfigError(f"dataset {spec.dataset} split {split!r} is empty")
    return ds  # type: ignore[no-any-return]


def steps_per_epoch(n: int, batch_size: int, slots: int) -> int:
    return max(1, n // (batch_size * slots))


def batch_indices(n: int, batch_size: int, slots: int, slot: int, step: int, seed: int) -> torch.Tensor:
    """Indices of trainer ``slot``'s batch at global ``step`` (see the module docstring)."""
    per_epoch = steps_per_epoch(n, batch_size, slots)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    start = (i * slots + slot) * batch_size
    return perm[start : start + batch_size]


class Batches:
    """Batches of one dataset by index, fast for tensor datasets, item by item otherwise.

    Keeps the current epoch's permutation, so a step costs one gather.
    """

    def __init__(self, ds: Dataset[Any], device: str = "cpu") -> None:
        self._ds = ds
        self._n = len(ds)  # type: ignore[arg-type]
        tensors = getattr(ds, "tensors", None)
        self._tensors: tuple[torch.Tensor, ...] | None = (
            tuple(t.to(device) for t in tensors) if isinstance(tensors, tuple) and len(tensors) == 2 else None
        )
        self._device = device
        self._perm_key: tuple[int, int] | None = None
        self._perm: torch.Tensor | None = None

    def __len__(self) -> int:
        return self._n

    def batch(self, batch_size: int, slots: int, slot: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_epoch = steps_per_epoch(self._n, batch_size, slots)
        epoch, i = divmod(step, per_epoch)
        if self._perm_key != (seed, epoch):
            self._perm = torch.randperm(self._n, generator=torch.Generator().manual_seed(seed + epoch))
            self._perm_key = (seed, epoch)
        assert self._perm is not None
        start = (i * slots + slot) * batch_size
        idx = self._perm[start : start + batch_size]
        return self.gather(idx)

    def gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tensors is not None:
            x, y = self._tensors
            return x[idx.to(x.device)], y[idx.to(y.device)]
        items = [self._ds[int(i)] for i in idx]
        x = torch.stack([torch.as_tensor(it[0]) for it in items]).to(self._device)
        y = torch.as_tensor([int(it[1]) for it in items], dtype=torch.int64).to(self._device)
        return x, y

    def all(self, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._n if limit is None else min(limit, self._n)
        return self.gather(torch.arange(n))
