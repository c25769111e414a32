"""A call as a REQUEST, ONEWAY or STREAM frame: one writer for every sender, one reader for every
end that answers calls.

Every kind of call (two-way, ``@one_way``, a streamed result, a reminder tick, a stream item,
a call to an observer, a call forwarded to another silo) leaves through
:func:`encode_request` and :func:`request_body`, and arrives through
:func:`decode_request` (a silo's dispatcher, a client's or silo's observer
hub), so all ends write, take and refuse the same frames.

The header: ``[kind, request id, type, key, method, timeout_ms, chain, hops]``,
then the caller's trace context when it sends one (:mod:`silo.tracing`). The
connection fills in the request id; the timeout is the time left, not a
deadline (the silos' clocks differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grains.call import Call
from grains.ids import GrainId
from silo import errors
from silo.codec import Codec
from silo.messaging.frame import ONEWAY, Frame
from silo.tracing import Carrier


def encode_request(
    kind: int,
    type_name: str,
    key: str,
    method: str,
    timeout_s: float,
    chain: Sequence[str],
    hops: int,
    trace: Carrier | None = None,
) -> list[Any]:
    """The header of a REQUEST, STREAM (``kind``) or ONEWAY frame; :func:`decode_request` reads it back.

    A ONEWAY frame carries no chain: its caller does not wait, so the callee's calls back to
    it cannot deadlock on it (a turn started by a one-way call starts a chain of its own).
    """
    header = [kind, 0, type_name, key, method, int(timeout_s * 1000), [] if kind == ONEWAY else list(chain), hops]
    if trace is not None:
        header.append(trace)
    return header


def request_body(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """What a request's body encodes: the bare arguments when there are no keyword arguments
    (a list: msgpack packs it natively, where a tuple needs an ext)."""
    return (args, kwargs) if kwargs else list(args)

_new_call = tuple.__new__  # Call with all seven fields, minus NamedTuple's Python-level __new__


def decode_request(header: list[Any], frame: Frame, codec: Codec) -> Call:
    """The call a request frame carries; CodecError (naming what is wrong) for a malformed one.

    The header's fields after kind and id: type, key, method, timeout_ms, chain, hops (a
    trace context may follow); the body is ``(args, kwargs)`` or a bare argument tuple.
    """
    try:
        _, _, type_name, key, method, timeout_ms, chain, hops = header[:8]
        body = codec.decode(frame.meta, frame.buffers)
        if isinstance(body, tuple) and len(body) == 2 and isinstance(body[1], dict) and isinstance(body[0], tuple):
            args, kwargs = body
        elif isinstance(body, (tuple, list)):
            args, kwargs = tuple(body), None
        else:
            raise errors.CodecError(f"request body must be an argument tuple, got {type(body).__name__}")
        timeout_s = float(timeout_ms) / 1000.0
        return _new_call(  # type: ignore[no-any-return]
            Call,
            (
                GrainId(str(type_name), str(key)),
                str(method),
                args,
                kwargs,
                timeout_s,
                tuple(map(str, chain)) if chain else (),
                int(hops),
            ),
        )
    except (ValueError, TypeError) as exc:
        raise errors.CodecError(f"malformed request: {exc}") from exc
