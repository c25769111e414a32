"""Streamed results: the caller's end of a call to a grain method written as an async generator.

A reference's method for an ``async def`` that ``yield``\\ s returns a :class:`ResultStream` at
once, without a round trip; ``async for`` opens the call on its first step (through the
caller's ``invoke``, as every call goes) and then takes the items the callee sends::

    async for token in model.generate(prompt):
        ...

Back-pressure is a window of credit (Reactive Streams' ``request(n)``): the caller grants
``window`` items when the call opens and grants more as it takes them (half a window at a
time), and the callee advances its generator only while it holds credit, so a slow consumer
pauses the generator and no more than ``window`` items are ever produced beyond those taken.

Leaving the loop early ends the call on the callee: ``break`` drops the last reference to the
stream, which sends the cancel at once (CPython frees it there and then), as do
``await stream.aclose()`` and cancelling the task that waits in ``async for``; the callee's
generator gets ``GeneratorExit`` (or ``CancelledError``, when it was awaiting) and its
``finally`` runs. A stream kept in a variable is not dropped by ``break``: close it
(``async with contextlib.aclosing(ref.m()) as items:``).

The deadline (``with_timeout``, else the caller's default) is per item: opening the call
and each later step of ``async for`` that has to wait gets that long for its item (or the
end); past it the step raises ``GrainTimeoutError`` and the callee's generator is stopped.
A consumer that is slow to ask is no timeout: the generator just waits for credit.

This module is the programming model's part; the runtime binds each stream to the
connection or activation that serves it through a :class:`StreamLink`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from grains.call import Call

if TYPE_CHECKING:
    from grains.ref import Caller

T_co = TypeVar("T_co", covariant=True)

_NEW, _OPEN, _CLOSED = range(3)


class StreamLink(Protocol):
    """What serves one open stream (a request on a connection, or a turn on this silo)."""

    def grant(self, n: int) -> None:
        """Let the callee send ``n`` more items."""

    def cancel(self) -> None:
        """The caller is done before the end: stop the callee's generator (never raises)."""

    def timed_out(self, timeout_s: float) -> Exception:
        """The error a step that waited past the deadline raises."""


class StreamChannel:
    """One streamed call's items on their way to its caller: what the runtime fills.

    The runtime (a connection, a turn on this silo) holds this, never the
    :class:`ResultStream` the caller iterates, so dropping that one is seen at once."""

    __slots__ = (
        "_call",
        "_caller",
        "_error",
        "_every",
        "_finished",
        "_items",
        "_link",
        "_state",
        "_taken",
        "_timeout_s",
        "_waiter",
        "window",
    )

    def __init__(self, caller: Caller, call: Call) -> None:
        self._caller: Caller = caller
        self._call = call
        self._state = _NEW
        self._items: deque[Any] = deque()
        self._finished = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._link: StreamLink | None = None
        self._timeout_s: float | None = None
        self._taken = 0
        self._every = 1
        self.window = 0
        """Items the callee may run ahead of this consumer (set when the call opens)."""

    @property
    def call(self) -> Call:
        return self._call

    def __repr__(self) -> str:
        return f"<StreamChannel {self._call.grain}.{self._call.method}>"

    async def next(self) -> Any:
        if self._state == _NEW:
            self._state = _OPEN
            try:
                await self._caller.invoke(self._call, False, self)
            except BaseException:
                self._state = _CLOSED
                self._link = None
                raise
        while not self._items:
            if self._finished or self._state == _CLOSED:
                self._state = _CLOSED
                self._link = None
                error, self._error = self._error, None
                if error is not None:
                    raise error
                raise StopAsyncIteration
            await self._wait()
        item = self._items.popleft()
        self._taken += 1
        if self._taken >= self._every and not self._finished and self._link is not None:
            self._link.grant(self._taken)
            self._taken = 0
        return item

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        link = self._link
        try:
            async with asyncio.timeout(self._timeout_s):
                await waiter
        except TimeoutError:
            self._stop()
            raise (link.timed_out(self._timeout_s or 0.0) if link is not None else TimeoutError()) from None
        except asyncio.CancelledError:
            self._stop()  # the consumer's task was cancelled: so is the callee's generator
            raise
        finally:
            self._waiter = None

    def stop(self) -> None:
        """Stop the call (the callee's generator is closed) unless it has ended; idempotent."""
        self._stop()

    def _stop(self) -> None:
        if self._state == _OPEN and not self._finished and self._link is not None:
            self._link.cancel()
        self._state = _CLOSED
        self._link = None
        self._items.clear()

    def dropped(self) -> None:
        """The caller dropped its stream unfinished (``break``): stop the callee too."""
        if self._state == _OPEN and not self._finished and self._link is not None:
            self._link.cancel()

    # --- the runtime's side -------------------------------------------------------
    def begin(self, window: int, timeout_s: float) -> None:
        """Start an attempt to open the call (again, after one turned away unrun)."""
        self._state = _OPEN  # (a relay on a silo is opened by the runtime, not by ``async for``)
        self.window = window
        self._every = max(1, window // 2)
        self._timeout_s = timeout_s
        self._items.clear()
        self._finished = False
        self._error = None
        self._taken = 0
        self._link = None

    def attach(self, link: StreamLink) -> None:
        """What serves this attempt: where credit and the cancel go."""
        self._link = link

    def push(self, item: Any) -> None:
        """One item from the callee (never more than the credit granted)."""
        if self._finished or self._state == _CLOSED:
            return
        self._items.append(item)
        self._wake()

    def finish(self, error: BaseException | None = None) -> None:
        """The callee's generator ended (``error``: how it failed); later calls change nothing."""
        if self._finished:
            return
        self._finished = True
        self._error = error
        self._wake()

    async def opened(self) -> None:
        """Wait for the first item or the end; raise the error of a call that failed before its
        first item (the router retries one that never ran)."""
        while not self._items and not self._finished:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if not self._items and self._error is not None:
            error, self._error = self._error, None
            self._finished = False  # the attempt is over; begin() starts the next, if any
            raise error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ResultStream(Generic[T_co]):
    """The items a streamed grain call yields, as an async iterator (see the module docstring)."""

    __slots__ = ("channel",)

    def __init__(self, caller: Caller, call: Call) -> None:
        self.channel = StreamChannel(caller, call)

    def __repr__(self) -> str:
        return f"<ResultStream {self.channel.call.grain}.{self.channel.call.method}>"

    def __aiter__(self) -> ResultStream[T_co]:
        return self

    async def __anext__(self) -> T_co:
        return await self.channel.next()  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """Stop the call (the callee's generator is closed) unless it has ended; idempotent."""
        self.channel.stop()

    def __del__(self) -> None:
        # ``break`` out of ``async for`` drops the stream here: the callee must stop too.
        with contextlib.suppress(Exception):  # a finaliser must not raise (the loop may be gone)
            self.channel.dropped()
