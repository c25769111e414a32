"""Grains the typing cases call, in a module of their own (a plugin must follow them here)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Generic, ParamSpec, TypeVar

from pydantic import BaseModel

from grains import Grain, one_way, read_only

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])


def logged(fn: Callable[P, R]) -> Callable[P, R]:
    """A plain def wrapper: around an async def it returns the coroutine unawaited, so the
    method is a plain function (inspect.iscoroutinefunction is False): not remote."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        return fn(*args, **kwargs)

    return wrapper


def timed(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """An async def wrapper: the method stays remote."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        return await fn(*args, **kwargs)

    return wrapper


def relayed(fn: Callable[P, AsyncIterator[T]]) -> Callable[P, AsyncIterator[T]]:
    """An async generator wrapper: the method still streams."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        async for item in fn(*args, **kwargs):
            yield item

    return wrapper


def tagged(label: str) -> Callable[[F], F]:
    """A decorator factory that hands back the method itself: it stays what it was."""

    def mark(fn: F) -> F:
        fn.__label__ = label  # type: ignore[attr-defined]
        return fn

    return mark


class Counter(Grain):
    class State(BaseModel):
        value: int = 0

    async def add(self, n: int, *, note: str = "") -> int:
        self.state.value += n
        await self.write_state()
        return int(self.state.value)

    @read_only
    async def total(self) -> int:
        return int(self.state.value)

    @property
    def label(self) -> str:
        """A property: not remote."""
        return self.key

    def peek(self) -> int:
        """Sync: not remote."""
        return int(self.state.value)

    async def _recount(self) -> None:
        """Private: not remote."""

    @one_way
    async def touch(self, who: str) -> int:
        """One-way: the caller's await gets None, whatever this returns."""
        return len(who)


class LoudCounter(Counter):
    async def shout(self) -> str:
        return str(await self.add(1)).upper()


class Box(Grain, Generic[T]):
    """A generic grain: a reference to ``Box[int]`` returns ints."""

    async def get(self, default: T) -> T:
        return default


class Tokens(Grain):
    """Streams its results: a reference's call is iterated, not awaited."""

    async def generate(self, prompt: str, *, limit: int = 3) -> AsyncIterator[str]:
        for word in prompt.split()[:limit]:
            yield word


class NotAGrain:
    async def add(self, n: int) -> int:
        return n


class Decorated(Grain):
    """Methods behind decorators: remote exactly when the decorated method is still async."""

    @logged
    async def hidden(self, n: int) -> int:
        return n

    @logged
    @timed
    async def rewrapped(self, n: int) -> int:
        return n

    @timed
    async def timed_add(self, n: int) -> int:
        return n + 1

    @tagged("x")
    @one_way
    async def tagged_touch(self, who: str) -> int:
        return len(who)

    @relayed
    async def words(self, text: str) -> AsyncIterator[str]:
        for word in text.split():
            yield word
