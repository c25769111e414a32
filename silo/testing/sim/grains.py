"""The grains the simulated workloads call: each records what it did into the world's history.

A grain finds its world through :data:`WORLD`, a context variable every
simulated silo's context carries (no process-wide registry: two worlds may
run in one process, one after the other or side by side in tests).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pydantic import BaseModel

from grains import Grain, ObserverRef, ObserverSet, grain_type, one_way, read_only, version
from grains.streams import subscribes

if TYPE_CHECKING:
    from silo.testing.sim.world import World

WORLD: contextvars.ContextVar[World] = contextvars.ContextVar("redgrain_sim_world")


class SimRegister(Grain):
    """A persisted register: every acknowledged ``write`` must be what later reads see."""

    class State(BaseModel):
        value: int = 0

    async def on_activate(self) -> None:
        world = WORLD.get()
        await asyncio.sleep(world.activation_delay())
        world.record("activate", self.key, str(self.silo))

    async def write(self, value: int) -> int:
        self.state.value = value
        await self.write_state()
        if WORLD.get().leave_after_turn():
            # Deactivation with calls still queued: they must be re-routed, never dropped.
            self.deactivate_on_idle()
        return value

    @read_only
    async def read(self) -> int:
        return self.state.value


class SimLog(Grain):
    """Takes one-way appends and records the order they ran in (per sender, per activation)."""

    async def on_activate(self) -> None:
        world = WORLD.get()
        self.incarnation = world.next_incarnation()
        await asyncio.sleep(world.activation_delay())

    @one_way
    async def append(self, sender: str, seq: int) -> None:
        WORLD.get().applied(self.key, self.incarnation, sender, seq)


SIM_GRAINS: list[type[Grain]] = [SimRegister, SimLog]


class SimCounter(Grain):
    """Streams ``0 .. n-1`` (the ``results`` scenario): the world records when each generator
    starts and when it ends on the callee, to check that a caller who leaves stops it."""

    async def count(self, stream: str, n: int) -> AsyncIterator[int]:
        world = WORLD.get()
        world.generator_started(stream)
        try:
            for i in range(n):
                await asyncio.sleep(0.02)
                yield i
        finally:
            world.generator_ended(stream)


class SimRoom(Grain):
    """Keeps the clients' observers in an ObserverSet and notifies them (the ``results`` scenario)."""

    def __init__(self) -> None:
        self.members = ObserverSet(expiry_s=3.0)

    async def join(self, obs: ObserverRef) -> None:
        self.members.subscribe(obs)

    async def say(self, seq: int) -> list[str]:
        """Notify every member of ``seq``; the names of those whose handler answered."""
        answered: list[str] = []

        async def note(obs: ObserverRef) -> None:
            answered.append(await obs.on_note(seq))

        await self.members.notify(note)
        return answered


RESULT_GRAINS: list[type[Grain]] = [SimCounter, SimRoom]


@version(1)
@grain_type("SimVersioned")
class SimVersionedV1(Grain):
    """The old version of a register (the ``versions`` scenario): it knows ``value`` only."""

    class State(BaseModel):
        value: int = 0

    async def on_activate(self) -> None:
        world = WORLD.get()
        await asyncio.sleep(world.activation_delay())
        world.record("activate", self.key, str(self.silo), 1)

    async def write(self, value: int) -> int:
        self.state.value = value
        await self.write_state()
        return value

    @read_only
    async def read(self) -> int:
        return self.state.value


@version(2)
@grain_type("SimVersioned")
class SimVersionedV2(Grain):
    """The new version: a ``tag`` field and two methods more. A v1 activation that writes
    ``value`` must keep the tag it does not know (docs/concepts.md, "Versions")."""

    class State(BaseModel):
        value: int = 0
        tag: int = 0

    async def on_activate(self) -> None:
        world = WORLD.get()
        await asyncio.sleep(world.activation_delay())
        world.record("activate", self.key, str(self.silo), 2)

    async def write(self, value: int) -> int:
        self.state.value = value
        await self.write_state()
        return value

    @read_only
    async def read(self) -> int:
        return self.state.value

    async def write_tag(self, tag: int) -> int:
        self.state.tag = tag
        await self.write_state()
        return tag

    @read_only
    async def read_tag(self) -> int:
        return self.state.tag

FEED = "simfeed"
"""The stream namespace :class:`SimSubscriber` is subscribed to."""


class SimTicker(Grain):
    """A durable reminder and an in-memory timer, each tick recorded (the ``services`` scenario)."""

    async def on_activate(self) -> None:
        services = WORLD.get().services
        assert services is not None
        self.activation = services.timer_started(self.key)
        self.register_timer(self._on_timer, due_s=services.timer_s, period_s=services.timer_s)

    async def start(self, period_s: float) -> None:
        await self.register_reminder("tick", period_s)

    async def receive_reminder(self, name: str) -> None:
        services = WORLD.get().services
        assert services is not None
        services.ticked(self.key)

    async def _on_timer(self) -> None:
        services = WORLD.get().services
        assert services is not None
        services.timer_ticked(self.key, self.activation)


@subscribes(FEED)
class SimSubscriber(Grain):
    """Implicitly subscribed to every key of :data:`FEED`: records each item it is handed."""

    async def on_stream_item(self, item: int, token: str) -> None:
        services = WORLD.get().services
        assert services is not None
        services.received(self.key, token, item)


SERVICE_GRAINS: list[type[Grain]] = [SimTicker, SimSubscriber]
"""The grains of the ``services`` scenario (only there: the others' silos stay as they were)."""
