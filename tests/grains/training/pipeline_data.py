"""A dataset for pipeline tests: the digits in a fixed order, one sample's pixels NaN."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset

from grains.training.datasets import digits


def samples(split: str = "train", n: int = 384, nan_at: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` digits of ``split``; sample ``nan_at`` (if any) has NaN pixels."""
    x, y = digits(split).tensors
    x, y = x[:n].clone(), y[:n].clone()
    if 0 <= nan_at < n:
        x[nan_at] = float("nan")
    return x, y


class MarkedDigits(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Not shuffled: global step ``t`` takes samples ``[t * B, (t + 1) * B)`` (one trainer), so
    ``nan_at`` fixes the one step whose loss is NaN."""

    def __init__(self, split: str, n: int, nan_at: int) -> None:
        self.x, self.y = samples(split, n, nan_at if split == "train" else -1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return zip(self.x, self.y, strict=True)


def marked_digits(split: str = "train", n: int = 384, nan_at: int = -1) -> MarkedDigits:
    return MarkedDigits(split, n, nan_at)
