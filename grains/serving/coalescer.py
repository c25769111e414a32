"""Client-side coalescing: concurrent predicts from one process share one grain call.

The replica's :class:`~grains.serving.batcher.DynamicBatcher` merges the
requests that reach it into one forward pass, but each request still costs a
grain call: a frame each way, a turn on the replica's silo, a future on the
client. With many callers in one process (an HTTP front, a web app's request
handlers, a data pipeline's workers) that per-call cost, not the model, is
what limits throughput. So :class:`~grains.serving.client.Predictor` runs a
batcher of its own before the wire: the requests waiting while its merged
calls are in flight leave together, concatenated row-wise, as one call (at
most the model's ``max_batch_size`` rows), and each caller gets its own rows
of the answer back. A lone caller never waits: with nothing in flight its
request leaves at once, alone and unchanged.

Only requests of one *signature* (:func:`~grains.serving.tensors.signature`:
the same input names, dtypes and shapes past the first (row) dimension) merge:
the batcher's batches hold one signature each, the oldest waiting request's
first, as on the replica. A merged call that the replica refuses as bad input (one request's
shape was wrong) is sent again request by request, so only the culprit gets
the error; any other failure (a deadline, the model not ready) is every
member's answer. The merged call's deadline is the latest of its members';
each caller still stops waiting at its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from grains.serving.batcher import DynamicBatcher
from grains.serving.errors import BadInputError, RequestTooLargeError
from grains.serving.tensors import Inputs, merge, signature, split

Send = Callable[[Inputs, int, float], Awaitable[Any]]
"""``send(inputs, requests, deadline)``: one grain call of ``requests`` merged requests (loop-time deadline)."""
Split = Callable[[Any, list[int]], Sequence[Any]]
"""``split(answer, rows)``: a merged call's answer cut into each member's (default: its output tensors' rows)."""


@dataclass(slots=True)
class _Pending:
    inputs: Inputs
    rows: int
    deadline: float


class Coalescer:
    """Merges concurrent requests into calls of at most ``max_rows`` rows, ``in_flight`` at a time.

    :param split: cuts a merged call's answer into its members' (:data:`Split`).
    """

    def __init__(self, send: Send, *, max_rows: int, in_flight: int = 2, split: Split = split) -> None:
        self._send = send
        self._split = split
        self._batcher: DynamicBatcher[_Pending, Any] = DynamicBatcher(self._run, max_rows=max_rows, slots=in_flight)
        self.calls = 0
        """Grain calls sent (a merged call counts once)."""

    @property
    def max_rows(self) -> int:
        return self._batcher.max_rows

    @max_rows.setter
    def max_rows(self, value: int) -> None:
        self._batcher.max_rows = max(1, value)

    @property
    def in_flight(self) -> int:
        return self._batcher.slots

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        """From the next call on; calls out now finish as they are."""
        if value != self._batcher.slots:
            b = self._batcher
            b.configure(max_rows=b.max_rows, max_delay_s=b.max_delay_s, slots=max(1, value))

    async def submit(self, inputs: Inputs, rows: int, key: Hashable, deadline: float) -> Any:
        """``inputs``' answer; raises what its call raised. ``key``: its :func:`signature`'s second part."""
        out = await self._batcher.submit(_Pending(inputs, rows, deadline), rows, key)
        if isinstance(out, BaseException):
            raise out
        return out

    async def _run(self, items: Sequence[_Pending]) -> list[Any]:
        # Results, or the exception each member raises: the batcher's own fallback (run again one
        # by one on any failure) would multiply a deadline or a failover by the batch's size.
        # The batcher hands over requests of one signature only.
        if len(items) == 1:
            return [await self._one(items[0])]
        try:
            merged = merge([it.inputs for it in items])
        except (RuntimeError, TypeError):  # tensors torch cannot concatenate (devices, layouts)
            return list(await asyncio.gather(*(self._one(it) for it in items)))
        self.calls += 1
        try:
            y = await self._send(merged, len(items), max(it.deadline for it in items))
            return list(self._split(y, [it.rows for it in items]))
        except (BadInputError, RequestTooLargeError):
            return list(await asyncio.gather(*(self._one(it) for it in items)))
        except Exception as exc:  # noqa: BLE001 - every member's answer
            return [exc] * len(items)

    async def _one(self, it: _Pending) -> Any:
        self.calls += 1
        try:
            return await self._send(it.inputs, 1, it.deadline)
        except Exception as exc:  # noqa: BLE001 - the caller's answer
            return exc


__all__ = ["Coalescer", "Send", "Split", "signature"]
