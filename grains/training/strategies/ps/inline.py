"""Work on the step path run on the event loop while it is cheap, else on the executor.

A sync step is a chain with no overlap: the trainer's compute, its push, the
shard's update, the reply, the next compute. Each piece sent to the silo's
executor adds two thread hops to the chain, each a wake-up of a sleeping
thread: measured on the 2-core development machine, 0.15-0.2 ms each way when
it is idle, a millisecond and more when other processes keep its cores busy.
On a small model that is more than the work itself (the 64-128-10 MLP's
forward and backward take ~0.35 ms, its momentum-SGD update ~0.1 ms). And work
made of many small tensors (AdamW over the tiny BERT's 41) runs mostly in
Python and torch's dispatcher, holding the GIL: on the executor it blocks the
loop nearly as much as on it.

So :class:`InlineWhenCheap` runs a piece inline while the last one took less
than ``budget_s`` (1 ms: a hundredth of the silo watchdog's 100 ms, below the
cost of one exchange between silos), measured wherever it ran. The first
piece, and any after a slow one, go to the executor, whose thread lets the
loop serve calls while a large model's kernels (which release the GIL) run;
so a job whose steps take longer than the budget never runs inline, and one
whose steps become slow goes back to the executor at the next step.

:func:`whole` is the same idea for a coroutine that must not be cut short by
its caller's cancellation (``asyncio.shield``): a shield is a task, and a task
is three more turns of the loop (its first step, its done callback, the
caller's wake-up), each of which waits behind whatever else the loop has
ready. A shard's push of an inline update never suspends, so it needs neither.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar

R = TypeVar("R")

BUDGET_S = 0.001


class InlineWhenCheap:
    """Runs a grain's pieces of work inline or through ``run_in_thread``, as the last one's time says."""

    def __init__(
        self, run_in_thread: Callable[..., Awaitable[Any]], budget_s: float = BUDGET_S
    ) -> None:
        self._run_in_thread = run_in_thread
        self._budget_s = budget_s
        self.inline = False
        """Whether the next piece runs on the event loop (the last one took under the budget)."""

    async def run(self, fn: Callable[..., R], /, *args: Any) -> R:
        if self.inline:
            return self._timed(fn, *args)
        result: R = await self._run_in_thread(self._timed, fn, *args)
        return result

    def _timed(self, fn: Callable[..., R], /, *args: Any) -> R:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.inline = time.perf_counter() - t0 < self._budget_s


async def whole(coro: Coroutine[Any, Any, R]) -> R:
    """``await asyncio.shield(coro)``, except that ``coro`` starts at once, in the caller's task:
    if it finishes without suspending (nothing could cancel it then) no task is made; if it
    suspends, the rest runs as a shielded task, so cancelling the caller never cuts it short."""
    try:
        yielded = coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except BaseException:
        coro.close()
        raise
    return await asyncio.shield(_resume(coro, yielded))


async def _resume(coro: Coroutine[Any, Any, R], yielded: Any) -> R:
    return await _Resumed(coro, yielded)


class _Resumed:
    """Awaits ``coro`` on from the point where it yielded ``yielded`` (a future it waits on, or
    None: a bare yield to the loop), as ``yield from`` would have: the task running this sees
    that future, and what the task sends or throws goes on to ``coro``."""

    __slots__ = ("_coro", "_yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coro, self._yielded = coro, yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, yielded = self._coro, self._yielded
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - every throw goes on to coro, as yield from's
                try:
                    yielded = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as done:
                    return done.value
