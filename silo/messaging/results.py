"""Streamed results on the callee's side: the turn that runs an async-generator method.

A call of a grain method written as an async generator is queued and run like any call
(the dispatcher makes it an Invocation, the activation runs it in a turn, one at a time
unless the class is ``@reentrant`` or the method ``@interleave``): the turn runs the call
filters, which see the call open and get the generator as its result, then
:func:`run_generator` advances the generator one item at a time against the caller's credit
(:class:`Sink`), so the activation is busy for as long as the stream lasts, and a slow
caller pauses the generator rather than filling memory. The turn ends when the generator
ends (its result, None, answers the call: the end of the stream), raises (the error
answers the call), or is cancelled (a CANCEL, or a local caller leaving the loop: the
generator is closed, so its ``finally`` runs).

The items go to the caller over its connection (ITEM frames, credit in CREDIT frames:
:mod:`silo.messaging.frame`) or, for a caller on this silo, straight into its
:class:`~grains.result_stream.ResultStream` as codec copies (:class:`LocalLink`), so the
items are the same values at every distance.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from grains.result_stream import StreamChannel
from silo import errors
from silo.codec import SCALARS, Codec

if TYPE_CHECKING:
    from silo.catalog.activation import Activation
    from silo.catalog.invocation import Invocation


MAX_CREDIT = 1 << 20
"""Credit a sink holds at most, whatever a peer grants (a window is far below it)."""


class Sink:
    """Where one streamed call's items go, no faster than its caller's credit."""

    __slots__ = ("_credit", "_deliver", "_drain", "_stopped", "_waiter", "sent")

    def __init__(self, deliver: Callable[[Any], None], drain: Callable[[], Awaitable[None]] | None = None) -> None:
        self._deliver = deliver
        self._drain = drain
        """Waits while the connection's send buffer is full: credit a caller grants but does not
        read off its socket must not pile items up in this process."""
        self._credit = 0
        self._stopped = False
        self._waiter: asyncio.Future[None] | None = None
        self.sent = 0
        """Items delivered so far."""

    def grant(self, n: int) -> None:
        """The caller took items: ``n`` more may be produced."""
        if n <= 0:
            return
        self._credit = min(self._credit + n, MAX_CREDIT)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def stop(self) -> None:
        """The caller left: a producer waiting for credit gets GrainCallError instead."""
        self._stopped = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_credit(self) -> None:
        while self._credit <= 0 or self._stopped:
            if self._stopped:
                raise errors.GrainCallError("the caller left the stream")
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if self._drain is not None:
            await self._drain()

    def deliver(self, item: Any) -> None:
        self._credit -= 1
        self.sent += 1
        self._deliver(item)


async def run_generator(items: AsyncIterator[Any], sink: Sink) -> None:
    """Advance ``items`` only while the sink has credit, handing each item on; close it however
    this ends (cancelled while it waits for credit: ``GeneratorExit`` at its ``yield``)."""
    try:
        while True:
            await sink.wait_credit()
            try:
                item = await items.__anext__()
            except StopAsyncIteration:
                return
            sink.deliver(item)
    finally:
        aclose: Callable[[], Awaitable[None]] | None = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


def open_generator(result: Any, method: str) -> AsyncIterator[Any]:
    """What the call filters handed back for a streamed call: the generator (TypeError if a
    filter answered with something else)."""
    if not hasattr(result, "__anext__"):
        raise TypeError(f"{method} streams its results, but its call filters answered {type(result).__name__}")
    return result  # type: ignore[no-any-return]


class LocalLink:
    """A streamed call between grains of one silo: items are copied into the caller's stream,
    credit and the cancel go straight to the turn."""

    __slots__ = ("_act", "_inv", "_method", "sink")

    def __init__(self, stream: StreamChannel, codec: Codec | None, act: Activation, method: str) -> None:
        self._act = act
        self._method = method
        self._inv: Invocation | None = None
        copy = None if codec is None else codec.copy

        def deliver(item: Any) -> None:
            # The caller gets what it would decode from the wire, never the callee's object.
            stream.push(item if copy is None or type(item) in SCALARS else copy(item))

        self.sink = Sink(deliver)
        self.sink.grant(stream.window)

    def bind(self, inv: Invocation) -> None:
        self._inv = inv

    def grant(self, n: int) -> None:
        self.sink.grant(n)

    def cancel(self) -> None:
        if self._inv is not None:
            try:
                self._act.cancel_call(self._inv)
            except RuntimeError:
                pass  # the loop is closed

    def timed_out(self, timeout_s: float) -> Exception:
        return errors.GrainTimeoutError(self._act.grain_key, self._method, timeout_s)
