"""Observers: a local object made callable by reference, and the set a grain notifies.

Orleans' ``IGrainObserver`` and ``ObserverManager``, for Python::

    class Printer:                      # a plain object: its public async methods are the interface
        async def on_message(self, text: str) -> None:
            print(text)

    obs = await client.observer(Printer())          # or self.observer(handler) inside a grain
    await client.get_grain(Room, "r").join(obs)     # a reference travels like a GrainId

    class Room(Grain):
        def __init__(self) -> None:
            self.members = ObserverSet(expiry_s=60)

        async def join(self, obs: ObserverRef) -> None:
            self.members.subscribe(obs)             # re-subscribing renews the entry

        async def say(self, text: str) -> None:
            await self.members.notify("on_message", text)

A call to an observer goes to the process that made it and runs the handler's
method there (the runtime decides how it gets there: ``silo/messaging/observer_hub.py``).
It honours the reference's deadline (``obs.with_timeout(s)``); a handler method
marked ``@one_way`` is sent without waiting. When the observer can never answer
again (its client closed or died, it was disposed) the call raises the runtime's
``ObserverGoneError``, and :meth:`ObserverSet.notify` drops it from the set.

This module is the programming model's half: it knows nothing of connections.
A reference calls through an :class:`ObserverCaller` the runtime gives it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

from grains.immutable import MARK

__all__ = ["NotifyResult", "ObserverCaller", "ObserverId", "ObserverRef", "ObserverSet", "observer_interface"]

log = logging.getLogger("redgrain.observer")

_REF_API = frozenset({"dispose", "with_timeout", "observer_id", "methods", "one_way_methods", "gateways", "timeout_s"})
"""Names an observer reference has for itself: a handler method may not take them."""

CLIENT_PREFIX = "client:"


@dataclass(frozen=True, slots=True)
class ObserverId:
    """Who made the observer (``owner``: ``client:<id>`` or a silo's ``host:port@generation``)
    and which one of its observers it is."""

    owner: str
    local_id: str

    def __str__(self) -> str:
        return f"{self.owner}/{self.local_id}"

    @classmethod
    def parse(cls, text: str) -> ObserverId:
        owner, sep, local_id = text.rpartition("/")
        if not sep or not owner or not local_id:
            raise ValueError(f"not an observer id: {text!r}")
        return cls(owner, local_id)

    @property
    def client(self) -> str | None:
        """The client's id when a client made it (None: a silo did)."""
        return self.owner[len(CLIENT_PREFIX) :] if self.owner.startswith(CLIENT_PREFIX) else None


class ObserverCaller(Protocol):
    """What a reference sends its calls through (the runtime of the process holding it)."""

    async def invoke_observer(
        self, ref: ObserverRef, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None, one_way: bool
    ) -> Any: ...

    async def dispose_observer(self, ref: ObserverRef) -> None: ...

    def is_gone(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the observer can never answer again (the runtime's ObserverGoneError)."""
        ...


def observer_interface(handler: object) -> tuple[frozenset[str], frozenset[str]]:
    """The handler's public async methods, and those of them marked ``@one_way``."""
    if isinstance(handler, type):
        raise TypeError(f"an observer wraps an object, not the class {handler.__qualname__}: pass an instance")
    cls = type(handler)
    names = frozenset(
        n for n in dir(cls) if not n.startswith("_") and inspect.iscoroutinefunction(getattr(cls, n, None))
    )
    if not names:
        raise TypeError(f"{cls.__qualname__} has no public async method: nothing could call it as an observer")
    clash = names & _REF_API
    if clash:
        raise TypeError(f"{cls.__qualname__} has methods an observer reference keeps for itself: {sorted(clash)}")
    return names, frozenset(n for n in names if getattr(getattr(cls, n), "__rg_one_way__", False))


class ObserverRef:
    """A reference to an observer: cheap, comparable by id, passed to grains as an argument.

    Its methods are the handler's public async methods; any other name is an
    AttributeError at the call site. Made by ``client.observer(handler)`` or
    ``self.observer(handler)``, or rebuilt by the codec where a call brings one.
    """

    __slots__ = ("_caller", "_gateways", "_id", "_methods", "_one_way", "_timeout_s")

    def __init__(
        self,
        caller: ObserverCaller,
        observer_id: ObserverId,
        methods: frozenset[str],
        one_way: frozenset[str] = frozenset(),
        gateways: tuple[str, ...] = (),
        timeout_s: float | None = None,
    ) -> None:
        self._caller = caller
        self._id = observer_id
        self._methods = methods
        self._one_way = one_way
        self._gateways = gateways
        self._timeout_s = timeout_s

    @property
    def observer_id(self) -> ObserverId:
        return self._id

    @property
    def methods(self) -> frozenset[str]:
        return self._methods

    @property
    def one_way_methods(self) -> frozenset[str]:
        return self._one_way

    @property
    def gateways(self) -> tuple[str, ...]:
        """Silos (``host:port``) the client had connections to when the reference left it: where a
        silo without a connection of its own from that client relays a call."""
        return self._gateways

    @property
    def timeout_s(self) -> float | None:
        return self._timeout_s

    def with_timeout(self, timeout_s: float) -> Self:
        """The same reference with another call deadline."""
        return type(self)(self._caller, self._id, self._methods, self._one_way, self._gateways, timeout_s)

    async def dispose(self) -> None:
        """Stop taking calls (only where it was made): later calls raise ObserverGoneError."""
        await self._caller.dispose_observer(self)

    def __getattr__(self, name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        if name.startswith("_"):  # an unset slot (a half-built copy): never a remote name
            raise AttributeError(name)
        if name not in self._methods:
            raise AttributeError(
                f"observer {self._id} has no public async method {name!r} (it has {', '.join(sorted(self._methods))})"
            )
        one_way = name in self._one_way

        def call(*args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
            return self._caller.invoke_observer(self, name, args, kwargs or None, one_way)

        call.__name__ = call.__qualname__ = name
        return call

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObserverRef) and other._id == self._id

    def __hash__(self) -> int:
        return hash(self._id)

    def __repr__(self) -> str:
        return f"<ObserverRef {self._id}>"


# A reference is a value nobody changes: a call on the caller's own silo passes it as it is.
setattr(ObserverRef, MARK, True)


@dataclass(frozen=True, slots=True)
class NotifyResult:
    """What one :meth:`ObserverSet.notify` did."""

    delivered: int
    """Observers whose call returned."""
    gone: list[ObserverRef] = field(default_factory=list)
    """Observers found gone (ObserverGoneError): dropped from the set."""
    failed: dict[ObserverRef, BaseException] = field(default_factory=dict)
    """Observers whose call failed otherwise (raised, timed out): kept until they expire."""


class ObserverSet:
    """Subscribed observers, each until it is unsubscribed, found gone, or not renewed in time.

    ``expiry_s`` (None: never): an entry not subscribed again within that long is
    dropped, as Orleans' ObserverManager drops one past its expiration; clients
    re-subscribe periodically to stay in. Expired entries are dropped lazily, on
    :meth:`notify`, ``len``, iteration and :meth:`expire`, so the set needs no
    timer. ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, *, expiry_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if expiry_s is not None and not expiry_s > 0:
            raise ValueError(f"expiry_s must be a positive number of seconds or None, not {expiry_s!r}")
        self.expiry_s = expiry_s
        self._clock = clock
        self._renewed: dict[ObserverRef, float] = {}

    def subscribe(self, observer: ObserverRef) -> None:
        """Add ``observer``, or renew it (its expiry counts from now; the newest reference is kept)."""
        if not isinstance(observer, ObserverRef):
            raise TypeError(f"subscribe wants an ObserverRef (from client.observer / self.observer), not {observer!r}")
        self._renewed.pop(observer, None)  # the newer reference (another timeout) replaces the old
        self._renewed[observer] = self._clock()

    def unsubscribe(self, observer: ObserverRef) -> bool:
        """Remove ``observer``; False when it was not subscribed."""
        return self._renewed.pop(observer, None) is not None

    def expire(self) -> list[ObserverRef]:
        """Drop the entries not renewed within ``expiry_s``; the dropped ones."""
        if self.expiry_s is None:
            return []
        cutoff = self._clock() - self.expiry_s
        old = [o for o, at in self._renewed.items() if at <= cutoff]
        for o in old:
            del self._renewed[o]
        return old

    def __len__(self) -> int:
        self.expire()
        return len(self._renewed)

    def __iter__(self) -> Iterator[ObserverRef]:
        self.expire()
        return iter(list(self._renewed))

    def __contains__(self, observer: object) -> bool:
        self.expire()
        return observer in self._renewed

    async def notify(
        self, method: str | Callable[[ObserverRef], Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> NotifyResult:
        """Call every observer at once: ``method`` by name with ``args``, or ``method(observer)``.

        One failure stops none of the others. An observer that is gone is dropped
        (and listed in the result); any other failure is logged and kept in the
        result, and the entry stays until it expires.
        """
        if not isinstance(method, str) and (args or kwargs):
            raise TypeError("notify(callable) takes no further arguments: the callable gets each observer")
        targets = list(self)

        async def call(obs: ObserverRef) -> Any:
            # Inside the coroutine: an observer without the method fails alone (AttributeError).
            if isinstance(method, str):
                return await getattr(obs, method)(*args, **kwargs)
            return await method(obs)

        results = await asyncio.gather(*(call(o) for o in targets), return_exceptions=True)
        gone: list[ObserverRef] = []
        failed: dict[ObserverRef, BaseException] = {}
        for obs, res in zip(targets, results, strict=True):
            if not isinstance(res, BaseException):
                continue
            if isinstance(res, asyncio.CancelledError):
                raise res
            if obs._caller.is_gone(res):
                gone.append(obs)
                self._renewed.pop(obs, None)
            else:
                failed[obs] = res
                log.warning("notifying observer %s failed: %s: %s", obs.observer_id, type(res).__name__, res)
        return NotifyResult(len(targets) - len(gone) - len(failed), gone, failed)
