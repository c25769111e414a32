"""A training split whose samples carry their own id, and a step that records the ids it trained.

The in-process silos of the ``cluster`` fixture share this module, so a test
reads :data:`RECORDS` directly and steers the trainers through :data:`CONTROL`:
a step at or past ``limit`` waits until the test raises it (a trainer of any
mode), and the first step at or past ``oom_at`` of generation ``oom_gen`` or
later runs out of memory (parameter-server trainers, which also record).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from grains.training.steps import classification_step

RECORDS: list[tuple[int, int, int, list[int]]] = []
"""``(generation, rank, step, ids)`` of every step a parameter-server trainer ran."""
CONTROL: dict[str, int | None] = {"limit": None, "oom_at": None, "oom_gen": None}
_CHANGED = threading.Condition()
_WAIT_S = 60.0


def reset(limit: int | None = None) -> None:
    RECORDS.clear()
    control(limit=limit, oom_at=None, oom_gen=None)


def control(**changes: int | None) -> None:
    """Change :data:`CONTROL` and wake the steps waiting on it."""
    with _CHANGED:
        CONTROL.update(changes)
        _CHANGED.notify_all()


def ids(split: str = "train", size: int = 512, features: int = 8, seed: int = 0) -> TensorDataset:
    """``(x, label, id)`` samples (train) or ``(x, label)`` (test): label = whether x[0] > 0."""
    g = torch.Generator().manual_seed(seed + (split == "test"))
    x = torch.randn(size, features, generator=g)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x, y) if split == "test" else TensorDataset(x, y, torch.arange(size))


def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y, i = batch
    where = _trainer_step()
    if where is not None:
        generation, rank, t = where
        with _CHANGED:
            _hold(t)
            if generation is None:
                return F.cross_entropy(model(x), y)
            oom_at, oom_gen = CONTROL["oom_at"], CONTROL["oom_gen"]
            if oom_at is not None and oom_gen is not None and t >= oom_at and generation >= oom_gen:
                CONTROL["oom_at"] = None
                raise MemoryError(f"simulated: no memory for step {t}")
            RECORDS.append((generation, rank, t, i.tolist()))
    return F.cross_entropy(model(x), y)


def gated(model: torch.nn.Module, batch: Any) -> Any:
    """The default step (any dataset's ``(input, label)``), held at ``limit`` as :func:`step` is."""
    where = _trainer_step()
    if where is not None:
        with _CHANGED:
            _hold(where[2])
    return classification_step(model, batch)


def _hold(step: int) -> None:
    """Wait (holding ``_CHANGED``) until step ``step`` is below the limit (or none is set)."""
    _CHANGED.wait_for(lambda: (limit := CONTROL["limit"]) is None or step < limit, timeout=_WAIT_S)


def _trainer_step() -> tuple[int | None, int, int] | None:
    """``(generation, rank, step)`` of the trainer calling the step (None: another caller, such as
    the submit-time check). An all-reduce trainer's generation is not at hand: None."""
    from grains.training.strategies.allreduce.trainer_core import TrainerCore as GroupTrainer
    from grains.training.strategies.ps.trainer import TrainerCore

    frame = sys._getframe(1)
    while frame is not None:
        me, t = frame.f_locals.get("self"), frame.f_locals.get("step")
        if isinstance(me, TrainerCore) and isinstance(t, int):
            return me.a.generation, me.a.rank, t
        if isinstance(me, GroupTrainer) and isinstance(t, int):
            return None, frame.f_locals["rank"], t
        frame = frame.f_back  # type: ignore[assignment]
    return None


def last_attempts(records: list[tuple[int, int, int, list[int]]]) -> dict[tuple[int, int], list[int]]:
    """Each ``(step, rank)``'s ids in the run that counts: a generation's steps from the first step
    a later generation ran on were rolled back (re-run, or abandoned past a new end)."""
    first: dict[int, int] = {}
    for g, _, t, _ in records:
        first[g] = min(first.get(g, t), t)
    out: dict[tuple[int, int], list[int]] = {}
    for g, rank, t, batch in sorted(records, key=lambda r: r[0]):
        if all(t < first[later] for later in first if later > g):
            out[(t, rank)] = batch
    return out
