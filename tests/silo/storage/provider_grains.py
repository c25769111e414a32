"""A grain whose states live with a storage provider named in the settings ("mem")."""

from __future__ import annotations

from pydantic import BaseModel

from grains import Grain, storage


class Prefs(BaseModel):
    theme: str = "light"


class ArchiveMeta(BaseModel):
    count: int = 0


@storage("mem")
class Archive(Grain):
    """Its states live with the "mem" provider, except ``meta``, which names "redis"."""

    class State(BaseModel):
        items: list[str] = []

    def __init__(self) -> None:
        self.meta = self.named_state("meta", ArchiveMeta, storage="redis")
        self.notes = self.named_state("notes", Prefs)

    async def add(self, item: str) -> int:
        self.state.items.append(item)
        await self.write_state()
        self.meta.value.count += 1
        await self.meta.write()
        self.notes.value.theme = item
        await self.notes.write()
        return self.meta.value.count

    async def items(self) -> list[str]:
        return list(self.state.items)
