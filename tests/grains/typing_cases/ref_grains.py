"""Grains the typing cases call, in a module of their own (a plugin must follow them here)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Generic, TypeVar

from pydantic import BaseModel

from grains import Grain, one_way, read_only

T = TypeVar("T")


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
