"""The simulation's event loop: virtual time, a seeded order of tasks, silos that can be paused.

:class:`SimLoop` is asyncio's selector loop with three things changed, each
through a hook asyncio already has, so every line of the runtime runs as it
runs in production:

* **Virtual time.** ``time()`` reads a number the loop owns. Before each
  wait the loop asks its selector to block for as long as the next timer is
  away; the wrapped ``select`` moves the number forward by exactly that much
  and polls instead (the mechanism of :class:`~silo.testing.clock.VirtualClock`,
  always on). An idle world leaps from timer to timer: a simulated minute of a
  three-silo cluster costs what its callbacks cost, not a minute.
* **A seeded order.** A silo is a process with one asyncio loop, and asyncio
  runs its ready callbacks first in, first out: a promise the runtime relies
  on (two requests read from one connection start their tasks in that
  order), so each silo's callbacks keep it. Between processes there is no
  order: at the start of each turn the loop merges the turn's queues of the
  silos, the clients and the world's own code in an order drawn from the
  seed. Together with the network's delays and the twins' latencies (drawn
  from the seed too) this is what makes one seed's interleaving differ from
  the next one's.
* **Pauses.** Every callback carries the ``contextvars`` context it was
  scheduled from, and each silo's tasks run in a context that names the
  silo (:data:`SILO`). While a silo is paused, its callbacks are held, not
  run: no turn, no heartbeat, no probe answer, exactly what SIGSTOP or a long
  GC pause does to a process. :meth:`resume` gives them back in order.

A world that has nothing ready and no timer left is stuck (every task waits
on something nobody will do); ``select`` raises :class:`Stalled` instead of
blocking forever.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import random
import selectors
from collections.abc import Callable, Coroutine, Generator
from typing import Any

SILO: contextvars.ContextVar[str | None] = contextvars.ContextVar("redgrain_sim_silo", default=None)
"""The silo whose code runs now (None: the world's own code: workloads, faults, checkers)."""


class Stalled(RuntimeError):
    """Nothing is ready and no timer is pending: the simulated world can never move again."""


class _Ready(collections.deque):  # type: ignore[type-arg]
    """The loop's ready queue, dealing task steps by the seed and holding paused silos' callbacks."""

    def __init__(self, loop: SimLoop) -> None:
        super().__init__()
        self._loop = loop
        self.deal = False
        """Set by select() at the start of every turn: re-deal this turn's task steps once."""

    def popleft(self) -> asyncio.Handle:
        loop = self._loop
        if self.deal:
            self.deal = False
            loop._deal(self)
        handle: asyncio.Handle = super().popleft()
        if loop._paused and not handle._cancelled:  # type: ignore[attr-defined]
            owner = handle._context.get(SILO)  # type: ignore[attr-defined]
            if owner in loop._paused:
                loop._held[owner].append(handle)
                return loop._skip
        return handle


class SimLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time whose task order and pauses follow ``rng`` (see the module)."""

    def __init__(self, rng: random.Random, *, start: float = 1_000.0, shuffle: bool = True) -> None:
        super().__init__()
        self.rng = rng
        self.shuffle = shuffle
        self._now = float(start)
        self._ready: _Ready = _Ready(self)  # type: ignore[assignment]
        self._paused: set[str] = set()
        self._held: dict[str, list[asyncio.Handle]] = {}
        self._skip = asyncio.Handle(lambda: None, (), self)
        self._skip.cancel()
        self._owners: dict[asyncio.Task[Any], str | None] = {}
        """Task -> the silo whose code made it, in the order made (finished ones pruned now and then)."""
        self._prune_at = 1_024
        self.turns = 0
        """Loop turns run (each a select and the callbacks it made ready)."""
        selector = self._selector  # type: ignore[attr-defined]
        self._select: Callable[[float | None], list[tuple[selectors.SelectorKey, int]]] = selector.select
        selector.select = self._virtual_select
        self.set_task_factory(self._new_task)


    # --- time ------------------------------------------------------------------------
    def time(self) -> float:
        return self._now

    def jump(self, seconds: float) -> None:
        """Move virtual time on at once (a clock jump); timers now overdue run next turn."""
        self._now += max(0.0, seconds)

    def _virtual_select(self, timeout: float | None) -> list[tuple[selectors.SelectorKey, int]]:
        self.turns += 1
        self._ready.deal = self.shuffle
        if timeout is None:
            # Nothing ready, no timer: only a worker thread's answer can still come (a second
            # of real time for it), else the world is stuck.
            events = self._select(1.0)
            if not events:
                raise Stalled("nothing is ready and no timer is pending")
            return events
        if timeout > 0:
            self._now += timeout
        # No sockets in a simulation: a thread's answer is queued on _ready by
        # call_soon_threadsafe itself, so the self-pipe needs no poll on every turn.
        return []

    # --- tasks -----------------------------------------------------------------------
    def _new_task(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any], **kw: Any) -> asyncio.Task[Any]:
        ctx = kw.get("context")
        owner = ctx.get(SILO) if ctx is not None else SILO.get()
        task = asyncio.Task(coro, loop=loop, **kw)
        owners = self._owners
        owners[task] = owner
        # Finished tasks are dropped in bulk, not each by a done callback: a callback is one
        # more ready handle a task (a sixth of a scale run's handles) for a map only tasks_of reads.
        if len(owners) >= self._prune_at:
            self._prune()
        return task

    def _prune(self) -> None:
        self._owners = {t: o for t, o in self._owners.items() if not t.done()}
        self._prune_at = max(1_024, 2 * len(self._owners))

    def tasks_of(self, owner: str) -> list[asyncio.Task[Any]]:
        """The unfinished tasks made by ``owner``'s code (in the order they were made)."""
        self._prune()
        return [t for t, o in self._owners.items() if o == owner]

    def _deal(self, ready: _Ready) -> None:
        # One silo is one process with one asyncio loop: its callbacks keep their FIFO order
        # (asyncio promises it, and the runtime relies on it: two requests read from one
        # connection start their tasks in order). Between processes no order exists: the
        # turn's queues of the silos (and the world's) are merged in an order drawn from the seed.
        if len(ready) < 2:
            return
        queues: dict[Any, collections.deque[asyncio.Handle]] = {}
        for h in ready:
            owner = h._context.get(SILO)  # type: ignore[attr-defined]
            q = queues.get(owner)
            if q is None:
                q = queues[owner] = collections.deque()
            q.append(h)
        if len(queues) < 2:
            return
        # randrange over the owners in their order, as before the speed-ups: random() with a
        # swap-remove drew other interleavings, among which no seed of 1-400 reached the
        # zombie write the fencing mutant needs (it is ~1% of pause seeds: docs/reliability.md).
        owners = list(queues)
        rng = self.rng
        ready.clear()
        while owners:
            i = rng.randrange(len(owners))
            q = queues[owners[i]]
            ready.append(q.popleft())
            if not q:
                owners.pop(i)

    # --- pauses ----------------------------------------------------------------------
    def pause(self, silo: str) -> None:
        """Hold every callback of ``silo`` from now on (see the module docstring)."""
        self._paused.add(silo)
        self._held.setdefault(silo, [])

    def resume(self, silo: str) -> None:
        """Run ``silo``'s held callbacks again, in the order they were held, before anything new."""
        self._paused.discard(silo)
        for handle in self._held.pop(silo, []):
            if not handle._cancelled:  # type: ignore[attr-defined]
                self._ready.append(handle)

    def is_paused(self, silo: str) -> bool:
        return silo in self._paused

    def drop_held(self, silo: str) -> None:
        """A paused silo that is killed: its held callbacks never run."""
        self._paused.discard(silo)
        self._held.pop(silo, None)
