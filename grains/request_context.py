"""Key/values a caller sets that travel with every call it makes, and with every call those make.

As Orleans' ``RequestContext``: set in a client or in a grain's turn, the entries
go with each call the task makes from then on (two-way or one-way, to a grain
on this silo or another, forwarded or re-routed), the callee's turn sees them,
and they go on with the calls it makes in turn. The trace context rides beside
them (silo/tracing.py), so a correlation id or a tenant name can be read at
any depth of a call chain without being passed as an argument::

    from grains import RequestContext

    RequestContext.set("tenant", "acme")
    await client.get_grain(Orders, "o1").place(item)   # Orders.place, and what it calls,
                                                        # read RequestContext.get("tenant")

The entries are per task (a :mod:`contextvars` variable): a task inherits a
snapshot of its creator's (``start_task`` in a grain, ``asyncio.create_task``
in a client), and a callee's change is its own: the caller never sees it.
A reminder tick and a timer tick start with none; a stream item carries its
publisher's. Values are strings, numbers, booleans or None (what a log line
or a filter reads, not data: arguments carry data), at most
:data:`MAX_ENTRIES` entries of at most :data:`MAX_BYTES` bytes as JSON, so a
call never grows by more than that; anything else is refused where it is set
(``ValueError``), and a peer that sends more has its call refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from contextvars import ContextVar, Token
from typing import Any

Value = str | int | float | bool | None
"""What an entry may hold."""

MAX_ENTRIES = 32
MAX_BYTES = 4096
"""The entries' JSON, the most one call carries."""

_ENTRIES: ContextVar[Mapping[str, Value] | None] = ContextVar("redgrain_request_context", default=None)

current = _ENTRIES.get
"""The current task's entries, None when it has none (never an empty mapping): the bound
``ContextVar.get``, so the runtime's per-call paths test for entries without a Python call."""


class RequestContext:
    """The current task's entries (see the module docstring). All methods are static: the
    entries belong to the task that runs, not to an object."""

    @staticmethod
    def get(key: str, default: Value = None) -> Value:
        entries = _ENTRIES.get()
        return default if entries is None else entries.get(key, default)

    @staticmethod
    def set(key: str, value: Value) -> None:
        """Set ``key`` for the calls this task makes from now on (and the tasks it starts)."""
        entries = dict(_ENTRIES.get() or {})
        entries[key] = value
        _ENTRIES.set(_checked(entries))

    @staticmethod
    def remove(key: str) -> None:
        entries = dict(_ENTRIES.get() or {})
        if entries.pop(key, None) is not None or key in (_ENTRIES.get() or {}):
            _ENTRIES.set(entries or None)

    @staticmethod
    def clear() -> None:
        _ENTRIES.set(None)

    @staticmethod
    def items() -> dict[str, Value]:
        """A copy of the current entries."""
        return dict(_ENTRIES.get() or {})


def outgoing() -> str | None:
    """What a call made now carries: the entries as JSON, or None when there are none (the
    common case costs one context-variable read)."""
    entries = _ENTRIES.get()
    return None if not entries else json.dumps(entries, separators=(",", ":"), allow_nan=False)


def incoming(text: Any) -> Mapping[str, Value]:
    """The entries a call carried (its ``outgoing()``); ValueError naming what is wrong when
    they are not what a caller may send (a peer's, so checked as :meth:`RequestContext.set` is)."""
    if not isinstance(text, str) or len(text) > MAX_BYTES:
        raise ValueError(f"a request context is a JSON object of at most {MAX_BYTES} bytes")
    try:
        entries = json.loads(text)
    except ValueError:
        raise ValueError("a request context is not JSON") from None
    if not isinstance(entries, dict):
        raise ValueError("a request context is a JSON object of entries")  # noqa: TRY004 - a malformed value, one error type
    return _checked(entries)


def enter(entries: Mapping[str, Value] | None) -> Token[Mapping[str, Value] | None] | None:
    """Make ``entries`` the current task's (a turn starting: its caller's, or none); :func:`leave`
    undoes it. None when nothing changes (no entries came, none are current): the common case
    costs one context-variable read."""
    if not entries and _ENTRIES.get() is None:
        return None
    return _ENTRIES.set(entries or None)


def leave(token: Token[Mapping[str, Value] | None] | None) -> None:
    if token is not None:
        _ENTRIES.reset(token)


def _checked(entries: dict[str, Any]) -> dict[str, Value]:
    if len(entries) > MAX_ENTRIES:
        raise ValueError(f"a request context holds at most {MAX_ENTRIES} entries, not {len(entries)}")
    for key, value in entries.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"request context keys are non-empty strings, not {key!r}")
        if value is not None and not isinstance(value, str | int | float | bool):
            raise ValueError(
                f"request context entry {key!r} is a {type(value).__name__}: entries are strings, numbers, "
                "booleans or None (arguments carry data)"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"request context entry {key!r} is not a finite number")
    if len(json.dumps(entries, separators=(",", ":"))) > MAX_BYTES:
        raise ValueError(f"a request context holds at most {MAX_BYTES} bytes as JSON")
    return entries
