"""A call inside a silo: the invocation queued on an activation, its answer slot, re-routing.

The dispatcher turns each incoming :class:`~grains.call.Call` into an
:class:`Invocation` and queues it on the grain's activation; the activation
runs it in a turn and sets its answer slot. A remote caller waits on no
coroutine here, so its slot is a :class:`Reply` that hands the outcome straight
to a callback that writes the response frame; a local caller (the router, for
a grain on this silo) awaits an ``asyncio.Future``.

An invocation that never started (its activation went away, or was never
ready) is answered with :class:`Reroute`: the dispatcher catches it and looks
the grain up again, so no queued call is dropped and none hangs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grains.request_context import Value

if TYPE_CHECKING:
    from grains.ids import SiloAddress
    from silo.catalog.activation import Activation


class Reroute(Exception):
    """Internal: the call never started here; send it wherever the grain lives now.

    ``to``: the silo that won the grain's directory entry, when that is why (a call queued
    on an activation that lost the race); None: look the grain up again.
    """

    def __init__(self, to: SiloAddress | None = None) -> None:
        super().__init__(to)
        self.to = to


class Reply:
    """A one-shot answer slot that hands the outcome straight to ``callback``.

    An asyncio Future runs its done-callbacks on a later loop iteration; a call
    that came over the network needs no awaiting coroutine, only its answer
    sent, so this saves a scheduling hop per call. It offers the part of the
    Future API the catalog uses (done, set_result, set_exception, cancelled).
    """

    __slots__ = ("_callback", "_done")

    def __init__(self, callback: Callable[[Any, BaseException | None], None]) -> None:
        self._callback = callback
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, result: Any) -> None:
        if self._done:
            raise asyncio.InvalidStateError("reply already set")
        self._done = True
        self._callback(result, None)

    def set_exception(self, exc: BaseException) -> None:
        if self._done:
            raise asyncio.InvalidStateError("reply already set")
        self._done = True
        self._callback(None, exc)


@dataclass(slots=True, eq=False)
class Invocation:
    """One call waiting for, or running in, a turn."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] | None
    chain: tuple[str, ...]
    deadline: float
    future: asyncio.Future[Any] | Reply
    callback: Callable[[], Awaitable[Any]] | None = None
    interleave: bool = False
    read_only: bool = False
    task: asyncio.Task[Any] | None = None
    cancelled: bool = False
    activation: Activation | None = None
    internal: bool = False
    """A timer tick or write-behind flush: not a use of the activation (idle collection ignores it)."""
    context: Mapping[str, Value] | None = None
    """The caller's request context (grains/request_context.py): current while the turn runs."""
