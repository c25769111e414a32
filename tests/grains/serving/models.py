"""Small models the serving tests deploy by import path (``tests.grains.serving.models:...``)."""

from __future__ import annotations

import torch
from torch import nn


class RowSum(nn.Module):
    """Each row's sum times ``scale``: rows of any length (an input shaped ``[-1, -1]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1, keepdim=True) * self.scale
