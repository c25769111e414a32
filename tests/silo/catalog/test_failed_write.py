"""A state write that fails ends its activation's serving: nothing queued behind it reads memory
the store may not hold (found by the simulator: a read after a failed write saw the unstored
value, and later reads the stored one). On the twins, nothing sleeps."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

from grains import Grain, read_only
from grains.ids import GrainId
from silo import errors
from silo.testing.clock import VirtualClock
from silo.testing.harness import InProcessSilo
from silo.testing.store import InMemoryStateStore


class Register(Grain):
    class State(BaseModel):
        value: int = 0

    async def write(self, value: int) -> None:
        self.state.value = value
        await self.write_state()

    @read_only
    async def read(self) -> int:
        return self.state.value


class _FailingStore(InMemoryStateStore):
    """Its next write waits for ``release`` and then fails as a Redis cut would."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.fail_next = False
        self.release = asyncio.Event()

    async def write_stream(self, grain: GrainId, parts: list[memoryview], etag: str | None, token: int, **kw: Any) -> str:
        if self.fail_next:
            self.fail_next = False
            await self.release.wait()
            raise errors.StorageError("state write: Redis unreachable (cut in a test)")
        return await super().write_stream(grain, parts, etag, token, **kw)


async def test_a_read_queued_behind_a_failed_state_write_never_sees_the_unstored_value() -> None:
    with VirtualClock(autojump=True) as clock:
        silo = InProcessSilo([Register], clock=clock)
        store = _FailingStore(owner=silo.directory.token_of)
        silo = InProcessSilo([Register], clock=clock, directory=silo.directory, store=store)
        async with silo:
            ref = silo.get_grain(Register, "r")
            await ref.write(5)
            store.fail_next = True
            failing = asyncio.ensure_future(ref.write(7))
            await clock.settle()  # the write's turn now waits in the store
            reading = asyncio.ensure_future(ref.read())
            await clock.settle()
            store.release.set()
            try:
                await failing
            except errors.StorageError:
                pass
            else:
                raise AssertionError("the write was meant to fail")
            # The read ran after the failed write: on a fresh activation that reloaded 5,
            # never on the old one's memory, which held a 7 the store never had.
            assert await asyncio.wait_for(reading, 10) == 5
            assert await ref.read() == 5
