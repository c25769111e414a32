"""How an exception crosses the wire: the body of an ERROR frame and back.

redgrain's own errors that have a wire code (``errors.CODE_OF``) keep their
class: the body carries the code, the message and the simple-typed fields, and
the receiver rebuilds the same class without calling its ``__init__`` (whose
signature varies). Any other exception a grain method raised becomes a
:class:`~silo.errors.RemoteGrainError` that names its type and carries its
message, the remote traceback as text, and its ``args`` and attributes when
they are plain values. Nothing is pickled.

So that ``except ValueError:`` does not break when placement moves a grain,
the remote error is *also* an instance of the original class wherever this
side knows that class, as Ray's task errors are: :func:`remote_error` builds
(once per class) ``RemoteGrainError(ValueError)``, a subclass of both, and
fills it with the original ``args``. A class is known when it is a builtin
exception or the codec's registry names it (``TypeRegistry.register_error``,
and every exception class a registered grain class's module defines or
imports); a name the peer sends is only ever looked up there, never imported.
Otherwise the nearest builtin base the sender named is used
(``json.JSONDecodeError`` is still a ``ValueError``), and failing that the
plain ``RemoteGrainError``. The same-silo path goes through the same two
functions (the dispatcher), so a call fails the same way at every distance.
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any

from silo import errors

if TYPE_CHECKING:
    from silo.codec import TypeRegistry

_PLAIN = (str, int, float, bool, bytes, type(None))
_MAX_VALUE = 4096
"""Longest str or bytes argument or attribute an error carries (longer ones stay behind)."""
_OWN = frozenset({"type_name", "message", "traceback_text"})
"""RemoteGrainError's own attributes: never taken from a body's fields."""
_NEVER = (StopIteration, StopAsyncIteration)
"""Raised out of a coroutine these turn into RuntimeError: a remote one is only RemoteGrainError."""
_BUILTIN: dict[str, type[Exception]] = {
    name: cls
    for name, cls in vars(builtins).items()
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _NEVER) and cls is not Exception
}
_BUILTIN_CLASSES = frozenset(_BUILTIN.values())


def error_body(exc: BaseException) -> dict[str, Any]:
    """How an exception crosses the wire: a code for our own, type/message/traceback for the rest."""
    from silo.catalog.pipeline import format_remote_traceback

    if isinstance(exc, errors.RemoteGrainError):
        body: dict[str, Any] = {"code": "remote", "type": exc.type_name, "message": exc.message, "tb": exc.traceback_text}
        origin: type[BaseException] | None = getattr(type(exc), "_rg_origin", None)
        if origin is None:
            return body
    elif isinstance(exc, errors.RedgrainError) and type(exc) in errors.CODE_OF:
        coded = {k: v for k, v in vars(exc).items() if isinstance(v, (str, int, float, list))}
        return {"code": errors.CODE_OF[type(exc)], "message": str(exc), "fields": coded}
    else:
        origin = type(exc)
        body = {
            "code": "remote",
            "type": f"{origin.__module__}.{origin.__qualname__}".removeprefix("builtins."),
            "message": str(exc),
            "tb": format_remote_traceback(exc),
        }
    if exc.args and all(_small(a) for a in exc.args):
        body["args"] = list(exc.args)
    fields = {k: v for k, v in vars(exc).items() if k not in _OWN and _small(v)}
    if fields:
        body["fields"] = fields
    base = next((c for c in origin.__mro__ if c in _BUILTIN_CLASSES), None)
    if base is not None and base.__name__ != body["type"]:
        body["builtin"] = base.__name__  # also when passed on: a JSONDecodeError is still a ValueError
    return body


def _small(value: Any) -> bool:
    # Plain and short: json.JSONDecodeError keeps the whole document it failed on in ``doc``.
    return isinstance(value, _PLAIN) and (not isinstance(value, (str, bytes)) or len(value) <= _MAX_VALUE)


def error_from_body(body: Any, registry: TypeRegistry | None = None) -> errors.RedgrainError:
    """The error an ERROR frame's body stands for (``registry``: the exception classes known here)."""
    if not isinstance(body, dict):
        return errors.CodecError(f"malformed error response: {body!r:.200}")
    code = body.get("code")
    if code == "remote":
        args, fields = body.get("args"), body.get("fields")
        return remote_error(
            str(body.get("type")),
            str(body.get("message")),
            str(body.get("tb", "")),
            args=tuple(args) if isinstance(args, list) else None,
            fields=fields if isinstance(fields, dict) else None,
            builtin=str(body.get("builtin") or ""),
            registry=registry,
        )
    cls = errors.WIRE_CODES.get(str(code))
    if cls is None:
        return errors.RemoteGrainError(str(code), str(body.get("message")))
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(body.get("message", "")))
    for k, v in (body.get("fields") or {}).items():
        setattr(exc, k, v)
    return exc


