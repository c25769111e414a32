"""One grain call as a value: what a reference asked for, and what the frame header carries.

A :class:`~grains.ref.GrainRef` method builds one :class:`Call`; the caller
(a client's or a silo's router) sends it, the receiving silo's dispatcher
rebuilds it from the frame and queues it on the grain's activation. The fields are
exactly those of a request on the wire: the target grain, the method, the
arguments, the time the caller allows, the chain of grains the call is made
from and how many times a silo has forwarded it.

The time travels as a duration (``timeout_s``), never as a deadline: each
process turns it into a deadline on its own monotonic clock when the call
starts there (``loop.time() + timeout_s``), since clocks of two hosts do not
agree. That deadline is why router and dispatcher pass ``(call, deadline)``.

``Call`` is a ``NamedTuple``: immutable and without a per-instance dict. It is
built once per call on each side of the hot path (tens of thousands of calls/s
a core), where a frozen dataclass would cost 0.9 µs a call (one
``object.__setattr__`` per field). ``Call(...)`` costs 0.24 µs; the reference
and the dispatcher build it with ``tuple.__new__(Call, (all seven fields))``,
0.13 µs (Python 3.11).
"""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

from grains.ids import GrainId

CALL_CHAIN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("redgrain_call_chain", default=())
"""Grain ids (``Type/key``) of the call chain the current task runs in.

An activation sets it for the length of each turn (the turn's chain plus its own
grain), so a call made from inside a turn carries the chain and the target can
refuse a call that would wait on itself (deadlock detection). Outside any turn
(a client) it is empty.
"""


class Call(NamedTuple):
    """One call to a grain method, as it travels."""

    grain: GrainId
    """The target grain."""
    method: str
    """Name of the grain's ``async def`` method."""
    args: tuple[Any, ...]
    """Positional arguments."""
    kwargs: dict[str, Any] | None = None
    """Keyword arguments; None when there are none (the common case, cheaper on the wire)."""
    timeout_s: float | None = None
    """Time the caller allows; None takes the caller's default (``call_timeout_s``)."""
    chain: tuple[str, ...] = ()
    """Grain ids of the calls this one is made from, outermost first (``CALL_CHAIN``). :data:`UNREAD`,
    as a reference builds it: the chain of the task the call starts in, which the caller reads
    when its ``invoke`` starts running (:func:`started`)."""
    hops: int = 0
    """Times a silo that did not own the grain forwarded this call (bounded by the dispatcher)."""

    def forwarded(self, timeout_s: float) -> Call:
        """The same call relayed one hop further, with the time it has left."""
        return Call(self.grain, self.method, self.args, self.kwargs, timeout_s, self.chain, self.hops + 1)


class _Unread(tuple[str, ...]):
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNREAD"


UNREAD: tuple[str, ...] = _Unread()
"""The chain a reference leaves to its caller (:func:`started`): a tuple of its own, told apart by
identity, and empty, so a caller that did not read it sends a chain that is merely empty."""

_new_call = tuple.__new__


def started(call: Call) -> Call:
    """``call`` with its chain read now, in the task it starts in, if the reference left it open.

    A reference's method is a plain function that returns its caller's ``invoke`` coroutine: a
    coroutine frame of its own would cost every call an allocation (+13% young-generation
    collections on a pipelined same-silo call). So it cannot read the chain when the call
    starts; it leaves :data:`UNREAD`, and each ``Caller.invoke`` calls this first, in its own
    frame, which runs in the awaiting task. ``self.start_task(ref.m())`` then runs outside the
    turn's chain, as it must: the coroutine is made inside the turn but starts in the new task.
    """
    if call.chain is not UNREAD:
        return call
    return _new_call(Call, (*call[:5], CALL_CHAIN.get(), call[6]))  # type: ignore[no-any-return]
