"""Grains for streamed results (an async-generator method), tried at every distance
(tests/silo/test_result_streams.py): the same checks run in a client and inside a grain's turn."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from grains import Grain, interleave
from silo.errors import GrainTimeoutError, RemoteGrainError


class Producer(Grain):
    """Streams numbers; its @interleave methods answer while it streams (its turn is busy)."""

    def __init__(self) -> None:
        self.produced = 0
        self.ended = ""
        self.ended_event = asyncio.Event()
        self.hanging = asyncio.Event()
        self.log: list[str] = []

    def _start(self) -> None:
        self.produced = 0
        self.ended = ""
        self.ended_event.clear()
        self.hanging.clear()

    async def count(self, n: int, fail_at: int = -1) -> AsyncIterator[int]:
        """0..n-1; raises ValueError instead of item ``fail_at``. Says how its generator ended."""
        self._start()
        try:
            for i in range(n):
                if i == fail_at:
                    raise ValueError(f"failed at {i}")
                self.produced += 1
                yield i
            self.ended = "finished"
        except GeneratorExit:
            self.ended = "closed"  # left while it waited at a yield (for credit)
            raise
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise
        finally:
            self.log.append("stream ended")
            self.ended_event.set()

    async def hang(self) -> AsyncIterator[int]:
        """One item, then waits (inside the generator) until it is stopped."""
        self._start()
        try:
            yield 0
            self.hanging.set()
            await asyncio.Event().wait()
            yield 1
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise
        except GeneratorExit:
            self.ended = "closed"
            raise
        finally:
            self.ended_event.set()

    async def shared(self) -> AsyncIterator[dict[str, int]]:
        """The same dict each time, changed after each yield: a caller must get copies."""
        d = {"n": 0}
        for i in range(3):
            d["n"] = i
            yield d

    async def unencodable(self) -> AsyncIterator[object]:
        yield 1
        yield object()

    @interleave
    async def beside(self, n: int) -> AsyncIterator[int]:
        """An @interleave generator: other calls run between its items."""
        for i in range(n):
            yield i

    async def ordinary(self) -> str:
        self.log.append("ordinary")
        return "ok"

    @interleave
    async def progress(self) -> int:
        return self.produced

    @interleave
    async def wait_ended(self) -> str:
        await self.ended_event.wait()
        return self.ended

    @interleave
    async def wait_hanging(self) -> None:
        await self.hanging.wait()

    @interleave
    async def get_log(self) -> list[str]:
        return list(self.log)


async def stream_checks(producer: Any) -> dict[str, Any]:
    """What a caller sees of a streamed call, as plain values (the same wherever it runs)."""
    report: dict[str, Any] = {}
    report["items"] = [x async for x in producer.count(40)]
    report["finished"] = await producer.wait_ended()
    report["empty"] = [x async for x in producer.count(0)]

    got: list[int] = []
    try:
        async for x in producer.count(10, 3):
            got.append(x)
    except ValueError as exc:
        remote = isinstance(exc, RemoteGrainError)
        report["error"] = [got, remote, str(exc).splitlines()[-1], "in count" in str(exc)]

    report["copies"] = [x async for x in producer.shared()]
    got = []
    try:
        async for x in producer.unencodable():
            got.append(x)
    except Exception as exc:  # noqa: BLE001 - the report is the point
        report["unencodable"] = [got, type(exc).__name__]

    # The activation is busy while it streams: an ordinary call waits for the stream's end
    # (an @interleave one does not).
    stream = producer.count(100)
    first = await anext(stream)
    ordinary = asyncio.ensure_future(producer.ordinary())
    await producer.progress()  # the ordinary call, sent before it, is queued by now
    rest = [x async for x in stream]
    assert await ordinary == "ok"
    log = await producer.get_log()
    report["busy"] = [first, len(rest), log[-2:]]
    return report


async def stop_checks(producer: Any, window: int) -> dict[str, Any]:
    """Every way a caller leaves a stream early stops the callee's generator (its finally runs)."""
    report: dict[str, Any] = {}
    async for x in producer.count(1000):
        if x == 2:
            break
    report["break"] = await producer.wait_ended()
    # Three taken, and the generator never ran more than the window ahead of the caller.
    report["break_within_window"] = 3 <= await producer.progress() <= window

    stream = producer.count(1000)
    await anext(stream)
    await stream.aclose()
    report["aclose"] = await producer.wait_ended()

    async def consume() -> None:
        async for _ in producer.hang():
            pass

    task = asyncio.ensure_future(consume())
    await producer.wait_hanging()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    report["cancel"] = await producer.wait_ended()

    # The deadline is per item: the second item never comes, and the generator is stopped.
    got = []
    try:
        async for x in producer.with_timeout(0.3).hang():
            got.append(x)
    except GrainTimeoutError:
        report["timeout"] = [got, await producer.wait_ended()]
    # ... so a stream may last longer than the deadline in all (a slow consumer is no timeout).
    slow = []
    async for x in producer.with_timeout(0.5).count(3):
        slow.append(x)
        await asyncio.sleep(0.25)
    report["slow_consumer"] = slow
    # The grain serves calls again.
    report["after"] = [x async for x in producer.count(2)]
    return report


STREAM_CHECKS = {
    "items": list(range(40)),
    "finished": "finished",
    "empty": [],
    # Caught as ValueError, a RemoteGrainError too, with the remote traceback (as for any call).
    "error": [[0, 1, 2], True, "ValueError: failed at 3", True],
    "copies": [{"n": 0}, {"n": 1}, {"n": 2}],
    "unencodable": [[1], "CodecError"],
    "busy": [0, 99, ["stream ended", "ordinary"]],
}


STOP_CHECKS = {
    "break": "closed",
    "break_within_window": True,
    "aclose": "closed",
    "cancel": "cancelled",
    "timeout": [[0], "cancelled"],
    "slow_consumer": [0, 1, 2],
    "after": [0, 1],
}


class Consumer(Grain):
    """Runs the checks from inside a turn, against a Producer wherever that lives."""

    async def run(self, key: str) -> dict[str, Any]:
        return await stream_checks(self.get_grain(Producer, key))

    async def stop(self, key: str, window: int) -> dict[str, Any]:
        return await stop_checks(self.get_grain(Producer, key), window)

    async def back_pressure(self, key: str, n: int, window: int) -> list[int]:
        return await back_pressure(self.get_grain(Producer, key), n, window)


async def back_pressure(producer: Any, n: int, window: int) -> list[int]:
    """Take ``n`` items slowly; the producer's own counter must never be more than ``window``
    ahead of what was taken. Returns [items taken, the most it was seen ahead, its lead at a
    stall (where it must have filled the window exactly)]."""
    taken = 0
    most_ahead = 0
    at_stall = -1
    async for x in producer.count(n):
        assert x == taken
        taken += 1
        if taken % 97 == 0 or taken == n // 2:
            produced = await producer.progress()
            most_ahead = max(most_ahead, produced - taken)
            assert produced <= taken + window, (produced, taken, window)
        if taken == n // 2:
            # Stall here: the producer runs until its credit is spent, and no further. Each
            # round trip lets it run; it reaches the window (credit comes in half windows).
            granted = window + (taken // max(1, window // 2)) * max(1, window // 2)
            while (produced := await producer.progress()) < min(granted, n):
                assert produced <= taken + window
            for _ in range(20):
                assert await producer.progress() == min(granted, n)
            at_stall = min(granted, n) - taken
    assert await producer.wait_ended() == "finished"
    return [taken, most_ahead, at_stall]
