"""Call filters: middleware around every grain method call, wrapped once at start.

A filter is ``async def f(ctx, call_next)``; it sees the call's
:class:`CallContext` and awaits ``call_next(ctx)`` to run the rest of the chain
and finally the grain method (stats, tracing and auth are filters, not special
cases in the catalog). The chain is built once when the catalog starts, as
Starlette builds its middleware stack, so a call walks a fixed list of
closures rather than re-assembling it per call.

Each link is a plain function that returns its filter's coroutine instead of
awaiting it, and the innermost one returns the grain method's own coroutine:
with no filters a turn awaits the method directly, one coroutine frame in all.
"""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grains.ids import GrainId

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


def build_pipeline(filters: list[CallFilter], final: CallNext) -> CallNext:
    """Wrap the filters around the final invoker once (Starlette's middleware stack)."""
    call = final
    for flt in reversed(filters):
        call = _wrap(flt, call)
    return call


def _wrap(flt: CallFilter, nxt: CallNext) -> CallNext:
    # A plain function returning the filter's coroutine: no coroutine frame of its own per call.
    def run(ctx: CallContext) -> Awaitable[Any]:
        return flt(ctx, nxt)

    return run


def invoke_method(ctx: CallContext) -> Awaitable[Any]:
    """The innermost link: the grain method's own coroutine (one frame fewer than awaiting it here)."""
    fn = getattr(ctx.activation.instance, ctx.method)
    if ctx.kwargs:
        return fn(*ctx.args, **ctx.kwargs)  # type: ignore[no-any-return]
    return fn(*ctx.args)  # type: ignore[no-any-return]


def format_remote_traceback(exc: BaseException) -> str:
    """The traceback of a failed call as text, for the error frame sent to the caller."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
