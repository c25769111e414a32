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
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
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
