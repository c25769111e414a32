"""Streams as a grain sees them: the handle's shape, items with tokens, ``@subscribes``.

A stream is named by ``(namespace, key)`` and lives in Redis (the runtime's
``silo/streams/``). Anyone publishes to it; two kinds of subscriber read it:

- **explicit**: ``async for ev in stream.subscribe(from_start=True)``, a
  reader of its own that starts where it is told and stops when it leaves the
  loop (or calls ``close()``);
- **implicit**: a grain class marked ``@subscribes("chat")`` is activated per
  stream key of namespace ``chat`` (the grain's key is the stream key) and gets
  each item as a turn, ``on_stream_item(item, token)``, in order, at least once
  (items trimmed before delivery: ``on_stream_gap(StreamGap)``).

::

    @subscribes("chat")
    class RoomLog(Grain):
        async def on_stream_item(self, item: ChatMessage, token: str) -> None:
            ...

The token of an item is its Redis stream entry id (``"1700000000000-0"``):
tokens of one stream grow with each item, and ``subscribe(from_token=t)``
resumes after ``t``.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar

T = TypeVar("T", bound=type)

__all__ = [
    "Stream", "StreamGap", "StreamItem", "Subscription", "check_namespace", "subscribes", "subscriptions", "token_order",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One item read from a stream, with its token (the Redis stream entry id)."""

    item: Any
    token: str


@dataclass(frozen=True, slots=True)
class StreamGap:
    """Items of a stream that retention trimmed before they were delivered to a ``@subscribes``
    grain (``Grain.on_stream_gap``): those published after token ``after`` and before token
    ``before`` (None: up to the newest; nothing came after them yet)."""

    namespace: str
    key: str
    after: str
    """The last token delivered before the gap (``"0-0"``: none yet)."""
    before: str | None
    """The token delivered next, the first after the gap (None: none published yet)."""
    lost: int | None
    """How many items were lost (None: Redis could not tell, after ``XDEL`` or an old group)."""


class Subscription(Protocol):
    """An explicit subscription: iterate it for items in order; leave the loop or ``close()`` to stop."""

    def __aiter__(self) -> AsyncIterator[StreamItem]: ...

    async def __anext__(self) -> StreamItem: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc: object) -> None: ...


class Stream(Protocol):
    """A handle on stream ``(namespace, key)``; cheap to make, holds nothing open."""

    @property
    def namespace(self) -> str: ...

    @property
    def key(self) -> str: ...

    async def publish(self, item: Any) -> str:
        """Append ``item`` (encoded with the cluster's codec); returns its token."""
        ...

    def subscribe(self, *, from_start: bool = False, from_token: str | None = None) -> Subscription:
        """Items after ``from_token``, or all kept ones (``from_start``), or those published from now."""
        ...


def token_order(token: str) -> tuple[int, int]:
    """A token as a sortable pair: a subscriber that must see each item once keeps the last
    token it handled and skips items whose ``token_order`` is not greater (at-least-once
    delivery may repeat the items after the last acknowledged one)."""
    ms, _, seq = token.partition("-")
    return int(ms), int(seq or 0)


def check_namespace(namespace: str) -> str:
    """A namespace is part of Redis key names: non-empty, without ``:`` or braces."""
    if not isinstance(namespace, str) or not namespace or any(c in namespace for c in ":{}"):
        raise ValueError(f"a stream namespace must be a non-empty str without ':', '{{' or '}}': {namespace!r}")
    return namespace


def subscribes(*namespaces: str) -> Callable[[T], T]:
    """Implicitly subscribe this grain class to every stream key of ``namespaces``.

    The runtime activates the grain whose key is the stream's key and calls
    ``on_stream_item(item, token)`` as a turn for each item, in order per key,
    acknowledging it once the turn returned: at least once, even across a
    silo's death (the item may then come again; ``token`` tells duplicates).
    An item that fails ``streams.max_attempts`` times goes to the namespace's
    dead-letter stream; items retention trimmed before delivery are told to
    ``on_stream_gap(gap)``. Both handlers are checked here: a ``TypeError`` if
    one is not ``async`` or cannot take its arguments.
    """
    if not namespaces:
        raise ValueError("@subscribes needs at least one namespace")
    checked = tuple(check_namespace(ns) for ns in namespaces)

    def mark(cls: T) -> T:
        from grains.base import Grain

        if getattr(cls, "on_stream_item", None) in (None, Grain.on_stream_item):
            raise TypeError(f"{cls.__qualname__} is @subscribes but has no on_stream_item(item, token)")
        # Refused here, at import, rather than failing every item at run time.
        _check_handler(cls, "on_stream_item", "item, token")
        _check_handler(cls, "on_stream_gap", "gap")
        type.__setattr__(cls, "__rg_subscribes__", checked)
        return cls

    return mark


def _check_handler(cls: type, name: str, params: str) -> None:
    """``cls.name`` must be a coroutine function the runtime can call with ``params`` positionally."""
    fn = getattr(cls, name)
    reason = ""
    if not inspect.iscoroutinefunction(fn):
        reason = "it is not a coroutine function"
    else:
        try:
            inspect.signature(fn).bind(*(None for _ in range(1 + params.count(",") + 1)))
        except TypeError as exc:
            reason = str(exc)
    if reason:
        raise TypeError(f"{cls.__qualname__}.{name} must be `async def {name}(self, {params})`: {reason}")


def subscriptions(cls: type) -> tuple[str, ...]:
    """The namespaces a grain class is implicitly subscribed to (``@subscribes``)."""
    return tuple(cls.__dict__.get("__rg_subscribes__", ()))
