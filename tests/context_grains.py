"""Grains that report the request context their turns see (tests/silo/test_request_context.py)."""

from __future__ import annotations

from typing import Any

from grains import Grain, RequestContext, one_way, subscribes


class ContextReader(Grain):
    def __init__(self) -> None:
        self.notes: list[tuple[str, dict[str, Any]]] = []

    async def read(self) -> dict[str, Any]:
        return RequestContext.items()

    async def relay(self, key: str) -> dict[str, Any]:
        """What a grain this turn calls sees (on whichever silo ``key`` lives)."""
        return await self.get_grain(ContextReader, key).read()

    async def relay_one_way(self, key: str, tag: str) -> None:
        await self.get_grain(ContextReader, key).note(tag)

    async def change_and_read(self) -> dict[str, Any]:
        RequestContext.set("callee", "changed")
        return RequestContext.items()

    async def from_task(self, key: str) -> dict[str, Any]:
        """What a call made by a task this turn starts carries."""
        return await self.start_task(self.get_grain(ContextReader, key).read())

    @one_way
    async def note(self, tag: str) -> None:
        self.notes.append((tag, RequestContext.items()))

    async def noted(self) -> list[tuple[str, dict[str, Any]]]:
        return list(self.notes)


@subscribes("context")
class ContextSubscriber(Grain):
    """Records the request context each stream item's turn sees (its publisher's)."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, dict[str, Any]]] = []

    async def on_stream_item(self, item: Any, token: str) -> None:
        self.seen.append((item, RequestContext.items()))

    async def items_seen(self) -> list[tuple[Any, dict[str, Any]]]:
        return list(self.seen)
