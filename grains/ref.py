"""Grain references: proxies whose awaitable methods are exactly the grain's.

A reference class is generated once per grain class. It has one method per
public ``async def`` of the grain, so a typo is an ``AttributeError`` at the
call site, never a remote surprise. Each call becomes one
:class:`~grains.call.Call` value, sent through a :class:`Caller` (the client's
or the silo's router).

Statically, ``get_grain(Counter, key)`` is a :class:`Ref` ``[Counter]``; the mypy plugin in
grains/mypy_plugin.py gives it exactly the methods :func:`public_methods` picks, with their
signatures. A by-name reference (``get_grain("Counter", key)``) is a plain :class:`GrainRef`:
the type is not known before run time, so any attribute is an awaitable returning ``Any``.
At run time it has the methods its caller knew of the type when it was made, and any other
public name is looked up when it is called (:func:`build_by_name_ref_class`): a type or a
version published after the reference was made is found then, not refused for good.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

from grains.call import CALL_CHAIN, UNREAD, Call
from grains.ids import GrainId
from grains.result_stream import ResultStream, StreamChannel

if TYPE_CHECKING:
    from grains.base import Grain

# Covariant: a reference to a subclass has every remote method of its base class.
G_co = TypeVar("G_co", bound="Grain", covariant=True)
GrainT = TypeVar("GrainT", bound="Grain")

# Methods of the base class that are lifecycle hooks or helpers, never remote.
_NOT_REMOTE = frozenset({"on_activate", "on_deactivate", "receive_reminder"})


class Caller(Protocol):
    """What a reference sends its calls through."""

    async def invoke(self, call: Call, one_way: bool = False, stream: StreamChannel | None = None) -> Any:
        """Deliver ``call`` and return its result; with ``one_way``, return once it is sent; with
        ``stream`` (a call of an async-generator method), return once it has its first item or
        its end, which go to ``stream`` (grains/result_stream.py), as do the later ones.

        A reference's call has ``chain`` UNREAD: read it when the call starts, in the task it runs
        in (``grains.call.started(call)``), before anything looks at it."""
        ...


def never_remote(name: str) -> bool:
    """Names a reference never has: private ones, lifecycle hooks and ``Grain``'s own members
    (``write_state``, ``state``, ``get_grain``, ...), even where a subclass overrides them.
    The mypy plugin asks the same question, so the static and the run-time interface agree."""
    return name.startswith("_") or name in _NOT_REMOTE or name in _grain_members()


@functools.cache
def _grain_members() -> frozenset[str]:
    from grains.base import Grain

    return frozenset(dir(Grain))


def public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The grain's remote interface: public coroutine functions and async generator functions
    (streamed results, :func:`stream_methods`) not from ``Grain`` itself."""
    out: dict[str, Callable[..., Any]] = {}
    for name in dir(cls):
        if never_remote(name):
            continue
        fn = getattr(cls, name, None)
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            out[name] = fn
    return out


def why_not_remote(cls: type, name: str) -> str:
    """Why a reference to a grain of ``cls`` has no attribute ``name``, in the words the mypy
    plugin uses: "" when the class has no such attribute either."""
    if name.startswith("_"):
        return "private: only public async methods are remote"
    if never_remote(name):
        return "a Grain helper or lifecycle hook, not a remote method"
    fn = getattr(cls, name, _MISSING)
    if fn is _MISSING:
        return ""
    inner = inspect.unwrap(fn) if callable(fn) else fn
    if inner is not fn and (inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner)):
        # An async def behind a plain def wrapper (functools.wraps kept the way to it): calling
        # it makes a coroutine, but the method is no coroutine function, so it is not remote.
        code = getattr(fn, "__code__", None)
        where = getattr(code, "co_qualname", "").partition(".<locals>")
        made = f'decorator "{where[0]}"' if where[1] else "a decorator"
        return f"not an async method: {made} makes it a plain function; only public async methods are remote"
    return "not an async method: only public async methods are remote"


