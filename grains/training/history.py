"""A job's history: the points its curves are drawn from, kept fit to plot.

The coordinator's state holds the list (``JobState.history``), the dashboard's
stream and the job's loggers get the same points as they are added. What
holds of the list, whatever order ticks and evaluations come in:

- it is in step order (an evaluation that finishes late goes in at its step,
  after that step's training point);
- one training point per step the trainers completed, never one before the
  first step (a tick before any trainer stepped has no loss to report: it
  used to write 9-29 points of loss 0.0 at step 0 at every start);
- an evaluation point carries the evaluation's figures and its own step, no
  training figures (they were the last tick's, of another step);
- nothing past the job's end: an early stop or a rollback drops the points of
  the abandoned steps, as it drops their checkpoints.
"""

from __future__ import annotations

import bisect

from grains.training.api.messages import HistoryPoint

LIMIT = 2000
"""Points kept (the oldest go first)."""


def last_training_step(history: list[HistoryPoint]) -> int | None:
    """The step of the newest training point (None: none yet)."""
    for h in reversed(history):
        if h.eval_metrics is None:
            return h.step
    return None


def add_training(history: list[HistoryPoint], point: HistoryPoint, *, after: int = 0) -> bool:
    """Record the training ``point`` if its step is new and past ``after`` (the step the run
    started from); False when nothing was added (no step completed since the last point).

    A step below the last one recorded means the job went back (a rollback to a checkpoint,
    a group re-formed from an older step): the points past it were abandoned and go."""
    last = last_training_step(history)
    if point.step <= after or point.step == last:
        return False
    if last is not None and point.step < last:
        truncate(history, point.step - 1)
    history.append(point)
    del history[:-LIMIT]
    return True


def add_evaluation(history: list[HistoryPoint], point: HistoryPoint) -> None:
    """Record the evaluation ``point`` at its step (after the training points up to it)."""
    at = bisect.bisect_right(history, point.step, key=lambda h: h.step)
    history.insert(at, point)
    del history[:-LIMIT]


def truncate(history: list[HistoryPoint], step: int) -> None:
    """Drop the points past ``step`` (the job ends there, or went back to it)."""
    del history[bisect.bisect_right(history, step, key=lambda h: h.step) :]
