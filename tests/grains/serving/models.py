"""Small models the serving tests deploy by import path (``tests.grains.serving.models:...``).

The silos of a test run in its process, so a test reaches its model's
forward pass or construction through the module-level tables below, keyed
by a ``tag`` the test passes in ``model_args``.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

MEETINGS: dict[str, threading.Barrier] = {}
"""A :class:`Meeting`'s forward passes of positive rows wait here: they pass only together."""
GATES: dict[str, tuple[threading.Event, threading.Event]] = {}
"""(entered, open): :func:`held_rowsum` sets ``entered`` and waits for ``open``."""
FORWARD_ROWS: dict[str, list[int]] = {}
"""Rows of each forward pass of a :class:`Meeting` (one list per tag)."""


class RowSum(nn.Module):
    """Each row's sum times ``scale``: rows of any length (an input shaped ``[-1, -1]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1, keepdim=True) * self.scale


class Meeting(RowSum):
    """A RowSum that records its passes' rows, and whose passes meet at ``MEETINGS[tag]``."""

    def __init__(self, tag: str = "") -> None:
        super().__init__()
        self.tag = tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 0).any()):  # not the load's probe (zeros)
            FORWARD_ROWS.setdefault(self.tag, []).append(int(x.shape[0]))
            barrier = MEETINGS.get(self.tag)
            if barrier is not None:
                barrier.wait()
        return super().forward(x)


def held_rowsum(tag: str = "") -> RowSum:
    """A RowSum whose construction (a replica's load) waits while ``GATES[tag]`` is set up and closed."""
    gate = GATES.get(tag)
    if gate is not None:
        entered, open_ = gate
        entered.set()
        open_.wait(30)
    return RowSum()


def refuses_to_build() -> nn.Module:
    """A factory whose deployment can never load: a spec to fix, not a replica to retry."""
    from silo.errors import ConfigError

    raise ConfigError("this factory needs an argument the deployment did not give")
