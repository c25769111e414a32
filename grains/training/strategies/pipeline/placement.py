"""Which silo each pipeline stage goes to: one stage a silo where there are enough, by free memory.

The coordinator places a job's stages once per start (and again when a
rollback re-configures them on whatever silos their keys hash to among the
survivors; that re-activation is hash placement's, not this).
Silos publish the host memory available to new allocations with every
heartbeat (``MemberRow.load.memory_available_bytes``; 0 from a silo that
does not report it). A stage needs about its parameter bytes times
(2 + the optimizer's state copies) (:func:`grains.training.strategies.pipeline.partition.stage_need`).

Stages are taken in pipeline order; each goes to the first silo, in the
order the trainer silos come (the role's silos, GPU ones first), that
(1) has room for it, counting what earlier stages of the job took there,
and (2) hosts the fewest of this job's stages so far. With enough silos of
enough memory that is one stage a silo in order (what it was before memory
was counted); a silo without room is skipped, and when no silo has room the
stage goes where the most is left (the job may still fit: available memory
is an estimate, and activations are not counted), and the placement says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from silo.records.membership import MemberRow


@dataclass(frozen=True, slots=True)
class StagePlacement:
    rows: list[MemberRow]
    """The silo of each stage, in the order the needs were given."""
    short: list[int]
    """Stages placed on a silo without room for them (none had room)."""


def place_stages(rows: Sequence[MemberRow], needs: Sequence[int]) -> StagePlacement:
    """A silo from ``rows`` for each stage needing ``needs[i]`` bytes (see the module doc)."""
    if not rows:
        raise ValueError("no silo to place stages on")
    # A silo that reports no figure is taken as having room (the placement before memory counted).
    left = {r.address: (r.load.memory_available_bytes or None) for r in rows}
    count = {r.address: 0 for r in rows}
    out: list[MemberRow] = []
    short: list[int] = []
    for i, need in enumerate(needs):
        fits = [r for r in rows if (room := left[r.address]) is None or room >= need]
        if fits:
            row = min(fits, key=lambda r: count[r.address])  # first of the least used: row order breaks ties
        else:
            row = max(rows, key=lambda r: left[r.address] or 0)
            short.append(i)
        room = left[row.address]
        if room is not None:
            left[row.address] = room - need
        count[row.address] += 1
        out.append(row)
    return StagePlacement(rows=out, short=short)
