"""Markers users put on grain classes and methods.

Each decorator only records a choice on the class or function; the runtime
reads them once, through :func:`grain_options`, when a silo or client first
sees the class.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T", bound=type)
F = TypeVar("F", bound=Callable[..., Any])

PlacementStrategy = Literal[
    "random", "prefer_local", "hash", "activation_count", "resource", "silo_role", "stateless_worker"
]
DEFAULT_PLACEMENT: PlacementStrategy = "resource"


@dataclass(frozen=True, slots=True)
class Placement:
    strategy: PlacementStrategy = DEFAULT_PLACEMENT
    role: str | None = None


@dataclass(frozen=True, slots=True)
class GrainOptions:
    """What the markers on one grain class say, read once per class."""

    type_name: str
    placement: Placement = Placement()
    reentrant: bool = False
    stateless_worker: int = 0
    """Largest local pool of a stateless worker; 0 for an ordinary grain."""
    keep_alive: bool = False
    immovable: bool = False
    idle_timeout_s: float | None = None
    deactivate_on: tuple[type[BaseException], ...] = ()
    write_behind_ms: float | None = None
    interleave: frozenset[str] = field(default_factory=frozenset)
    read_only: frozenset[str] = field(default_factory=frozenset)
    one_way: frozenset[str] = field(default_factory=frozenset)
    storage: str | None = None
    """Storage provider of the class's states (``@storage``); None: the silo's default."""
    incoming_filters: tuple[Callable[..., Any], ...] = ()
    """Call filters around calls to this class only, inside the silo's (``@incoming_filter``)."""
    outgoing_filters: tuple[Callable[..., Any], ...] = ()
    """Call filters on calls this class's grains make, before the silo's (``@outgoing_filter``)."""
    version: int = 1
    """The class's ``@version(n)``: its method list is published per (type, version)."""


def _set(attr: str, value: object) -> Callable[[T], T]:
    def mark(cls: T) -> T:
        setattr(cls, attr, value)
        return cls

    return mark


def grain_type(name: str) -> Callable[[T], T]:
    """Give a grain class a wire name other than its class name."""
    if not name or "/" in name:
        raise ValueError(f"grain type name must be non-empty and contain no '/': {name!r}")
    return _set("__rg_type_name__", name)


def version(n: int) -> Callable[[T], T]:
    """This class is version ``n`` of its grain type (undecorated: 1).

    Bump it whenever the public methods change, so silos of two versions can run side
    by side in a rolling upgrade: each publishes its own method list, and a call goes to
    an activation whose version has the method (docs/concepts.md, Versions).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a grain version is an int >= 1, not {n!r}")
    return _set("__rg_version__", n)


def reentrant(cls: T) -> T:
    """Calls to this grain may interleave at every await."""
    return _set("__rg_reentrant__", True)(cls)


def stateless_worker(max_local: int = 1) -> Callable[[T], T]:
    """No directory entry; up to ``max_local`` activations on each silo, picked locally."""
    if max_local < 1:
        raise ValueError("max_local must be at least 1")
    return _set("__rg_stateless_worker__", max_local)


def keep_alive(cls: T) -> T:
    """Never collected when idle, and re-activated proactively after its silo dies."""
    return _set("__rg_keep_alive__", True)(cls)


def immovable(cls: T) -> T:
    """The rebalancer never moves this grain."""
    return _set("__rg_immovable__", True)(cls)


def idle_timeout(seconds: float) -> Callable[[T], T]:
    """Collect activations of this type after ``seconds`` without a call."""
    if seconds <= 0:
        raise ValueError("idle timeout must be positive")
    return _set("__rg_idle_timeout_s__", float(seconds))


def deactivate_on(*exc_types: type[BaseException]) -> Callable[[T], T]:
    """An exception of these types escaping a method deactivates the activation."""
    return _set("__rg_deactivate_on__", tuple(exc_types))


def write_behind(interval_ms: float) -> Callable[[T], T]:
    """Coalesce ``write_state`` calls of this type into one write every ``interval_ms``."""
    if interval_ms <= 0:
        raise ValueError("write-behind interval must be positive")
    return _set("__rg_write_behind_ms__", float(interval_ms))


def storage(provider: str) -> Callable[[T], T]:
    """Keep this grain's states with the storage provider ``provider`` (a name the silo's
    ``storage.providers`` setting defines, or "redis"); a silo without it refuses to start."""
    if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", provider):
        raise ValueError(f"storage provider name must match [A-Za-z0-9_.-]{{1,64}}: {provider!r}")
    return _set("__rg_storage__", provider)


def incoming_filter(*filters: Callable[..., Any]) -> Callable[[T], T]:
    """Run these call filters (``async def f(ctx, call_next)``) around every call to this grain
    class, inside the silo's own filters, in the order given (the first is outermost)."""
    return _filters("__rg_incoming_filters__", filters)


