"""Pipeline schedules as lists of actions: what one stage does in one step, in order.

A step of a pipeline job is ``microbatches`` forwards (``F``) and as many
backwards (``B``) on every stage; a schedule is only the order each stage
runs them in. Each stage walks its list (:mod:`grains.training.strategies.pipeline.stage`): an
``F`` waits for its micro-batch's input, a ``B`` for its output's gradient.
Both schedules accumulate the same gradients; they differ in how many
activations a stage holds at once (:func:`peak_activations`):

- ``gpipe``: every forward, then every backward (``F0 .. F(m-1) B0 ..
  B(m-1)``): each stage holds all ``m`` micro-batches' activations.
- ``1f1b`` (non-interleaved, as ``Schedule1F1B`` in PyTorch's
  ``torch.distributed.pipelining.schedules``): stage ``i`` of ``p`` first runs
  ``w = min(m, p - 1 - i)`` warm-up forwards, then ``m - w`` times one forward
  and one backward, then the ``w`` backwards left. The last stage runs ``F0
  B0 F1 B1 ..``; stage ``i`` holds at most ``min(m, p - i)`` activations (stage
  0: ``p``), whatever ``m`` is, so more micro-batches (a smaller bubble) cost
  no memory.

PyTorch counts its warm-up one higher and alternates B then F; the lists are
the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Schedule = Literal["gpipe", "1f1b"]


@dataclass(frozen=True, slots=True)
class Action:
    """One micro-batch's forward (``F``) or backward (``B``) on a stage."""

    kind: Literal["F", "B"]
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}"


def actions(schedule: Schedule, stages: int, stage: int, microbatches: int) -> list[Action]:
    """What stage ``stage`` of ``stages`` runs in one step of ``microbatches``, in order."""
    if not 0 <= stage < stages or microbatches < 1:
        raise ValueError(f"no stage {stage} of {stages} with {microbatches} micro-batches")
    m = microbatches
    if schedule == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    warmup = min(m, stages - 1 - stage)
    out = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", warmup + i), Action("B", i)]
    return out + [Action("B", i) for i in range(m - warmup, m)]


def peak_activations(plan: list[Action]) -> int:
    """The most micro-batches whose forward ran and whose backward has not (activations held)."""
    held = peak = 0
    for a in plan:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak
