"""Grains for the catalog tests: each call parks on a gate the test opens, so a test
forces the interleaving it wants without sleeping."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from pydantic import BaseModel

from grains import (
    Grain,
    idle_timeout,
    interleave,
    keep_alive,
    read_only,
    reentrant,
)
from grains.context import TimerHandle
from tests.sample_grains import Lifecycle  # noqa: F401  (re-exported: the suite's activation counter)


class Latch(Grain):
    """``hold(name)`` runs until the test opens gate ``name``; ``log`` records starts and ends."""

    def __init__(self) -> None:
        self.gates: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.log: list[str] = []
        self.running = 0
        self.most_running = 0

    def open(self, *names: str) -> None:
        for name in names:
            self.gates[name].set()

    async def _park(self, name: str) -> str:
        self.log.append(f"start {name}")
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await self.gates[name].wait()
        finally:
            self.running -= 1
        self.log.append(f"end {name}")
        return name

    async def hold(self, name: str) -> str:
        return await self._park(name)

    @read_only
    async def peek(self, name: str) -> str:
        return await self._park(name)

    @interleave
    async def poke(self, name: str) -> str:
        return await self._park(name)

    async def step(self, i: int) -> int:
        """Yields to the loop in the middle, so overlapping turns would show in ``most_running``."""
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        await asyncio.sleep(0)
        self.log.append(str(i))
        self.running -= 1
        return i


@reentrant
class ReentrantLatch(Latch):
    """The same calls, on a class whose turns all interleave."""


class PingPong(Grain):
    """A calls B, B calls back A: a deadlock unless reentrant."""

    async def ping(self, other: str, depth: int) -> int:
        if depth == 0:
            return 0
        return 1 + await self.get_grain(PingPong, other).ping(self.key, depth - 1)

    async def call_self(self) -> int:
        return await self.get_grain(PingPong, self.key).ping("x", 0)


@reentrant
class ReentrantPingPong(Grain):
    async def ping(self, other: str, depth: int) -> int:
        if depth == 0:
            return 0
        return 1 + await self.get_grain(ReentrantPingPong, other).ping(self.key, depth - 1)


@idle_timeout(5.0)
class Brief(Grain):
    async def ping(self) -> str:
        return "pong"


@keep_alive
class Resident(Grain):
    async def ping(self) -> str:
        return "pong"


class Ticker(Grain):
    """Timer callbacks that record the time they ran at, and a turn that can hold them off."""

    def __init__(self) -> None:
        self.ticks: list[float] = []
        self.gate = asyncio.Event()
        self.timer: TimerHandle | None = None

    async def start(self, due_s: float, period_s: float | None, interleave: bool = False) -> None:
        loop = asyncio.get_running_loop()

        async def tick() -> None:
            self.ticks.append(loop.time())

        self.timer = self.register_timer(tick, due_s=due_s, period_s=period_s, interleave=interleave)

    async def stop(self) -> None:
        assert self.timer is not None
        self.timer.cancel()

    async def hold(self) -> None:
        await self.gate.wait()

    @interleave
    async def release(self) -> None:
        self.gate.set()

    @interleave
    async def count(self) -> int:
        return len(self.ticks)


class Counter(Grain):
    class State(BaseModel):
        value: int = 0

    async def add(self, n: int) -> int:
        self.state.value += n
        await self.write_state()
        return self.state.value

    async def get(self) -> int:
        return self.state.value
