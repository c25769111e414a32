"""A grain that takes reminder ticks and stream items behind a call that holds its mailbox
(the silos of these tests run in the test's process and loop: the gate is the test's)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from grains import Grain, subscribes


@subscribes("busy")
class Busy(Grain):
    gate: ClassVar[asyncio.Event | None] = None
    """hold() waits for it; None: does not wait."""
    holding: ClassVar[asyncio.Event | None] = None
    """Set once hold() runs."""

    def __init__(self) -> None:
        self.ticks = 0
        self.items: list[Any] = []

    async def hold(self) -> None:
        if Busy.holding is not None:
            Busy.holding.set()
        if Busy.gate is not None:
            await Busy.gate.wait()

    async def queued(self) -> None:
        """Waits behind hold(): the one queued call that fills a mailbox of max_queue 1."""

    async def receive_reminder(self, name: str) -> None:
        self.ticks += 1

    async def on_stream_item(self, item: Any, token: str) -> None:
        self.items.append(item)

    async def seen(self) -> tuple[int, list[Any]]:
        return self.ticks, list(self.items)
