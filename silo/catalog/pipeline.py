"""Call filters: middleware around every grain method call, wrapped once at start.

A filter is ``async def f(ctx, call_next)``; it sees the call's
:class:`CallContext` and awaits ``call_next(ctx)`` to run the rest of the chain
and finally the grain method (stats, tracing and auth are filters, not special
cases in the catalog). The chain is built once when the catalog starts, as
Starlette builds its middleware stack, so a call walks a fixed list of
closures rather than re-assembling it per call.

Incoming filters run on the silo that hosts the grain, for calls from anywhere
(the same silo, another, a client) and for the runtime's own calls, the
internal turns (``internal.py``: a reminder tick is a call of ``__reminder__``,
a stream item of ``__stream__``, with their arguments), outermost first: the silo's call stats,
the filters passed to ``Silo(filters=...)``, ``incoming_filters`` from the
settings, then the grain class's ``@incoming_filter`` ones (one chain per
grain type, built on its first call). Outgoing filters run in the caller's
process, around the sending of a call (:class:`OutgoingContext`): a grain
class's ``@outgoing_filter`` ones first, then the silo's ``outgoing_filters``;
a client runs its own ``outgoing_filters``. A filter may answer without
calling ``call_next`` (a cache, a refusal) or pass a changed context on
(``dataclasses.replace(ctx, call=...)``).

Each link is a plain function that returns its filter's coroutine instead of
awaiting it, and the innermost one returns the grain method's own coroutine:
with no filters a turn awaits the method directly, one coroutine frame in all.
"""

from __future__ import annotations

import traceback
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import AsyncGeneratorType
from typing import TYPE_CHECKING, Any, TypeVar

from grains.call import Call, started
from grains.ids import GrainId
from grains.ref import Caller
from grains.result_stream import StreamChannel
from silo.catalog.internal import INTERNAL_TURNS

if TYPE_CHECKING:
    from silo.catalog.activation import Activation


@dataclass(frozen=True, slots=True)
class CallContext:
    """What call filters see of an incoming call."""

    grain_id: GrainId
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] | None
    chain: tuple[str, ...]
    activation: Activation


CallNext = Callable[[CallContext], Awaitable[Any]]
CallFilter = Callable[[CallContext, CallNext], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class OutgoingContext:
    """What outgoing call filters see of a call being made."""

    call: Call
    """The call as the reference built it (target, method, arguments, timeout, chain)."""
    one_way: bool
    """A ``@one_way`` call: the send returns None once it is on its way."""
    stream: StreamChannel | None = None
    """A streamed call (an async-generator method): the send returns None once the stream has its
    first item or its end; the items go to this stream, past the filters."""

    @property
    def grain_id(self) -> GrainId:
        return self.call.grain

    @property
    def method(self) -> str:
        return self.call.method

    @property
    def caller(self) -> str | None:
        """The calling grain (``Type/key``) when the call is made inside its turn; None from a client
        (or a grain's background task, which runs outside any call chain)."""
        return self.call.chain[-1] if self.call.chain else None


OutgoingNext = Callable[[OutgoingContext], Awaitable[Any]]
OutgoingFilter = Callable[[OutgoingContext, OutgoingNext], Awaitable[Any]]

C = TypeVar("C")


def build_pipeline(
    filters: Sequence[Callable[[C, Callable[[C], Awaitable[Any]]], Awaitable[Any]]],
    final: Callable[[C], Awaitable[Any]],
) -> Callable[[C], Awaitable[Any]]:
    """Wrap the filters around the final invoker once (Starlette's middleware stack)."""
    call = final
    for flt in reversed(filters):
        call = _wrap(flt, call)
    return call


def _wrap(
    flt: Callable[[C, Callable[[C], Awaitable[Any]]], Awaitable[Any]], nxt: Callable[[C], Awaitable[Any]]
) -> Callable[[C], Awaitable[Any]]:
    # A plain function returning the filter's coroutine: no coroutine frame of its own per call.
    def run(ctx: C) -> Awaitable[Any]:
        return flt(ctx, nxt)

    return run


class FilteredCaller:
    """A ``Caller`` (grains/ref.py) that runs outgoing filters around another caller's sends."""

    __slots__ = ("_chain", "inner")

    def __init__(self, inner: Caller, filters: Sequence[OutgoingFilter]) -> None:
        self.inner = inner
        self._chain = build_pipeline(filters, self._send)

    def _send(self, ctx: OutgoingContext) -> Awaitable[Any]:
        return self.inner.invoke(ctx.call, ctx.one_way, ctx.stream)

    async def invoke(self, call: Call, one_way: bool = False, stream: StreamChannel | None = None) -> Any:
        return await self._chain(OutgoingContext(started(call), one_way, stream))  # filters read the chain


def filtered_caller(inner: Caller, filters: Sequence[OutgoingFilter]) -> Caller:
    """``inner`` itself when there are no filters (no cost), else a :class:`FilteredCaller`."""
    return FilteredCaller(inner, filters) if filters else inner


def invoke_method(ctx: CallContext) -> Awaitable[Any]:
    """The innermost link: the grain method's own coroutine (one frame fewer than awaiting it
    here), or the turn an internal method names (a reminder tick, a stream item: ``internal.py``);
    for an async-generator method, an awaitable of the generator, which the streamed call's
    turn then runs (silo/messaging/results.py): filters see such a call open."""
    method = ctx.method
    if method[:1] == "_":  # an internal turn's name: no remote method starts with "_"
        return INTERNAL_TURNS[method](ctx.activation, ctx.args)()
    fn = getattr(ctx.activation.instance, method)
    result = fn(*ctx.args, **ctx.kwargs) if ctx.kwargs else fn(*ctx.args)
    if type(result) is AsyncGeneratorType:
        return _opened(result)
    return result  # type: ignore[no-any-return]


async def _opened(generator: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    return generator


def format_remote_traceback(exc: BaseException) -> str:
    """The traceback of a failed call as text, for the error frame sent to the caller."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
