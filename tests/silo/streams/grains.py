"""Grains for the stream tests (also loaded by silo subprocesses: no torch import here)."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

from grains import Grain, StreamGap, incoming_filter, random_placement, subscribes


class Tick(BaseModel):
    """One numbered item of one stream key."""

    n: int


@random_placement
@subscribes("orders")
class OrderLog(Grain):
    """Implicitly subscribed to namespace "orders": records every item it was given, persisted
    in the same turn, so what it saw survives the death of its silo."""

    class State(BaseModel):
        seen: list[int] = []
        tokens: list[str] = []
        silos: list[str] = []

    async def on_stream_item(self, item: Tick, token: str) -> None:
        self.state.seen.append(item.n)
        self.state.tokens.append(token)
        self.state.silos.append(str(self.silo))
        await self.write_state()

    async def seen(self) -> list[int]:
        return list(self.state.seen)

    async def tokens(self) -> list[str]:
        return list(self.state.tokens)

    async def silos(self) -> list[str]:
        return list(self.state.silos)


@subscribes("poison")
class Picky(Grain):
    """Raises on odd items: after ``max_attempts`` they go to the dead letters (logged, counted),
    the even ones still arrive."""

    class State(BaseModel):
        seen: list[int] = []

    async def on_stream_item(self, item: int, token: str) -> None:
        if item % 2:
            raise ValueError(f"odd item {item}")
        self.state.seen.append(item)
        await self.write_state()

    async def seen(self) -> list[int]:
        return list(self.state.seen)


class Publisher(Grain):
    """Publishes from inside a grain (``self.stream``)."""

    async def publish(self, namespace: str, key: str, n: int) -> str:
        return await self.stream(namespace, key).publish(Tick(n=n))

    async def read(self, namespace: str, key: str, count: int) -> list[int]:
        """The first ``count`` items of the stream, read with an explicit subscription."""
        out: list[int] = []
        async with self.stream(namespace, key).subscribe(from_start=True) as sub:
            async for ev in sub:
                out.append(ev.item.n)
                if len(out) == count:
                    break
        return out


@subscribes("slow")
class Stuck(Grain):
    """Never returns from item 1 (each attempt outlasts its deadline and is cancelled); records
    the others."""

    class State(BaseModel):
        seen: list[int] = []

    async def on_stream_item(self, item: int, token: str) -> None:
        if item == 1:
            await asyncio.Event().wait()  # cancelled at the attempt's deadline
        self.state.seen.append(item)
        await self.write_state()

    async def seen(self) -> list[int]:
        return list(self.state.seen)


@subscribes("gappy")
class Gappy(Grain):
    """Records the items it gets and the gaps it is told of, in the order they came."""

    class State(BaseModel):
        log: list[str] = []

    async def on_stream_item(self, item: int, token: str) -> None:
        self.state.log.append(str(item))
        await self.write_state()

    async def on_stream_gap(self, gap: StreamGap) -> None:
        self.state.log.append(f"gap {gap.namespace}/{gap.key} after={gap.after} before={gap.before} lost={gap.lost}")
        await self.write_state()

    async def log(self) -> list[str]:
        return list(self.state.log)


async def refuse_thirteen(ctx: Any, call_next: Any) -> Any:
    """A class's incoming filter: sees each stream item as a call of ``__stream__`` with
    ``(namespace, item, token)``, and refuses item 13 (the grain never runs it)."""
    ctx.activation.instance.filtered.append(ctx.method)
    if ctx.method == "__stream__" and ctx.args[1] == 13:
        raise PermissionError("13 is refused by the filter")
    return await call_next(ctx)


@incoming_filter(refuse_thirteen)
@subscribes("filtered")
class Filtered(Grain):
    """Records the items that got through its filter; ``filtered`` lists every method it saw."""

    class State(BaseModel):
        seen: list[int] = []

    def __init__(self) -> None:
        super().__init__()
        self.filtered: list[str] = []

    async def on_stream_item(self, item: int, token: str) -> None:
        self.state.seen.append(item)
        await self.write_state()

    async def seen(self) -> list[int]:
        return list(self.state.seen)

    async def methods(self) -> list[str]:
        return list(self.filtered)
