"""How an exception crosses the wire: the body of an ERROR frame and back.

redgrain's own errors that have a wire code (``errors.CODE_OF``) keep their
class: the body carries the code, the message and the simple-typed fields, and
the receiver rebuilds the same class without calling its ``__init__`` (whose
signature varies). A :class:`~silo.errors.RemoteGrainError` passes through as
it is, and any other exception becomes one that names its type and carries
its message and the remote traceback as text. Nothing is pickled.
"""

from __future__ import annotations

from typing import Any

from silo import errors


def error_body(exc: BaseException) -> dict[str, Any]:
    """How an exception crosses the wire: a code for our own, type/message/traceback for the rest."""
    from silo.catalog.pipeline import format_remote_traceback

    if isinstance(exc, errors.RemoteGrainError):
        return {"code": "remote", "type": exc.type_name, "message": exc.message, "tb": exc.traceback_text}
    if isinstance(exc, errors.RedgrainError) and type(exc) in errors.CODE_OF:
        fields = {k: v for k, v in vars(exc).items() if isinstance(v, (str, int, float, list))}
        return {"code": errors.CODE_OF[type(exc)], "message": str(exc), "fields": fields}
    return {
        "code": "remote",
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "tb": format_remote_traceback(exc),
    }


def error_from_body(body: Any) -> errors.RedgrainError:
    if not isinstance(body, dict):
        return errors.CodecError(f"malformed error response: {body!r:.200}")
    code = body.get("code")
    if code == "remote":
        return errors.RemoteGrainError(str(body.get("type")), str(body.get("message")), str(body.get("tb", "")))
    cls = errors.WIRE_CODES.get(str(code))
    if cls is None:
        return errors.RemoteGrainError(str(code), str(body.get("message")))
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(body.get("message", "")))
    for k, v in (body.get("fields") or {}).items():
        setattr(exc, k, v)
    return exc