_MISSING = object()


def stream_methods(cls: type) -> frozenset[str]:
    """The remote methods written as async generators: a reference's call of one is iterated
    (``async for``), not awaited (grains/result_stream.py)."""
    return frozenset(name for name, fn in public_methods(cls).items() if inspect.isasyncgenfunction(fn))


class GrainRef:
    """Base of generated reference classes. Cheap, comparable, valid forever."""

    __slots__ = ("_caller", "_grain_id", "_timeout_s")
    _methods: frozenset[str] = frozenset()

    def __init__(self, caller: Caller, grain_id: GrainId, timeout_s: float | None = None) -> None:
        self._caller = caller
        self._grain_id = grain_id
        self._timeout_s = timeout_s

    @property
    def grain_id(self) -> GrainId:
        return self._grain_id

    @property
    def key(self) -> str:
        return self._grain_id.key

    def with_timeout(self, timeout_s: float) -> Self:
        """The same reference with another call deadline."""
        ref = type(self)(self._caller, self._grain_id, timeout_s)  # type: ignore[attr-defined]
        return ref

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GrainRef) and other._grain_id == self._grain_id

    def __hash__(self) -> int:
        return hash(self._grain_id)

    def __repr__(self) -> str:
        return f"<GrainRef {self._grain_id}>"

    if TYPE_CHECKING:
        # A by-name reference's methods are known only at run time (from the silos' manifest).
        def __getattr__(self, name: str) -> Callable[..., Coroutine[Any, Any, Any]]: ...


class Ref(GrainRef, Generic[G_co]):
    """A reference to a grain of class ``G``: what ``get_grain(G, key)`` returns.

    Every generated reference class derives from it. For mypy with ``grains.mypy_plugin``
    it has exactly ``G``'s public ``async def`` methods, each taking the same arguments and
    returning an awaitable of the same result, plus ``with_timeout``, ``grain_id`` and ``key``;
    without the plugin any attribute is accepted, as on :class:`GrainRef`.
    """

    __slots__ = ()

    if TYPE_CHECKING:
        # Only here for the plugin's attribute hook (grains.ref.Ref.<name>), which answers
        # with G's method or an error.
        def __getattr__(self, name: str) -> Callable[..., Coroutine[Any, Any, Any]]: ...


_chain = CALL_CHAIN.get
_new_call = tuple.__new__


def _remote_method(name: str, doc: str | None, one_way: bool = False, stream: bool = False) -> Callable[..., Any]:
    # Plain functions returning the caller's coroutine: no coroutine frame of their own. The
    # chain is left UNREAD, and the caller reads it when its invoke starts, in the task that runs
    # the call (grains.call.started): ``self.start_task(ref.m())`` makes the coroutine inside a
    # turn, but it runs outside the turn, so it must not carry the turn's chain (a call back
    # into this grain would be refused as a deadlock while nothing waits). The Call is built
    # with tuple.__new__ and all seven fields: 0.13 µs, where Call(...) goes through
    # NamedTuple's Python-level __new__ (0.24 µs).
    def call(self: GrainRef, *args: Any, **kwargs: Any) -> Any:
        return self._caller.invoke(_new_call(Call, (self._grain_id, name, args, kwargs or None, self._timeout_s, UNREAD, 0)))

    def send(self: GrainRef, *args: Any, **kwargs: Any) -> Any:
        return self._caller.invoke(
            _new_call(Call, (self._grain_id, name, args, kwargs or None, self._timeout_s, UNREAD, 0)), True
        )

    def iterate(self: GrainRef, *args: Any, **kwargs: Any) -> ResultStream[Any]:
        # A plain function: ``async for`` needs the iterator itself, not an awaitable of it. The
        # chain is read now, in the task that will iterate it (a stream is not handed to start_task).
        return ResultStream(
            self._caller, _new_call(Call, (self._grain_id, name, args, kwargs or None, self._timeout_s, _chain(), 0))
        )

    if one_way:
        call = send
    elif stream:
        call = iterate  # type: ignore[assignment]

    call.__name__ = call.__qualname__ = name
    call.__doc__ = doc
    return call


