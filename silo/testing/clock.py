"""A clock for tests that moves only when told, and drives the event loop's timers.

The runtime reads time in two ways: components that take a ``clock`` callable
(the catalog's idle collection, the failure detector, the membership twin),
and everything scheduled on the event loop (``call_later`` timers, deadlines,
``asyncio.sleep``, ``wait_for``), which asks ``loop.time()``. A
:class:`VirtualClock` serves both: it is the callable, and :meth:`install`
makes it the running loop's ``time()`` too, so one virtual "now" rules
everything.

The mechanism (the idea of trio's ``MockClock`` and of aiotools'
``VirtualClock``): asyncio's loop computes, before every wait, how long to
block in the selector: zero while callbacks are ready, the time to the next
timer when only timers are pending, forever when nothing is. The installed
clock wraps the selector's ``select``: any wait longer than zero means the
loop is *idle*, every task is parked, and that is the moment time may move.

* ``await clock.advance(5.0)`` moves time in steps from timer to timer: at
  each, the loop runs what became due (and everything that triggers) until
  it is idle again, then the next step; at the end, time sits at exactly
  five seconds on, every callback due by then has run, and the call
  returns. No real second passes.
* ``clock.jump(5.0)`` moves time at once and runs nothing (the failure
  detector's tests step a synchronous world that way).
* With ``autojump`` on, an idle loop jumps straight to its next timer, so a
  test waiting on a timeout (``asyncio.wait_for(x, 5)`` around something
  that should never hang) fails at once instead of after five real seconds.
* Otherwise an idle loop with only timers pending blocks in the selector as
  if nothing were scheduled: virtual time never moves on its own, and real
  I/O or a thread's result still wakes it.

"Idle" cannot tell a loop waiting for a timer from one waiting for a socket
or a worker thread; while :meth:`advance` (or autojump) runs, time moves past
such waits. The clock is meant for code without real I/O (the twins in
``silo.testing``).

Only asyncio's selector loops can be driven (uvloop keeps its clock in C).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

_Select = Callable[[float | None], list[tuple[selectors.SelectorKey, int]]]


class VirtualClock:
    """A clock under the test's control; see the module docstring.

    ``start``: the initial time; by default the loop's time when installed
    (timers scheduled before keep their meaning), else 0.
    """

    def __init__(self, start: float | None = None, *, autojump: bool = False) -> None:
        self._now = 0.0 if start is None else float(start)
        self._start_given = start is not None
        self.autojump = autojump
        """Jump to the next timer whenever the loop would otherwise wait for it."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._selector: Any = None
        self._select: _Select | None = None
        self._target: float | None = None
        self._reached: asyncio.Future[None] | None = None
        self.jumps = 0
        """Times the loop was idle and time moved on to a timer or an advance's end."""

    # --- reading -------------------------------------------------------------
    def __call__(self) -> float:
        return self._now

    def time(self) -> float:
        return self._now

    @property
    def installed(self) -> bool:
        return self._loop is not None

    # --- moving ----------------------------------------------------------------
    def jump(self, seconds: float) -> None:
        """Move time on by ``seconds`` now; nothing runs until the loop next looks at its timers."""
        if seconds < 0:
            raise ValueError(f"time only moves forward, not by {seconds}")
        self._now += seconds

    async def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``, running every callback due on the way at its own time.

        Returns once time is ``seconds`` on and the loop has nothing left to do
        before its next timer.
        """
        if seconds < 0:
            raise ValueError(f"time only moves forward, not by {seconds}")
        loop = self._running_loop("advance")
        if self._reached is not None:
            raise RuntimeError("another advance() is in progress")
        self._target = self._now + seconds
        self._reached = loop.create_future()
        try:
            await self._reached
        finally:
            self._target = None
            self._reached = None

    async def settle(self) -> None:
        """Run everything that is ready (and what it triggers) until the loop is idle; time stays."""
        await self.advance(0.0)

    # --- the loop ---------------------------------------------------------------
    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> Self:
        """Make this clock the time of ``loop`` (default: the running one)."""
        if self._loop is not None:
            raise RuntimeError("this clock is installed already")
        loop = loop or asyncio.get_running_loop()
        selector = getattr(loop, "_selector", None)
        if selector is None or not isinstance(loop, asyncio.BaseEventLoop):
            raise RuntimeError(f"VirtualClock drives asyncio's selector loops only, not {type(loop).__name__}")
        if not self._start_given and self._now == 0.0:
            self._now = loop.time()
        self._loop, self._selector, self._select = loop, selector, selector.select
        # Instance attributes shadow the methods; uninstall() deletes them again.
        loop.time = self.time  # type: ignore[method-assign]
        selector.select = self._idle_select
        return self

    def uninstall(self) -> None:
        if self._loop is None:
            return
        del self._loop.time  # type: ignore[method-assign]
        del self._selector.select
        self._loop = self._selector = self._select = None

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.uninstall()

    def _running_loop(self, what: str) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            raise RuntimeError(f"{what}() needs the clock installed on the running loop (clock.install())")
        return loop

    def _idle_select(self, timeout: float | None) -> list[tuple[selectors.SelectorKey, int]]:
        assert self._select is not None
        if timeout is not None and timeout <= 0:
            return self._select(0)  # work is ready: poll and go on
        # Idle: nothing ready; the next timer is `timeout` away (None: there is none).
        if self._target is not None:
            remaining = self._target - self._now
            if timeout is not None and timeout < remaining:
                self._now += timeout
            elif remaining > 0:
                # The next timer is at or past the target: stop there, let what is due run.
                self._now = self._target
            else:
                reached = self._reached
                if reached is not None and not reached.done():
                    reached.set_result(None)
                return self._select(0)
            self.jumps += 1
            return self._select(0)
        if self.autojump and timeout is not None:
            self._now += timeout
            self.jumps += 1
            return self._select(0)
        # Virtual time does not pass by waiting: wait only for I/O and threads.
        return self._select(None)