def as_remote(exc: BaseException, registry: TypeRegistry | None = None) -> BaseException:
    """What a caller on another silo would get for ``exc``, for a caller on the callee's own silo:
    the exception itself when it crosses as itself, else its RemoteGrainError (a copy: the caller
    never holds the callee's exception, its frames or its attributes)."""
    if not isinstance(exc, Exception) or isinstance(exc, errors.RemoteGrainError) or type(exc) in errors.CODE_OF:
        return exc
    return error_from_body(error_body(exc), registry)


def remote_error(
    type_name: str,
    message: str,
    traceback_text: str = "",
    *,
    args: tuple[Any, ...] | None = None,
    fields: dict[str, Any] | None = None,
    builtin: str = "",
    registry: TypeRegistry | None = None,
) -> errors.RemoteGrainError:
    """A RemoteGrainError that is also an instance of the class ``type_name`` names, when known
    here (else of its nearest builtin base ``builtin``; else neither)."""
    known = _BUILTIN.get(type_name) if "." not in type_name else None
    if known is None and registry is not None:
        known = registry.error_class(type_name)
    if known is None:
        known = _BUILTIN.get(builtin)
    # The class itself, then its builtin bases: a class whose instances cannot be made from
    # these args (UnicodeDecodeError wants five) is still caught as the base it has.
    for cls in [] if known is None else [c for c in known.__mro__ if c is known or c in _BUILTIN_CLASSES]:
        exc = _instance(cls, message, args)
        if exc is not None:
            break
    else:
        return errors.RemoteGrainError(type_name, message, traceback_text)
    exc.type_name, exc.message, exc.traceback_text = type_name, message, traceback_text
    for k, v in (fields or {}).items():
        if isinstance(k, str) and k not in _OWN and not k.startswith("__"):
            try:
                setattr(exc, k, v)
            except (AttributeError, TypeError):  # a read-only attribute of a builtin: keep its own
                pass
    return exc


def _instance(cls: type[Exception], message: str, args: tuple[Any, ...] | None) -> errors.RemoteGrainError | None:
    """An instance of ``RemoteGrainError(cls)`` carrying ``args``, without calling any ``__init__``
    but a builtin one (a user class's ``__init__`` may want other arguments); None if it cannot be."""
    dual = _remote_class(cls)
    if dual is None:
        return None
    values = args if args is not None else (message,)
    try:
        exc: errors.RemoteGrainError = dual.__new__(dual, *values)
        (cls.__init__ if cls in _BUILTIN_CLASSES else BaseException.__init__)(exc, *values)
    except Exception:  # noqa: BLE001 - args this class refuses: try its builtin base
        return None
    return exc


_REMOTE_CLASSES: dict[type, type[errors.RemoteGrainError] | None] = {}
"""``RemoteGrainError(cls)`` by ``cls``: a memo, bounded by the classes known by name."""


def _remote_class(cls: type[Exception]) -> type[errors.RemoteGrainError] | None:
    """``RemoteGrainError(cls)``, made once per class."""
    try:
        return _REMOTE_CLASSES[cls]
    except KeyError:
        made = _REMOTE_CLASSES[cls] = _make_remote_class(cls)
        return made


def _make_remote_class(cls: type[Exception]) -> type[errors.RemoteGrainError] | None:
    if issubclass(cls, (errors.RemoteGrainError, *_NEVER)):
        return None
    if type(cls) is not type or any(
        "__new__" in vars(c) or "__init_subclass__" in vars(c) for c in cls.__mro__ if c.__module__ != "builtins"
    ):
        return None  # a metaclass, __new__ or __init_subclass__ of its own: user code run on a peer's say-so
    try:
        return type(
            f"RemoteGrainError({cls.__name__})",
            (errors.RemoteGrainError, cls),
            {"__module__": errors.__name__, "__slots__": (), "_rg_origin": cls},
        )
    except TypeError:  # an instance layout RemoteGrainError cannot share
        return None
