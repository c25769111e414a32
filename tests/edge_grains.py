"""Grains for the edges of a call, each tried at every distance (tests/silo/test_call_edges.py):
an error caught by its own type, a caller's cancellation reaching the callee, and call chains
that must not be taken for deadlocks (a one-way call, a call from a background task)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar

from grains import Grain, interleave, one_way, silo_role
from silo.errors import DeadlockError, RemoteGrainError


class QuotaError(Exception):
    """An application's own exception: known wherever this grain module is (the codec's registry)."""

    def __init__(self, used: int) -> None:
        self.used = used
        super().__init__(f"quota used up: {used}")


class Raiser(Grain):
    async def fail(self, kind: str) -> None:
        if kind == "value":
            raise ValueError("bad value")
        if kind == "key":
            raise KeyError("missing")
        if kind == "quota":
            raise QuotaError(7)
        if kind == "json":
            json.loads("{")  # json.JSONDecodeError: unknown here by name, still a ValueError
        raise RuntimeError(kind)


def caught(exc: BaseException) -> dict[str, Any]:
    """What a caller's ``except`` clauses see of an error, as plain values for a test to compare."""
    return {
        "value": isinstance(exc, ValueError),
        "key": isinstance(exc, KeyError),
        "quota": isinstance(exc, QuotaError),
        "remote": isinstance(exc, RemoteGrainError),
        "args": list(exc.args),
        "used": getattr(exc, "used", None),
        "traceback": "in fail" in str(exc),
    }


class ErrorProbe(Grain):
    """Calls a Raiser from wherever this grain lives and reports what it caught."""

    async def probe(self, key: str, kind: str) -> dict[str, Any]:
        try:
            await self.get_grain(Raiser, key).fail(kind)
        except Exception as exc:  # noqa: BLE001 - the report is the point
            return caught(exc)
        return {}


class Sleeper(Grain):
    """A callee that says whether its nap finished or was cancelled, and which calls ran."""

    def __init__(self) -> None:
        self.last = "none"
        self.marks: list[str] = []
        self.napping = asyncio.Event()
        self.work_done = asyncio.Event()

    async def nap(self, seconds: float) -> str:
        self.last = "napping"
        self.napping.set()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.last = "cancelled"
            raise
        self.last = "finished"
        return "finished"

    async def mark(self, tag: str) -> None:
        self.marks.append(tag)

    @interleave
    async def started(self) -> None:
        """Returns once a nap runs (interleaved: it does not wait behind the nap)."""
        await self.napping.wait()

    async def report(self) -> dict[str, Any]:
        return {"last": self.last, "marks": list(self.marks)}

    async def shielded(self) -> str:
        """Work the caller's cancellation must not stop: shielded by the grain itself."""
        self.napping.set()
        try:
            await asyncio.shield(self._work())
        except asyncio.CancelledError:
            self.last = "cancelled"
            raise
        return "done"

    async def _work(self) -> None:
        await asyncio.sleep(0.2)
        self.work_done.set()

    @interleave
    async def wait_work(self) -> bool:
        await self.work_done.wait()
        return True


async def cancel_nap_and_queued(sleeper: Any, how: str = "cancel") -> dict[str, Any]:
    """Start a long nap and queue a call behind it, cancel both callers, then report.

    ``started`` runs beside the nap, so both calls are on the callee when the callers are
    cancelled (``how``: by ``task.cancel()``, by an ``asyncio.timeout`` that expires, or by
    a TaskGroup whose other task fails); the report is asked on the same path after the
    cancellations, so it sees whatever they did to the nap and to the queued call."""
    if how == "cancel":
        nap = asyncio.ensure_future(sleeper.nap(10.0))
        queued = asyncio.ensure_future(sleeper.mark("queued"))
        await sleeper.started()
        nap.cancel()
        queued.cancel()
        await asyncio.gather(nap, queued, return_exceptions=True)
    elif how == "timeout":
        try:
            async with asyncio.timeout(None) as deadline:

                async def expire_once_started() -> None:
                    await sleeper.started()
                    deadline.reschedule(asyncio.get_running_loop().time())
                    await asyncio.Event().wait()

                await asyncio.gather(sleeper.nap(10.0), sleeper.mark("queued"), expire_once_started())
        except TimeoutError:
            pass
    elif how == "taskgroup":

        async def fail_once_started() -> None:
            await sleeper.started()
            raise LookupError("a sibling failed")

        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(sleeper.nap(10.0))
                group.create_task(sleeper.mark("queued"))
                group.create_task(fail_once_started())
        except* LookupError:
            pass
    else:
        raise ValueError(how)
    report: dict[str, Any] = await sleeper.report()
    return report


@silo_role("slow")  # on the silo a test starts with that role: another one than its caller's
class SlowStart(Grain):
    """A grain whose activation waits for the test (silos of a test share its process and loop)."""

    gate: ClassVar[asyncio.Event | None] = None
    activating: ClassVar[asyncio.Event | None] = None

    def __init__(self) -> None:
        self.marks: list[str] = []

    async def on_activate(self) -> None:
        if SlowStart.activating is not None:
            SlowStart.activating.set()
        if SlowStart.gate is not None:
            await SlowStart.gate.wait()

    async def mark(self, tag: str) -> None:
        self.marks.append(tag)

    async def report(self) -> list[str]:
        return list(self.marks)


async def cancel_while_activating(slow: Any, barrier: Any) -> list[str]:
    """Cancel a call while its grain activates, then let the activation finish; what ran.

    The call is the one that activates the grain, so it has reached the grain's silo when
    ``on_activate`` starts. ``barrier`` is a grain on that silo: its answer comes back on the
    same connection as the CANCEL, after the CANCEL was read there."""
    SlowStart.gate, SlowStart.activating = asyncio.Event(), asyncio.Event()
    call = asyncio.ensure_future(slow.mark("x"))
    await SlowStart.activating.wait()
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await barrier.report()
    SlowStart.gate.set()
    marks: list[str] = await slow.report()
    return marks


class CancelProbe(Grain):
    """Runs cancel_nap_and_queued (or cancel_while_activating) from wherever this grain lives."""

    async def run(self, key: str) -> dict[str, Any]:
        return await cancel_nap_and_queued(self.get_grain(Sleeper, key))

    async def run_activating(self, key: str, barrier: str) -> list[str]:
        return await cancel_while_activating(self.get_grain(SlowStart, key), self.get_grain(Sleeper, barrier))


class Pinger(Grain):
    """A: sends one-way to B, or starts a background call to B, and goes idle; B calls it back."""

    async def ping(self) -> str:
        return "pong"

    async def notify(self, target: str) -> None:
        await self.get_grain(Ponger, target).poke(self.key)

    async def spawn(self, target: str) -> None:
        self.start_task(self.get_grain(Ponger, target).call_back(self.key))


class Ponger(Grain):
    """B: calls its Pinger back and keeps what that call gave."""

    def __init__(self) -> None:
        self.outcome = ""
        self.done = asyncio.Event()

    @one_way
    async def poke(self, source: str) -> None:
        await self.call_back(source)

    async def call_back(self, source: str) -> str:
        try:
            self.outcome = await self.get_grain(Pinger, source).ping()
        except DeadlockError:
            self.outcome = "DeadlockError"
        finally:
            self.done.set()
        return self.outcome

    @interleave
    async def wait_outcome(self) -> str:
        await self.done.wait()
        return self.outcome
