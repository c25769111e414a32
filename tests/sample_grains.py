"""Grains used by the test suite (imported by silo subprocesses too)."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import torch
from pydantic import BaseModel

from grains import (
    Grain,
    deactivate_on,
    grain_type,
    immutable,
    interleave,
    one_way,
    random_placement,
    reentrant,
    stateless_worker,
)
from silo.errors import CodecError, GrainTimeoutError


class Echo(Grain):
    async def echo(self, value: object) -> object:
        return value

    async def where(self) -> str:
        return str(self.silo)

    async def pid(self) -> int:
        return os.getpid()

    async def sleep(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "slept"

    async def fail(self, message: str) -> None:
        raise ValueError(message)

    async def block_loop(self, seconds: float) -> None:
        time.sleep(seconds)  # deliberately wrong: holds the event loop

    async def tensor_sum(self, t: torch.Tensor) -> float:
        return float(t.sum())

    async def array_roundtrip(self, a: np.ndarray) -> np.ndarray:
        return a


class Counter(Grain):
    class State(BaseModel):
        value: int = 0

    async def add(self, n: int = 1) -> int:
        self.state.value += n
        await self.write_state()
        return self.state.value

    async def get(self) -> int:
        return self.state.value


class Sequencer(Grain):
    """Records call order; `step` awaits so interleaving would show."""

    def __init__(self) -> None:
        self.log: list[int] = []
        self.active = 0
        self.max_active = 0

    async def step(self, i: int) -> int:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        await asyncio.sleep(0)
        self.log.append(i)
        self.active -= 1
        return i

    async def history(self) -> list[int]:
        return self.log

    async def concurrency(self) -> int:
        return self.max_active


class PingPong(Grain):
    """A calls B, B calls back A: a deadlock unless reentrant."""

    async def ping(self, other: str, depth: int) -> int:
        if depth == 0:
            return 0
        peer = self.get_grain(PingPong, other)
        return 1 + await peer.ping(self.key, depth - 1)


@reentrant
class ReentrantPingPong(Grain):
    async def ping(self, other: str, depth: int) -> int:
        if depth == 0:
            return 0
        peer = self.get_grain(ReentrantPingPong, other)
        return 1 + await peer.ping(self.key, depth - 1)


@random_placement
class RandomEcho(Echo):
    """An Echo placed at random, so tests can spread grains over silos."""


class Relay(Grain):
    """Calls another grain (possibly on another silo) and reports where both ran."""

    async def relay(self, target_key: str, value: object) -> dict:
        echo = self.get_grain(RandomEcho, target_key)
        return {"here": str(self.silo), "there": await echo.where(), "value": await echo.echo(value)}


class Lifecycle(Grain):
    """Counts its activations in a shared registry grain-free way: via state."""

    class State(BaseModel):
        activations: int = 0
        deactivations: int = 0

    async def on_activate(self) -> None:
        self.state.activations += 1
        await self.write_state()

    async def on_deactivate(self, reason: object) -> None:
        self.state.deactivations += 1
        await self.write_state()

    async def counts(self) -> tuple[int, int]:
        return self.state.activations, self.state.deactivations

    async def retire(self) -> None:
        self.deactivate_on_idle()


@grain_type("Renamed")
class NamedGrain(Grain):
    async def name(self) -> str:
        return self.grain_id.type_name


class Gate(Grain):
    """`wait` blocks until `open` is called; `open` is @interleave so it gets in."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def wait(self) -> str:
        await self.event.wait()
        return "opened"

    @interleave
    async def open(self) -> None:
        self.event.set()


@deactivate_on(MemoryError)
class Fragile(Grain):
    def __init__(self) -> None:
        self.generation = id(self)

    async def ident(self) -> int:
        return self.generation

    async def oom(self) -> None:
        raise MemoryError("pretend the GPU ran out of memory")


@stateless_worker(max_local=4)
class Worker(Grain):
    async def work(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return self.activation_id


class Ticker(Grain):
    def __init__(self) -> None:
        self.ticks = 0
        self.fired = asyncio.Event()

    async def start(self, period_s: float) -> None:
        async def tick() -> None:
            self.ticks += 1
            if self.ticks >= 3:
                self.fired.set()

        self.register_timer(tick, due_s=period_s, period_s=period_s)

    @interleave  # waiting must not hold the turn the timer callbacks need
    async def wait_ticks(self) -> int:
        await self.fired.wait()
        return self.ticks


# --- state, checkpoints, reminders (tests/silo/storage/) ----------------------------

import hashlib
import zlib

from pydantic import ConfigDict

from grains import write_behind
from grains.checkpoints import snapshots


class Ledger(Grain):
    """Idempotent adds: a retried op id is applied once, so a client may retry blindly."""

    class State(BaseModel):
        total: int = 0
        applied: list[str] = []

    async def add(self, n: int, op_id: str) -> int:
        if op_id not in self.state.applied:
            self.state.total += n
            self.state.applied.append(op_id)
            await self.write_state()
        return self.state.total

    async def total(self) -> tuple[int, int]:
        return self.state.total, len(self.state.applied)

    async def where(self) -> str:
        return str(self.silo)


def tensor_digest(t: torch.Tensor | None) -> str:
    if t is None:
        return ""
    return hashlib.sha256(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())).hexdigest()


class BigState(Grain):
    """A tensor state of any size, filled deterministically from a seed."""

    class State(BaseModel):
        model_config = ConfigDict(arbitrary_types_allowed=True)
        seed: int = 0
        weights: torch.Tensor | None = None

    async def fill(self, seed: int, mb: int) -> str:
        n = mb * (1 << 20) // 4
        self.state.seed = seed
        self.state.weights = torch.arange(n, dtype=torch.int32) * (seed * 2 + 1)
        await self.write_state()
        return tensor_digest(self.state.weights)

    async def digest(self) -> tuple[int, str]:
        return self.state.seed, tensor_digest(self.state.weights)


