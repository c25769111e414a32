"""In-memory timers of one activation: a callback run as a turn, once or every period.

A timer is an ``asyncio`` timer handle that, when it fires, queues its
callback on the activation's mailbox like a call (``enqueue_internal``), so it
never runs beside a turn unless it asked to interleave. A periodic timer
re-arms only once its tick has finished, measured from then: a slow tick
delays the next one instead of piling ticks up in the mailbox.

Timers live and die with their activation (the catalog cancels them when it
deactivates), and a tick is no use of it: as in Orleans, a grain that only its
timers keep busy is collected once idle past its timeout (calls and reminder
ticks count as use; ``@keep_alive`` exempts a class). A grain that must be
called back whatever happens to its silo uses a reminder
(``silo/cluster/reminders.py``) instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from silo.catalog.activation_state import ActivationState

if TYPE_CHECKING:
    from silo.catalog.activation import Activation


class Timer:
    """An in-memory timer of one activation. ``cancel()`` stops it."""

    def __init__(
        self,
        activation: Activation,
        callback: Callable[[], Awaitable[None]],
        due_s: float,
        period_s: float | None,
        interleave: bool,
    ) -> None:
        self._activation = activation
        self._callback = callback
        self._period_s = period_s
        self._interleave = interleave
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            max(0.0, due_s), self._fire
        )
        self.ticks = 0

    def _fire(self) -> None:
        self._handle = None
        act = self._activation
        if act.status is not ActivationState.ACTIVE:
            return
        self.ticks += 1
        done = act.enqueue_internal(self._callback, interleave=self._interleave)
        if self._period_s is not None:
            done.add_done_callback(self._rearm)

    def _rearm(self, _: asyncio.Future[Any]) -> None:
        act = self._activation
        if self._period_s is not None and act.status is ActivationState.ACTIVE and self in act.timers:
            self._handle = asyncio.get_running_loop().call_later(self._period_s, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._period_s = None
        self._activation.timers.discard(self)
