"""Grains for the messaging tests on the twins: each says where it runs, and ``Gate`` parks a
call until the test opens it, so a test holds calls in flight or queued without sleeping."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from grains import Grain, interleave, one_way, silo_role


class Where(Grain):
    async def where(self) -> str:
        return str(self.silo)

    async def echo(self, value: Any) -> Any:
        return value

    async def keep(self, value: list[int]) -> list[int]:
        """Keeps the list it was given and returns it: a caller that shares it would see changes."""
        self.kept = value
        value.append(len(value))
        return value


class Gate(Grain):
    """``hold(name)`` runs until the test calls ``open(name)`` on the instance."""

    def __init__(self) -> None:
        self.gates: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.started: list[str] = []
        self.cancelled: list[str] = []

    def open(self, *names: str) -> None:
        for name in names:
            self.gates[name].set()

    async def hold(self, name: str) -> str:
        self.started.append(name)
        try:
            await self.gates[name].wait()
        except asyncio.CancelledError:
            self.cancelled.append(name)
            raise
        return f"{name}@{self.silo}"

    async def flow(self, name: str) -> AsyncIterator[str]:
        """Streams ``name`` once the test opens ``name``, then again once it opens ``name+``."""
        self.started.append(name)
        try:
            for gate in (name, f"{name}+"):
                await self.gates[gate].wait()
                yield name
        except (asyncio.CancelledError, GeneratorExit):  # stopped inside an await, or at a yield
            self.cancelled.append(name)
            raise


class Tally(Grain):
    class State(BaseModel):
        value: int = 0

    async def add(self, n: int) -> int:
        self.state.value += n
        await self.write_state()
        return int(self.state.value)

    async def where(self) -> str:
        return str(self.silo)


@silo_role("home")
class SlowStart(Grain):
    """Activates only on a silo with the role ``home``, and takes ``ACTIVATE_S`` of the loop's
    time (a VirtualClock's) to do it, so calls arrive while it activates; it logs what ran."""

    ACTIVATE_S = 4.0

    def __init__(self) -> None:
        self.ran: list[int] = []
        self.activated = False

    async def on_activate(self) -> None:
        await asyncio.sleep(self.ACTIVATE_S)
        self.activated = True

    @interleave
    async def is_activated(self) -> bool:
        return self.activated

    @one_way
    async def put(self, n: int) -> None:
        self.ran.append(n)

    async def add(self, n: int) -> int:
        self.ran.append(n)
        return n

    async def log(self) -> list[int]:
        return list(self.ran)
