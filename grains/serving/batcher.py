"""Dynamic batching: requests that arrive together share one forward pass.

A request waits in the batcher's queue; a batch leaves when a forward slot is
free (``slots``, default 1 per replica) and either it holds ``max_rows`` rows
or its oldest request has waited ``max_delay_s``. With the default delay of 0
a lone caller never waits for company, and under load the requests that
arrive while one forward pass runs are the next batch: the batch size follows
the concurrency by itself (Triton's dynamic batcher and Ray's ``@serve.batch``
wait a fixed delay instead; here the delay is an opt-in). Each caller gets
back the slice of the batch's result that is its own.

A request may carry a *key*; a batch holds one key only (on the replica: one
set of weights and one :func:`~grains.serving.tensors.signature`, since rows
of different shapes cannot be stacked). The oldest waiting request leads the
next batch, which takes its key's requests in arrival order while the others
keep their places: a rare key waits for the batches ahead of it, never for a
busier key to run dry.

No background task: a submit (or a batch ending) starts the next batch as a
plain task, so nothing here outlives the last request, and a replica going
away finishes its batches before it deactivates (the callers are its running
turns). A request whose caller gave up (deadline, cancellation) is dropped
from the queue unrun; one whose caller gives up while its batch runs is
answered nowhere, and the rest of its batch as usual. A batch whose run fails is run again one request at a
time, so only the request that broke it fails.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

Run = Callable[[Sequence[T]], Awaitable[Sequence[R]]]


@dataclass(slots=True)
class _Request(Generic[T, R]):
    item: T
    rows: int
    key: Hashable
    future: asyncio.Future[R]
    queued_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True, slots=True)
class BatchDone:
    """What one finished batch reports to ``on_batch`` (for the replica's statistics)."""

    requests: int
    rows: int
    compute_s: float
    queue_s: tuple[float, ...]
    """Each request's wait from submit to the start of its batch."""
    failed: int
    passes: int = 1
    """Runs of the model: 1, or 1 + one per request when the batch failed and ran again one by one."""


@dataclass(frozen=True, slots=True)
class BatcherStatistics:
    queued: int
    """Requests waiting for a batch."""
    queued_rows: int
    running: int
    """Batches in their forward pass."""


# A caller may give up (its deadline, a cancellation) at any await of a batch's run, which cancels
# its future: every answer goes through these two, so that caller never breaks the others' answers.
def _answer(fut: asyncio.Future[R], result: R) -> None:
    if not fut.done():
        fut.set_result(result)


def _fail(fut: asyncio.Future[R], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class DynamicBatcher(Generic[T, R]):
    """Runs what ``submit`` receives in batches of at most ``max_rows`` rows of one key, ``slots`` at a time."""

    def __init__(
        self,
        run: Run[T, R],
        *,
        max_rows: int,
        max_delay_s: float = 0.0,
        slots: int = 1,
        on_batch: Callable[[BatchDone], None] | None = None,
    ) -> None:
        self._run = run
        self.max_rows = max_rows
        self.max_delay_s = max_delay_s
        self._slots = slots
        self._free = slots
        self._on_batch = on_batch
        self._queue: deque[_Request[T, R]] = deque()
        self._rows = 0
        self._rows_by_key: dict[Hashable, int] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._running = 0

    @property
    def slots(self) -> int:
        return self._slots

    def configure(self, *, max_rows: int, max_delay_s: float, slots: int) -> None:
        """New limits, from the next batch on (a redeploy): running batches finish as they are."""
        self.max_rows, self.max_delay_s = max_rows, max_delay_s
        self._free += slots - self._slots  # below 0 while more than ``slots`` still run
        self._slots = slots
        if self._timer is not None:  # the delay may have shrunk: decide again
            self._timer.cancel()
            self._timer = None
        if self._queue:
            self._kick()

    async def submit(self, item: T, rows: int, key: Hashable = None) -> R:
        """``item``'s share of the result of the batch it joins (only items of equal ``key`` share one)."""
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(item, rows, key, fut))
        self._rows += rows
        self._rows_by_key[key] = self._rows_by_key.get(key, 0) + rows
        self._kick()
        return await fut

    def _kick(self) -> None:
        while self._free > 0 and self._queue:
            self._drop_abandoned()
            if not self._queue:
                return
            head = self._queue[0]
            if self.max_delay_s > 0 and self._rows_by_key[head.key] < self.max_rows:
                wait = head.queued_at + self.max_delay_s - time.perf_counter()
                if wait > 0:
                    if self._timer is None:
                        self._timer = asyncio.get_running_loop().call_later(wait, self._on_timer)
                    return
            batch = self._take()
            self._free -= 1
            self._running += 1
            asyncio.get_running_loop().create_task(self._run_batch(batch))

    def _on_timer(self) -> None:
        self._timer = None
        self._kick()

    def _forget(self, req: _Request[T, R]) -> None:
        self._rows -= req.rows
        left = self._rows_by_key[req.key] - req.rows
        if left:
            self._rows_by_key[req.key] = left
        else:
            del self._rows_by_key[req.key]

    def _drop_abandoned(self) -> None:
        while self._queue and self._queue[0].future.done():
            self._forget(self._queue.popleft())

    def _take(self) -> list[_Request[T, R]]:
        # The oldest request leads the batch, so no key waits behind a busier one for more than
        # the batches ahead of it; the batch takes its key's requests in arrival order, the
        # others keep their places.
        key = self._queue[0].key
        batch: list[_Request[T, R]] = []
        rest: deque[_Request[T, R]] = deque()
        rows = 0
        pending = iter(self._queue)
        for req in pending:
            if req.future.done():
                self._forget(req)
            elif req.key != key:
                rest.append(req)
            elif batch and rows + req.rows > self.max_rows:
                rest.append(req)
                rest.extend(pending)
            else:
                self._forget(req)
                batch.append(req)
                rows += req.rows
        self._queue = rest
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return batch

    async def _run_batch(self, batch: list[_Request[T, R]]) -> None:
        start = time.perf_counter()
        failed, passes = 0, 1
        try:
            try:
                results = await self._run([r.item for r in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"batch of {len(batch)} requests gave {len(results)} results")
                for req, res in zip(batch, results, strict=True):
                    _answer(req.future, res)
            except Exception as exc:  # noqa: BLE001 - whatever the model raised is the caller's answer
                if len(batch) == 1:
                    failed = 1
                    _fail(batch[0].future, exc)
                else:
                    failed, again = await self._one_by_one(batch)
                    passes += again
        except BaseException as exc:  # cancelled (the silo is stopping): nobody may hang
            for req in batch:
                _fail(req.future, exc if isinstance(exc, Exception) else asyncio.CancelledError())
            raise
        finally:
            self._free += 1
            self._running -= 1
            if self._on_batch is not None:
                self._on_batch(BatchDone(
                    requests=len(batch), rows=sum(r.rows for r in batch), compute_s=time.perf_counter() - start,
                    queue_s=tuple(start - r.queued_at for r in batch), failed=failed, passes=passes,
                ))  # fmt: skip
            self._kick()

    async def _one_by_one(self, batch: list[_Request[T, R]]) -> tuple[int, int]:
        """Failed requests and passes run."""
        failed = passes = 0
        for req in batch:
            if req.future.done():
                continue
            passes += 1
            try:
                (res,) = await self._run([req.item])
            except Exception as exc:  # noqa: BLE001
                failed += 1
                _fail(req.future, exc)
            else:
                _answer(req.future, res)
        return failed, passes

    def statistics(self) -> BatcherStatistics:
        return BatcherStatistics(queued=len(self._queue), queued_rows=self._rows, running=self._running)
