"""Internal turns: the calls the runtime itself makes to a grain, by method name.

A reminder tick and a stream item are calls like any other: sent by the
router (one retry policy, one deadline, the same errors), queued in the
grain's mailbox, run as a turn. Only their method is no method of the grain's
interface: it names a turn below, which the dispatcher looks up here. A new
kind of internal call is one more row of :data:`INTERNAL_TURNS`, not a special
case on the call path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from grains.streams import StreamGap
from silo import errors

if TYPE_CHECKING:
    from silo.catalog.activation import Activation

REMINDER_METHOD = "__reminder__"
"""A reminder tick; args: ``(name,)``; runs ``receive_reminder(name)``, returns the silo it ran on."""

STREAM_METHOD = "__stream__"
"""A stream item; args: ``(namespace, item, token)``; runs ``on_stream_item(item, token)``."""

STREAM_GAP_METHOD = "__stream_gap__"
"""Items trimmed before delivery; args: ``(namespace, after, before, lost)``; runs ``on_stream_gap(gap)``."""

Turn = Callable[[], Awaitable[Any]]
TurnFactory = Callable[["Activation", tuple[Any, ...]], Turn]
"""The turn an internal call runs on an activation; CodecError for arguments it cannot take."""


def reminder_turn(act: Activation, args: tuple[Any, ...]) -> Turn:
    if len(args) != 1 or not isinstance(args[0], str):
        raise errors.CodecError(f"a reminder delivery carries one name, got {args!r:.100}")
    name = args[0]

    async def receive_reminder() -> str:
        await act.instance.receive_reminder(name)
        return str(act.silo)  # the dashboard shows where each tick ran

    return receive_reminder


def stream_turn(act: Activation, args: tuple[Any, ...]) -> Turn:
    if len(args) != 3 or not isinstance(args[0], str) or not isinstance(args[2], str):
        raise errors.CodecError(f"a stream delivery carries (namespace, item, token), got {args!r:.100}")
    _, item, token = args

    async def on_stream_item() -> None:
        await act.instance.on_stream_item(item, token)

    return on_stream_item


def stream_gap_turn(act: Activation, args: tuple[Any, ...]) -> Turn:
    if (
        len(args) != 4 or not isinstance(args[0], str) or not isinstance(args[1], str)
        or not isinstance(args[2], str | None) or not isinstance(args[3], int | None)
    ):  # fmt: skip
        raise errors.CodecError(f"a stream gap carries (namespace, after, before, lost), got {args!r:.100}")
    gap = StreamGap(args[0], act.grain_id.key, args[1], args[2], args[3])

    async def on_stream_gap() -> None:
        await act.instance.on_stream_gap(gap)

    return on_stream_gap


INTERNAL_TURNS: Mapping[str, TurnFactory] = MappingProxyType(
    {REMINDER_METHOD: reminder_turn, STREAM_METHOD: stream_turn, STREAM_GAP_METHOD: stream_gap_turn}
)
"""Every internal method and the turn it runs (no grain method starts with ``_``: never remote)."""
# invoke_method (pipeline.py) tells an internal turn by its leading "_" alone.
assert all(name.startswith("_") for name in INTERNAL_TURNS)