def outgoing_filter(*filters: Callable[..., Any]) -> Callable[[T], T]:
    """Run these call filters (``async def f(ctx, call_next)``) on every call a grain of this
    class makes, before the silo's outgoing filters, in the order given (the first runs first)."""
    return _filters("__rg_outgoing_filters__", filters)


def _filters(attr: str, filters: tuple[Callable[..., Any], ...]) -> Callable[[T], T]:
    if not filters or not all(callable(f) for f in filters):
        raise ValueError("give one or more call filters: async def f(ctx, call_next)")

    def mark(cls: T) -> T:
        # The class's own list, after what a base class declared.
        setattr(cls, attr, (*getattr(cls, attr, ()), *filters))
        return cls

    return mark


def _placement(strategy: PlacementStrategy, role: str | None = None) -> Callable[[T], T]:
    return _set("__rg_placement__", Placement(strategy, role))


random_placement = _placement("random")
prefer_local = _placement("prefer_local")
hash_placement = _placement("hash")
activation_count_placement = _placement("activation_count")
resource_placement = _placement("resource")


def silo_role(role: str) -> Callable[[T], T]:
    """Place activations only on silos started with this role."""
    return _placement("silo_role", role)


def interleave(fn: F) -> F:
    """This method may run while another call to the same activation is waiting."""
    fn.__rg_interleave__ = True  # type: ignore[attr-defined]
    return fn


def read_only(fn: F) -> F:
    """This method may interleave with other read-only calls."""
    fn.__rg_read_only__ = True  # type: ignore[attr-defined]
    return fn


def one_way(fn: F) -> F:
    """Calls to this method are sent, not awaited: the caller's ``await`` returns once the
    message is on its way (or queued, on the same silo), with None. Whatever the method returns
    is dropped; an error it raises is logged and counted on the callee's silo
    (``one_way_failed``), never raised to the caller. Delivery is retried until the call's
    deadline as for any call: a caller that cannot reach any silo still gets the error. One
    caller's calls to a grain run in the order sent; past a full mailbox a one-way call waits
    (in order, within a bound) instead of being shed. It runs at most once: not at-least-once
    (docs/concepts.md, One-way calls)."""
    if inspect.isasyncgenfunction(fn):
        raise TypeError(f"@one_way on {fn.__qualname__}: an async generator streams its results to its caller")
    fn.__rg_one_way__ = True  # type: ignore[attr-defined]
    return fn


def grain_options(cls: type) -> GrainOptions:
    """Read the markers of a grain class (cached on the class itself)."""
    cached = cls.__dict__.get("__rg_options__")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    from grains.ref import public_methods

    methods = public_methods(cls)
    sw = int(getattr(cls, "__rg_stateless_worker__", 0))
    placement = getattr(cls, "__rg_placement__", None) or (
        Placement("stateless_worker") if sw else Placement()
    )
    opts = GrainOptions(
        type_name=cls.__dict__.get("__rg_type_name__") or cls.__name__,
        placement=placement,
        reentrant=bool(getattr(cls, "__rg_reentrant__", False)),
        stateless_worker=sw,
        keep_alive=bool(getattr(cls, "__rg_keep_alive__", False)),
        immovable=bool(getattr(cls, "__rg_immovable__", False)),
        idle_timeout_s=getattr(cls, "__rg_idle_timeout_s__", None),
        deactivate_on=tuple(getattr(cls, "__rg_deactivate_on__", ())),
        write_behind_ms=getattr(cls, "__rg_write_behind_ms__", None),
        interleave=frozenset(n for n, f in methods.items() if getattr(f, "__rg_interleave__", False)),
        read_only=frozenset(n for n, f in methods.items() if getattr(f, "__rg_read_only__", False)),
        one_way=frozenset(n for n, f in methods.items() if getattr(f, "__rg_one_way__", False)),
        storage=getattr(cls, "__rg_storage__", None),
        incoming_filters=tuple(getattr(cls, "__rg_incoming_filters__", ())),
        outgoing_filters=tuple(getattr(cls, "__rg_outgoing_filters__", ())),
        version=int(getattr(cls, "__rg_version__", 1)),
    )
    type.__setattr__(cls, "__rg_options__", opts)
    return opts
