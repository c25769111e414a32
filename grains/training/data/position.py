"""Where a job is in its data, counted in samples, across changes of its trainer count.

A step of ``k`` trainers takes the next ``k * B`` samples (``B``: the job's
``batch_size``). Counting the position as ``step * k * B`` made it jump
whenever ``k`` changed: grown from 1 to 2 trainers at step 50, a digits job
went from epoch 2 to epoch 4, and a 2-epoch job over 2,048 ids visited 7,808
of them. So the position is kept as a list of :class:`Segment`: from global
step ``start_step`` on, ``trainers`` trainers each take ``B`` samples a step,
starting at sample ``offset`` of epoch ``epoch``. A resize appends a segment
that starts at the next unseen sample; the coordinator keeps the list in its
state and sends it with every assignment.

*Map-style* (``size`` samples): each step takes the next ``trainers * B``
samples of the current epoch's permutation; when fewer remain, the rest of
the epoch is dropped and the step starts the next epoch at offset 0 (an epoch
smaller than one global batch is one step). With one segment this is the old
rule exactly: step ``t`` takes ``[(t % S) * k * B, ...)`` of epoch ``t // S``,
``S = n // (k * B)``. *IterableDataset* (``size`` None): the position is a
plain offset in the endless stream; no epochs, nothing dropped.

Every question is answered with arithmetic over the segments, never a loop
over steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from silo.errors import ConfigError


class Segment(BaseModel):
    """From global step ``start_step`` on, ``trainers`` trainers each take ``batch_size`` samples a
    step, starting at sample ``offset`` of epoch ``epoch``'s permutation (a stream: of the stream).

    Kept in the coordinator's state: ``trainers`` is read under its old name ``world`` too."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start_step: int = Field(ge=0)
    trainers: int = Field(gt=0, validation_alias=AliasChoices("trainers", "world"))
    epoch: int = Field(0, ge=0)
    offset: int = Field(0, ge=0)


class DataSchedule(BaseModel):
    """The data position of every step of a job: ``size`` samples (None: a stream), ``batch_size``
    per trainer, and the segments, oldest first."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int | None
    batch_size: int = Field(gt=0)
    segments: list[Segment] = Field(min_length=1)

    @classmethod
    def of(cls, size: int | None, batch_size: int, segments: Sequence[Segment], trainers: int) -> DataSchedule:
        """The schedule of ``segments``; none means one segment of ``trainers`` trainers from step 0."""
        return cls(size=size, batch_size=batch_size, segments=list(segments) or [Segment(start_step=0, trainers=trainers)])

    def position(self, step: int) -> tuple[int, int, int]:
        """``(epoch, offset, trainers)`` of global ``step``: its samples begin at ``offset`` of
        ``epoch``'s permutation (a stream: epoch 0, the stream offset), ``trainers`` trainers take them."""
        seg = self._segment(step)
        epoch, offset = self._at(seg, step - seg.start_step)
        return epoch, offset, seg.trainers

    def epochs_at(self, step: int) -> float:
        """Passes over the data at the start of ``step``: the epoch plus the share of its usable
        samples (``S * trainers * B``) already taken; 0 for a stream."""
        if self.size is None:
            return 0.0
        epoch, offset, trainers = self.position(step)
        return epoch + offset / (self._per_epoch(trainers) * trainers * self.batch_size)

    def resized(self, step: int, trainers: int) -> DataSchedule:
        """The schedule with ``trainers`` trainers from ``step`` on, continuing from the next unseen
        sample there. Segments that start after ``step`` are dropped (a rollback to a step before
        them abandons them); an unchanged trainer count adds no segment."""
        kept = [s for s in self.segments if s.start_step <= step]
        if not kept:
            raise ValueError(f"step {step} is before the schedule's first step {self.segments[0].start_step}")
        last = kept[-1]
        if last.trainers == trainers:
            return self.model_copy(update={"segments": kept})
        epoch, offset = self._next_unseen(last, step)
        if last.start_step == step:
            kept.pop()  # resized twice at one step: the later trainer count wins, from the same sample
        seg = Segment(start_step=step, trainers=trainers, epoch=epoch, offset=offset)
        return self.model_copy(update={"segments": [*kept, seg]})

    def from_step(self, step: int) -> DataSchedule:
        """The schedule from ``step`` on as one segment that starts at the next unseen sample there
        (what a resumed run carries: it runs no earlier step, and its batch size may differ)."""
        seg = self._segment(step)
        epoch, offset = self._next_unseen(seg, step)
        return self.model_copy(update={"segments": [seg.model_copy(update={"start_step": step, "epoch": epoch, "offset": offset})]})

    def end_step(self, epochs: float) -> int:
        """The first step at which the position reaches ``epochs`` epochs (for an integer N: the step
        that would start epoch N), the last segment's trainer count going on to the end; at least 1."""
        if self.size is None:
            raise ConfigError("a dataset without a length (an IterableDataset) needs 'steps', not epochs")
        segs = self.segments
        for k, seg in enumerate(segs):
            end = seg.start_step + self._reach(seg, epochs)
            if k + 1 == len(segs) or end < segs[k + 1].start_step:
                return max(1, end)
        raise AssertionError("unreachable: the last segment always answers")

    # --- arithmetic -------------------------------------------------------------
    def _segment(self, step: int) -> Segment:
        found: Segment | None = None
        for seg in self.segments:
            if seg.start_step > step:
                break
            found = seg
        if found is None:
            raise ValueError(f"step {step} is before the schedule's first step {self.segments[0].start_step}")
        return found

    def _per_epoch(self, trainers: int) -> int:
        assert self.size is not None
        return max(1, self.size // (trainers * self.batch_size))

    def _spans(self, seg: Segment) -> tuple[int, int]:
        """Steps of ``seg`` in the epoch it starts in, and in each later epoch."""
        assert self.size is not None
        take, per = seg.trainers * self.batch_size, self._per_epoch(seg.trainers)
        return (per if seg.offset == 0 else max(0, (self.size - seg.offset) // take)), per

    def _at(self, seg: Segment, i: int) -> tuple[int, int]:
        """``(epoch, offset)`` of the ``i``-th step of ``seg``."""
        take = seg.trainers * self.batch_size
        if self.size is None:
            return 0, seg.offset + i * take
        first, per = self._spans(seg)
        if i < first:
            return seg.epoch, seg.offset + i * take
        later, j = divmod(i - first, per)
        return seg.epoch + 1 + later, j * take

    def _next_unseen(self, seg: Segment, step: int) -> tuple[int, int]:
        """The sample after the last one ``seg``'s steps before ``step`` took (before the drop rule)."""
        if step == seg.start_step:
            return seg.epoch, seg.offset
        epoch, offset = self._at(seg, step - 1 - seg.start_step)
        return epoch, offset + seg.trainers * self.batch_size

    def _reach(self, seg: Segment, epochs: float) -> int:
        """The first step of ``seg`` (counted from its start) at which the position reaches ``epochs``."""
        first, per = self._spans(seg)
        if seg.offset == 0:  # the position is epoch + i / per throughout (the old rule's figure)
            return max(0, math.ceil((epochs - seg.epoch) * per))
        if epochs >= seg.epoch + 1:
            return first + max(0, math.ceil((epochs - seg.epoch - 1) * per))
        part = math.ceil((epochs - seg.epoch) * per - seg.offset / (seg.trainers * self.batch_size))
        return min(max(0, part), first)
