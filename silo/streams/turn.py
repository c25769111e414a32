"""The turn a stream delivery runs on the subscriber's activation: ``on_stream_item(item, token)``.

A delivery is a call of the internal method ``__stream__`` (never in a grain's
remote interface), routed like any call so it reaches the grain wherever it
lives and activates it if needed; the dispatcher turns it into this turn.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from silo import errors

if TYPE_CHECKING:
    from silo.catalog.activation import Activation

STREAM_METHOD = "__stream__"
"""Internal method name of a stream delivery; args: (namespace, item, token)."""


def stream_turn(act: Activation, args: tuple[Any, ...]) -> Callable[[], Awaitable[None]]:
    if len(args) != 3 or not isinstance(args[0], str) or not isinstance(args[2], str):
        raise errors.CodecError(f"a stream delivery carries (namespace, item, token), got {args!r:.100}")
    _, item, token = args

    async def on_stream_item() -> None:
        await act.instance.on_stream_item(item, token)

    return on_stream_item