@write_behind(60_000)
class Buffered(Grain):
    """Write-behind with a flush far away: only deactivation (or a test) flushes it."""

    class State(BaseModel):
        value: int = 0

    async def set(self, value: int) -> int:
        self.state.value = value
        await self.write_state()
        return value

    async def get(self) -> int:
        return self.state.value

    async def retire(self) -> None:
        self.deactivate_on_idle()


class Reminded(Grain):
    """Counts reminder ticks in its state, with the silo each tick ran on."""

    class State(BaseModel):
        ticks: int = 0
        silos: list[str] = []

    async def start(self, period_s: float) -> None:
        await self.register_reminder("tick", period_s, due_s=0.0)

    async def stop(self) -> None:
        await self.unregister_reminder("tick")

    async def receive_reminder(self, name: str) -> None:
        if name == "tick":
            self.state.ticks += 1
            self.state.silos.append(str(self.silo))
            await self.write_state()

    async def ticks(self) -> tuple[int, list[str]]:
        return self.state.ticks, self.state.silos

    async def where(self) -> str:
        return str(self.silo)


class Shard(Grain):
    """A parameter shard: a step counter and a tensor, checkpointed as a group."""

    class State(BaseModel):
        model_config = ConfigDict(arbitrary_types_allowed=True)
        step: int = 0
        weights: torch.Tensor = torch.zeros(0)

    async def train(self, step: int, numel: int) -> str:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.key}/{step}".encode()))
        self.state.step = step
        self.state.weights = torch.randn(numel, generator=gen)
        await self.write_state()
        return tensor_digest(self.state.weights)

    async def checkpoint(self, group: str, members: list[str], keep: int, epoch: int | None = None) -> bool:
        return await snapshots(self).save(group, self.state.step, members, keep=keep, epoch=epoch)

    async def restore(self, group: str, snapshot_id: int | None) -> str:
        return await snapshots(self).load(group, snapshot_id)

    async def digest(self) -> tuple[int, str]:
        return self.state.step, tensor_digest(self.state.weights)


class Napper(Grain):
    """A callee that says whether its last nap finished or was cancelled (deadline tests)."""

    def __init__(self) -> None:
        self.last = "none"

    async def nap(self, seconds: float) -> str:
        self.last = "napping"
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.last = "cancelled"
            raise
        self.last = "finished"
        return "finished"

    async def last_nap(self) -> str:
        return self.last


class NapCaller(Grain):
    """Calls a Napper with a deadline, from wherever this grain lives (the same silo, in tests)."""

    async def call_nap(self, key: str, timeout_s: float, seconds: float) -> str:
        try:
            return await self.get_grain(Napper, key).with_timeout(timeout_s).nap(seconds)
        except GrainTimeoutError as exc:
            return f"timeout: {exc}"



@random_placement  # beside its caller on one silo, often not on two (test_call_semantics)
class Appender(Grain):
    async def append_to(self, items: list) -> list:
        items.append("callee")
        return items


class Unencodable:
    """Not registered for the wire: no call may return one, wherever the caller is."""


@random_placement
class Odd(Grain):
    async def odd(self) -> object:
        return Unencodable()


@immutable
class Frozen(BaseModel):
    value: int = 0


class Keeper(Grain):
    async def keep(self, value: object) -> object:
        return value

    async def keep_frozen(self, value: Frozen) -> Frozen:
        return value


class LocalProbe(Grain):
    """Makes calls from inside a grain, to grains that a one-silo cluster puts beside it."""

    async def mutation_seen(self, key: str) -> dict:
        mine = ["caller"]
        got = await self.get_grain(Appender, key).append_to(mine)
        return {"mine": mine, "got": got, "same": got is mine}

    async def unregistered_result(self, key: str) -> str:
        try:
            await self.get_grain(Odd, key).odd()
        except CodecError as exc:
            return f"CodecError: {exc}"
        return "no error"

    async def identity(self, key: str, what: str) -> bool:
        value: object
        if what == "tensor":
            value = torch.ones(4)
        elif what == "marked tensor":
            value = immutable(torch.ones(4))
        elif what == "frozen":
            value = Frozen(value=3)
            return await self.get_grain(Keeper, key).keep_frozen(value) is value
        else:
            value = {"a": [1, 2]}
        return await self.get_grain(Keeper, key).keep(value) is value


class Inbox(Grain):
    """``@one_way`` deliveries: a put that waits for a release (so a test sees the caller return
    while the method still runs), and one that fails."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.gate = asyncio.Event()

    @one_way
    async def put_when_released(self, item: str) -> str:
        await self.gate.wait()
        self.items.append(item)
        return "dropped: nobody is waiting for it"

    @one_way
    async def put(self, item: str) -> None:
        self.items.append(item)

    @one_way
    async def explode(self, message: str) -> None:
        raise ValueError(message)

    @interleave
    async def release(self) -> None:
        self.gate.set()

    async def contents(self) -> list[str]:
        return list(self.items)


class InboxSender(Grain):
    """Sends one-way calls from inside a grain (to an Inbox beside it on a one-silo cluster)."""

    async def send_all(self, key: str, items: list[str]) -> None:
        inbox = self.get_grain(Inbox, key)
        for item in items:
            assert await inbox.put(item) is None
        items.append("changed after sending")  # the Inbox got its own copies
