"""The ``services`` scenario: reminders, timers and implicit stream subscribers on a simulated cluster.

Every silo of the world also runs the services that talk to Redis directly,
as :class:`~silo.testing.harness.InProcessSilo` wires them when given a Redis
client: the reminder service (claim, deliver through the router, ack) and a
stream agent for :class:`~silo.testing.sim.grains.SimSubscriber` (leases,
rendezvous over the silos hosting it, consumer group, takeover, dead
letters). Each silo has its own client of one shared fakeredis server
(:mod:`silo.testing.sim.redis_twin`) on the sim's loop, through its link: the
seed's latency, and its Redis cut.

The workload (one client's process): register a reminder on each
:class:`~silo.testing.sim.grains.SimTicker` (whose activations also run a
timer), then publish numbered items to the keys of the feed until the end.
What the grains received and what was published is recorded in
:class:`~silo.testing.sim.checks.ServiceRecord`, with each fault's window;
the ``reminder_ticks``, ``timer_ticks`` and ``stream_delivered`` checkers
read it.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any

from silo import errors
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.settings import RemindersSettings, StreamSettings
from silo.streams.stream import Streams
from silo.testing.sim import redis_twin
from silo.testing.sim.grains import FEED, SimTicker

if TYPE_CHECKING:
    from silo.testing.sim.world import SimClient, World

TICKERS = 2
FEED_KEYS = 2
REMINDER_PERIOD_S = 1.0
TIMER_PERIOD_S = 0.5


class Services:
    """One world's Redis-direct side: the shared server, the services' settings, the recorder."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.record = world.history.services
        self.server = redis_twin.new_server()
        self.keys = Keys("sim")
        self.timer_s = TIMER_PERIOD_S
        # Short deadlines and leases so a run of a few simulated seconds sees claims expire,
        # keys move and items retried; the mechanisms are those of the defaults.
        self.reminders = RemindersSettings(poll_interval_s=0.2, idle_poll_s=5.0, delivery_timeout_s=3.0)
        self.streams = StreamSettings(maxlen=None, lease_s=3.0, discover_interval_s=0.5, block_ms=500, delivery_timeout_s=3.0)
        self._activations = 0

    def client(self, name: str) -> Any:
        """A Redis client for the process ``name`` (its commands pass that process's link)."""
        return redis_twin.client(self.server, name)

    # --- what the grains and faults report ----------------------------------------------
    def ticked(self, key: str) -> None:
        self.world.trace("reminder_tick", key)
        self.record.ticks.append((key, self.world.now()))

    def timer_started(self, key: str) -> int:
        self._activations += 1
        self.record.timers.setdefault(key, self.timer_s)
        self.record.timer_started.setdefault(key, self.world.now())
        return self._activations

    def timer_ticked(self, key: str, activation: int) -> None:
        self.world.trace("timer_tick", key, activation)
        self.record.timer_ticks.append((key, activation, self.world.now()))

    def received(self, key: str, token: str, item: int) -> None:
        self.world.trace("stream_item", key, token, item)
        self.record.delivered.append((key, token, item))

    def window(self, length_s: float) -> None:
        now = self.world.now()
        self.record.windows.append((now, now + length_s))

    # --- the workload ----------------------------------------------------------------------
    async def drive(self, client: SimClient, end: float) -> None:
        rng = random.Random(self.world.work_rng.getrandbits(64))
        for i in range(TICKERS):
            await self._start_ticker(client, f"t{i}")
        registry = TypeRegistry()
        streams = Streams(client.redis, self.keys, Codec(registry), self.streams, clock=lambda: time.time())
        item = 0
        while self.world.now() < end:
            key = f"k{rng.randrange(FEED_KEYS)}"
            item += 1
            try:
                token = await streams.stream(FEED, key).publish(item)
            except errors.StorageError as exc:
                # Not acknowledged: it may or may not be in the stream (the checker asks nothing of it).
                self.world.trace("publish_failed", key, item, type(exc).__name__)
            else:
                self.world.trace("published", key, item, token)
                self.record.published[(key, token)] = item
            await asyncio.sleep(rng.expovariate(1 / 0.1))

    async def _start_ticker(self, client: SimClient, key: str) -> None:
        ref = client.refs.get_grain(SimTicker, key).with_timeout(self.world.scenario.call_timeout_s)
        while True:
            try:
                await ref.start(REMINDER_PERIOD_S)
            except errors.RedgrainError as exc:
                self.world.trace("ticker_start_failed", key, type(exc).__name__)
                await asyncio.sleep(0.5)
                continue
            self.record.reminders[key] = (self.world.now(), REMINDER_PERIOD_S)
            return

    async def collect(self) -> None:
        """After the run settled: what the dead-letter stream holds, and when the checks stop counting."""
        self.record.end = self.world.now()
        reader = redis_twin.client(self.server, "checker")
        try:
            entries: Any = await reader.xrange(self.keys.stream_dead_letters(FEED))
        finally:
            await reader.aclose()
        self.record.dead_letters = {(_text(fields[b"key"]), _text(fields[b"token"])) for _, fields in entries}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
