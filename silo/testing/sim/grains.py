"""The grains the simulated workloads call: each records what it did into the world's history.

A grain finds its world through :data:`WORLD`, a context variable every
simulated silo's context carries (no process-wide registry: two worlds may
run in one process, one after the other or side by side in tests).
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import TYPE_CHECKING

from pydantic import BaseModel

from grains import Grain, one_way, read_only

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
