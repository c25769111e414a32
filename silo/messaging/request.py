"""A REQUEST or ONEWAY frame read into a :class:`~grains.call.Call`: one reader for every end
that answers calls (a silo's dispatcher, a client's or silo's observer hub), so both take
and refuse the same frames."""

from __future__ import annotations

from typing import Any

from grains.call import Call
from grains.ids import GrainId
from silo import errors
from silo.codec import Codec
from silo.messaging.frame import Frame

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
