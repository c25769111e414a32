"""Grains and observer handlers for the observer tests (tests/silo/test_observers.py).

Silos load this module by import path (``grains=("tests.observer_grains",)``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from grains import Grain, ObserverRef, ObserverSet, one_way
from silo.errors import ObserverGoneError


class Collector:
    """An observer handler: keeps what it is told; a test awaits ``arrived``."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.arrived = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def on_message(self, text: str) -> str:
        self.messages.append(text)
        self.arrived.set()
        return f"got {text}"

    @one_way
    async def on_note(self, text: str) -> str:
        self.messages.append(f"note {text}")
        self.arrived.set()
        return "dropped: nobody waits"

    async def slow(self, seconds: float) -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def append_to(self, items: list[str]) -> list[str]:
        items.append("observer")
        return items

    def sync_helper(self) -> None:
        """Not async: not part of the observer's interface."""


class CallsBack(Collector):
    """A handler that calls the grain notifying it (``room``) from inside the notification."""

    def __init__(self, room: Any) -> None:
        super().__init__()
        self.room = room

    async def on_message(self, text: str) -> str:
        return str(await self.room.size())

    @one_way
    async def on_note(self, text: str) -> str:
        self.messages.append(f"size {await self.room.size()}")
        self.arrived.set()
        return "dropped"


class Room(Grain):
    """Subscribers in an ObserverSet, notified from a later call."""

    def __init__(self) -> None:
        self.members = ObserverSet(expiry_s=60.0)

    async def join(self, obs: ObserverRef) -> int:
        self.members.subscribe(obs)
        return len(self.members)

    async def leave(self, obs: ObserverRef) -> bool:
        return self.members.unsubscribe(obs)

    async def say(self, text: str) -> dict[str, Any]:
        result = await self.members.notify("on_message", text)
        return {
            "delivered": result.delivered,
            "gone": sorted(str(o.observer_id) for o in result.gone),
            "failed": {str(o.observer_id): type(e).__name__ for o, e in result.failed.items()},
        }

    async def note(self, text: str) -> int:
        return (await self.members.notify(lambda o: o.on_note(text))).delivered

    async def members_now(self) -> list[ObserverRef]:
        return list(self.members)

    async def size(self) -> int:
        return len(self.members)

    async def tell(self, obs: ObserverRef, text: str) -> str:
        """One observer, called directly (an ObserverGoneError reaches the caller)."""
        return await obs.on_message(text)  # type: ignore[no-any-return]

    async def forward(self, obs: ObserverRef, room: str) -> int:
        """Hand ``obs`` on to another Room (which its client may never have talked to)."""
        return await self.get_grain(Room, room).join(obs)

    async def say_in(self, room: str, text: str) -> dict[str, Any]:
        return await self.get_grain(Room, room).say(text)

    async def call(self, obs: ObserverRef, method: str) -> Any:
        """Any method by name (a test's forged reference names one the handler lacks)."""
        return await getattr(obs, method)()

    async def tell_slowly(self, obs: ObserverRef, seconds: float, timeout_s: float) -> None:
        await obs.with_timeout(timeout_s).slow(seconds)

    async def is_gone(self, obs: ObserverRef) -> bool:
        try:
            await obs.on_message("ping")
        except ObserverGoneError:
            return True
        return False


class Watcher(Grain):
    """Makes its own observer (``self.observer``) and hands it to a Room on whatever silo."""

    def __init__(self) -> None:
        self.handler = Collector()

    async def watch(self, room: str) -> ObserverRef:
        obs = self.observer(self.handler)
        await self.get_grain(Room, room).join(obs)
        return obs

    async def seen(self) -> list[str]:
        return list(self.handler.messages)