def build_ref_class(
    type_name: str,
    methods: Iterable[str],
    docs: dict[str, str | None] | None = None,
    one_way: Iterable[str] = (),
    streams: Iterable[str] = (),
    grain: type | None = None,
) -> type[Ref[Any]]:
    """The reference class of a grain type with these remote ``methods``; with its ``grain``
    class, a name it lacks is refused saying why (:func:`why_not_remote`)."""
    names = sorted(methods)
    sent, streamed = frozenset(one_way), frozenset(streams)
    ns: dict[str, Any] = {"__slots__": (), "_methods": frozenset(names)}
    for name in names:
        ns[name] = _remote_method(name, (docs or {}).get(name), name in sent, name in streamed)
    if grain is not None:
        ns["__getattr__"] = _not_remote(grain)
    return type(f"{type_name}Ref", (Ref,), ns)


def _not_remote(grain: type) -> Callable[[GrainRef, str], Any]:
    # Only reached when ordinary lookup failed, so the remote methods cost nothing more.
    def __getattr__(self: GrainRef, name: str) -> Any:
        reason = why_not_remote(grain, name)
        detail = f" ({reason})" if reason else ""
        raise AttributeError(f'Reference to "{grain.__name__}" has no attribute "{name}"{detail}', name=name, obj=self)

    return __getattr__


Resolver = Callable[[str, str], Awaitable[bool]]
"""``resolve(type_name, method)``: whether ``method`` is one-way, once some version of the type
has it (the caller's manifests, read again if need be); raises UnknownGrainError or
UnknownMethodError when none has."""


def _late_method(name: str, resolve: Resolver) -> Callable[..., Any]:
    async def call(self: GrainRef, *args: Any, **kwargs: Any) -> Any:
        one_way = await resolve(self._grain_id.type_name, name)
        # Already in the task that runs the call (this frame awaited the resolve): read it now.
        return await self._caller.invoke(
            _new_call(Call, (self._grain_id, name, args, kwargs or None, self._timeout_s, _chain(), 0)), one_way
        )

    call.__name__ = call.__qualname__ = name
    return call


def build_by_name_ref_class(
    type_name: str, methods: Iterable[str], one_way: Iterable[str], resolve: Resolver, streams: Iterable[str] = ()
) -> type[Ref[Any]]:
    """The reference class of a type known only by name: ``methods`` as :func:`build_ref_class`
    makes them (what the caller knows now), and any other public name a method that asks
    ``resolve`` when called (a type or version published since; an unknown one fails then,
    with UnknownGrainError or UnknownMethodError, as a call of a known method would). A name
    looked up late is called as a plain call: an async-generator method published after the
    reference was made streams through a reference made again."""
    base = build_ref_class(type_name, methods, one_way=one_way, streams=streams)
    late: dict[str, Callable[..., Any]] = {}

    def __getattr__(self: GrainRef, name: str) -> Any:
        if never_remote(name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        fn = late.get(name)
        if fn is None:
            fn = late[name] = _late_method(name, resolve)
        return fn.__get__(self, type(self))

    return type(base.__name__, (base,), {"__slots__": (), "__getattr__": __getattr__})


def ref_class_for(cls: type[GrainT]) -> type[Ref[GrainT]]:
    """The reference class of a grain class, generated once and kept on the class."""
    cached = cls.__dict__.get("__rg_ref_class__")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    from grains.placement import grain_options

    methods = public_methods(cls)
    opts = grain_options(cls)
    ref_cls = build_ref_class(
        opts.type_name, methods, {n: f.__doc__ for n, f in methods.items()}, opts.one_way, stream_methods(cls), cls
    )
    type.__setattr__(cls, "__rg_ref_class__", ref_cls)
    return ref_cls
