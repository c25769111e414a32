"""The ``silo`` scenario: every simulated silo is :class:`silo.silo.Silo` itself, on one shared fakeredis.

The other scenarios' :class:`~silo.testing.sim.world.SimSilo` is the
harness's wiring on the Redis twins of our own protocols. Here each silo is
the production class, started through its real ``start()`` stages (the
membership row, manifests, directory, state store, reminders, rebalancer and
its lease, migrator, drains, control inbox, housekeeping, stream retention,
stats publisher, event log: their Redis code and Lua scripts) on a fakeredis
server (:mod:`silo.testing.sim.redis_twin`) every silo and client reaches
through its own client and link (latency from the seed, cuts). What differs
from a process is what :class:`~silo.environment.SiloEnvironment` names, and
only that:

* the transport is :class:`~silo.testing.transport.InMemoryTransport` on the
  world's network (its delays and cuts), and the failure detector's bare
  handshake is the network's (:meth:`World.handshake`);
* the heartbeat is :class:`SimHeartbeat`: the heartbeat thread's Lua script
  and :class:`~silo.cluster.failure_detector.Liveness` rule, beaten from the
  loop through the silo's own client (a thread cannot run on virtual time;
  a pause stops it as SIGSTOP stops the thread);
* placement draws, the published load (the activation count, no psutil),
  host name and pid follow the seed.

A crash is the process gone: its connections aborted, its tasks cancelled,
its Redis client cut for good (:attr:`World.gone`), its shutdown hook
disarmed, so none of its undos ever reaches Redis. A silo the cluster
declares dead runs the real ``Silo`` path (stop serving, undos without the
leave) and then exits; its supervisor starts a new process in its place, as
after a crash.

**What the checkers read, and where it is recorded.** The linearizability,
deadline and one-way order checks read the callers' and grains' side, as in
every scenario. ``single_writer`` and ``single_activation`` read what Redis
accepted: :class:`RecordingSocket` is the fakeredis server side of every
connection, and around the two scripts that keep those promises (the state
store's write, the directory's register) it reads the keys they guard,
within the same command (fakeredis runs a command whole, under its lock), so
the record is what the script saw. Nothing in the runtime is wrapped: a
mutant of either script is what the checkers see.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import time
from typing import TYPE_CHECKING, Any

import fakeredis
import redis.exceptions

from silo.cluster.directory import _REGISTER, LIVE_STATUSES
from silo.cluster.membership import HEARTBEAT_LUA
from silo.codec import Codec
from silo.environment import Heartbeat, HeartbeatSpec, SiloEnvironment
from silo.keys import Keys
from silo.records.membership import SiloLoad, SiloStatus
from silo.redis_util import redis_errors
from silo.settings import (
    CatalogSettings,
    LogStreamSettings,
    RebalancerSettings,
    RemindersSettings,
    RetentionSettings,
    SiloSettings,
    StreamSettings,
    TransportSettings,
)
from silo.silo import Silo, SiloState
from silo.storage.store import _WRITE
from silo.testing.sim import redis_twin
from silo.testing.sim.grains import WORLD
from silo.testing.sim.loop import SILO
from silo.testing.sim.world import LoopHeartbeat
from silo.testing.transport import InMemoryTransport

if TYPE_CHECKING:
    from silo.messaging.transport import Transport
    from silo.testing.sim.world import World


_GRAIN_IN_KEY = re.compile(rb":g:([^}]+)\}")
"""A grain's id in one of its keys (``rg:{cluster:g:Type/key}:...``)."""


def _sha(script: str | bytes) -> str:
    return hashlib.sha1(script if isinstance(script, bytes) else script.encode()).hexdigest()


class RealRedis:
    """The ``silo`` scenario's Redis: one fakeredis server, a client per process, the recorder."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.server = redis_twin.new_server()
        self.keys = Keys("sim")
        self.scripts = {_sha(_WRITE): "write", _sha(_REGISTER): "register"}
        """Script id -> what :class:`RecordingSocket` records around it (ids of the code as imported:
        a mutant's edited script is recorded as the original would be)."""
        self._write_sha = _sha(_WRITE).encode()

    def client(self, name: str) -> fakeredis.FakeAsyncRedis:
        return redis_twin.client(self.server, name, connection_class=RecordingConnection)

    def owner_of(self, grain: str) -> str | None:
        """The silo the directory names for ``grain`` now (read off the server: no command sent)."""
        item = self.server.dbs[0].get(self.keys.directory_entry(grain).encode())
        silo = None if item is None else item.value.get(b"silo")
        return None if silo is None else bytes(silo).decode()

    def state_write_of(self, command: Any) -> str | None:
        """The grain whose state ``command`` (as redis-py packed it) commits, if it runs the
        store's write script: the link pauses a silo there (the ``pause`` faults' zombie writes)."""
        first = command if isinstance(command, (bytes, bytearray, memoryview)) else (command[0] if command else b"")
        head = bytes(first[:400])
        if self._write_sha not in head[:120]:
            return None
        found = _GRAIN_IN_KEY.search(head)
        return None if found is None else found.group(1).decode()

    async def collect(self) -> dict[str, int]:
        """After the run: how many of each cluster event the silos' event logs wrote (deaths,
        failovers, rebalances...), and ``moved``: activations the rebalancer's orders moved."""
        reader = redis_twin.client(self.server, "checker", linked=False)
        try:
            entries: Any = await reader.xrange(self.keys.events)
        finally:
            await reader.aclose()
        counts: dict[str, int] = {}
        for _, fields in entries:
            kind = fields[b"kind"].decode()
            counts[kind] = counts.get(kind, 0) + 1
            if kind == "rebalance":
                counts["moved"] = counts.get("moved", 0) + int(json.loads(fields[b"data"])["moved"])
        self.world.trace("cluster_events", sorted(counts.items()))
        return counts

    def wrote(self, grain: str, token: int, owner: int) -> None:
        w = self.world
        w.trace("state_written", grain, token)
        w.history.writes.append((w.now(), grain, token, owner))

    def moved(self, grain: str, old: str, new: str, old_live: bool) -> None:
        w = self.world
        w.trace("entry_moved", grain, old, new, old_live)
        w.history.moves.append((w.now(), grain, old, new, old_live))


class RecordingSocket(redis_twin._ScriptShapes):
    """The server side of a connection, noting what the state write and register scripts did
    (see the module docstring); every other command runs as fakeredis runs it."""

    def _process_command(self, fields: list[bytes]) -> None:
        world = WORLD.get(None)
        real = None if world is None else world.real
        kind = None
        if real is not None and len(fields) > 2 and not self._queueing:
            name = fields[0].lower()
            if name == b"evalsha":
                kind = real.scripts.get(fields[1].decode().lower())
            elif name == b"eval":
                kind = real.scripts.get(_sha(fields[1]))
        if real is None or kind is None:
            super()._process_command(fields)
            return
        n = int(fields[2])
        keys, argv = fields[3 : 3 + n], fields[3 + n :]
        if kind == "write":
            # KEYS: head, directory entry, ...; ARGV: expected etag, new etag, token, ...
            before, owner = self._field(keys[0], b"etag"), self._field(keys[1], b"token")
            super()._process_command(fields)
            if before != argv[1] and self._field(keys[0], b"etag") == argv[1]:
                real.wrote(keys[1].decode(), int(argv[2]), int(owner or 0))
            return
        # register. KEYS: entry, ...: who held it, and whether the membership counted them live.
        old_act, old_silo = self._field(keys[0], b"act"), self._field(keys[0], b"silo")
        live = old_silo is not None and self._live(old_silo, real.keys)
        super()._process_command(fields)
        new_act, new_silo = self._field(keys[0], b"act"), self._field(keys[0], b"silo")
        if old_act is not None and new_act is not None and new_act != old_act:
            real.moved(keys[0].decode(), (old_silo or b"").decode(), (new_silo or b"").decode(), live)

    def _field(self, key: bytes, field: bytes) -> bytes | None:
        item = self._db.get(key)
        if item is None or not hasattr(item.value, "get"):
            return None
        value = item.value.get(field)
        return None if value is None else bytes(value)

    def _live(self, silo: bytes, keys: Keys) -> bool:
        row = self._field(keys.members.encode(), silo)
        return row is not None and json.loads(row).get("status") in LIVE_STATUSES


class RecordingConnection(redis_twin.TwinConnection):
    """A twin connection on :class:`RecordingSocket` whose every send passes the sender's link
    (as :class:`~silo.testing.sim.redis_twin.LinkedConnection`), a state write as a ``write``."""

    socket_class = RecordingSocket

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        world = WORLD.get(None)
        if world is not None and world.real is not None:
            link = world.redis_links.get(SILO.get() or "world")
            if link is not None:
                grain = world.real.state_write_of(command)
                what, args = ("redis", ()) if grain is None else ("write", (grain,))
                await link.enter(what, args, error=redis.exceptions.ConnectionError)
        await super().send_packed_command(command, check_health)


class _ScriptTable:
    """The heartbeat thread's one command (its Lua script), through the silo's async client."""

    def __init__(self, spec: HeartbeatSpec) -> None:
        self._spec = spec
        self._script = spec.redis.register_script(HEARTBEAT_LUA)

    async def heartbeat(self, address: str, sent: float, load: SiloLoad) -> SiloStatus | None:
        k = self._spec.keys
        with redis_errors("heartbeat"):
            raw = await self._script(keys=[k.members, k.members_heartbeats, k.members_loads], args=[address, "", load.model_dump_json()])
        status = raw.decode() if isinstance(raw, bytes) else str(raw)
        return None if status == "Gone" else SiloStatus(status)


class SimHeartbeat(LoopHeartbeat):
    """The world's loop heartbeat, beating the heartbeat thread's script through the silo's own
    client; a fenced answer is a disruption, as for the other scenarios' silos
    (:meth:`~silo.testing.sim.world.SimSilo._fenced`): the silo turns calls away and one-way
    calls are sent on again, so their order across it is not promised."""

    def fenced(self) -> bool:
        fenced = super().fenced()
        world = WORLD.get(None)
        if fenced and world is not None:
            disruptions, now = world.history.disruptions, world.now()
            if not disruptions or disruptions[-1] != now:
                disruptions.append(now)
        return fenced


def sim_heartbeat(spec: HeartbeatSpec) -> Heartbeat:
    """The heartbeat of :class:`SiloEnvironment` in the ``silo`` scenario (:class:`SimHeartbeat`)."""
    return SimHeartbeat(_ScriptTable(spec), spec.address, spec.settings, spec.on_dead, spec.monotonic, load=spec.load)


class RealSilo:
    """One simulated silo process whose silo is :class:`silo.silo.Silo` (see the module docstring)."""

    def __init__(self, world: World, index: int, incarnation: int) -> None:
        assert world.real is not None
        self.world = world
        self.index = index
        self.name = f"s{index}.{incarnation}"
        self.context = world.context_for(self.name)
        self.link = world.link_for(self.name)
        self.state = "created"
        self.redis: Any = None
        draws = random.Random(world.seed * 1_000 + incarnation)
        environment = SiloEnvironment(
            redis=self._open_redis,
            transport=self._transport,
            heartbeat=sim_heartbeat,
            handshake=world.handshake,
            monotonic=world.now,
            rng=lambda: random.Random(draws.getrandbits(64)),
            load=lambda activations: SiloLoad(activations=activations),
            hostname=f"sim-{self.name}",
            pid=1_000 + incarnation,
        )
        # time.time looked up at each call: the runner's (the loop's, plus this machine's offset).
        self.silo = Silo(real_settings(world), grains=world.grains_for(index), clock=lambda: time.time(),
                         environment=environment)  # fmt: skip

    @property
    def address(self) -> Any:
        return self.silo.address

    async def _open_redis(self) -> Any:
        assert self.world.real is not None
        self.redis = self.world.real.client(self.name)
        return self.redis

    def _transport(self, settings: TransportSettings, codec: Codec) -> Transport:
        return InMemoryTransport(settings, codec, network=self.world.network)

    async def start(self) -> None:
        self.state = "starting"
        try:
            await self.silo.start()
        except BaseException:
            self.state = "failed"
            raise
        if self.silo.status is SiloState.ACTIVE:
            self.state = "active"
            self.world.spawn("world", self._watch())

    async def _watch(self) -> None:
        """The process exits once its silo stopped on its own: declared dead (or drained)."""
        await self.silo.stopped.wait()
        if self.state != "active":
            return  # stopped or crashed by the world
        self.state = "dead"
        w = self.world
        w.trace("declared_dead", self.name)
        w.history.disruptions.append(w.now())
        # The unwind's last step (its task ending) runs after stopped is set.
        await asyncio.sleep(0.5)
        w.reap(self.name, check=True)
        w.gone.add(self.name)
        w.spawn("world", w.restart_real(self.index, 1.0))

    async def crash(self) -> None:
        """The process is gone: memory, tasks and connections with it, nothing said to Redis."""
        if self.state in ("crashed", "stopped"):
            return
        self.state = "crashed"
        w = self.world
        w.gone.add(self.name)  # whatever it left running never reaches Redis again
        w.loop.drop_held(self.name)
        hook = self.silo._hook
        if hook is not None:
            hook.disarm()  # its task's cancel would stop the silo: undos against Redis
        transport = getattr(self.silo, "transport", None)
        if transport is not None:
            transport.abort_all()
        w.reap(self.name, check=False)
        if self.redis is not None:
            await self.redis.connection_pool.disconnect()

    async def stop(self, *, graceful: bool = True) -> None:
        if self.state != "active":
            return
        self.state = "stopped"
        await self.silo.stop(graceful=graceful)
        # What stop() cancelled last (its shutdown hook's task) ends on the loop's next turn.
        await asyncio.sleep(0)
        self.world.gone.add(self.name)


def real_settings(world: World) -> SiloSettings:
    """The silos' settings: the world's timings, short periods for the services so a run of a
    few simulated seconds sees leases taken and lost, grains moved, reminders polled."""
    sc = world.scenario
    catalog = {k: v for k, v in (("max_queue", sc.max_queue), ("idle_timeout_s", sc.idle_timeout_s)) if v is not None}
    return SiloSettings(
        redis_url="redis://sim-twin:6379/0",
        cluster="sim",
        host="127.0.0.1",
        advertise_host="127.0.0.1",
        port=0,
        device="cpu",
        transport=world.transport_settings,
        membership=world.membership_settings,
        catalog=CatalogSettings(**catalog),
        rebalancer=RebalancerSettings(period_s=1.0, lease_ttl_s=3.0, max_moves_per_period=2, tolerance=0.2),
        reminders=RemindersSettings(poll_interval_s=0.2, idle_poll_s=5.0, delivery_timeout_s=3.0),
        streams=StreamSettings(
            maxlen=None, lease_s=3.0, discover_interval_s=0.5, block_ms=500, delivery_timeout_s=3.0, retention_interval_s=2.0
        ),
        retention=RetentionSettings(dead_silo_s=5.0, period_s=2.0),
        logs=LogStreamSettings(enabled=False),
        stats_interval_s=1.0,
        stats_idle_interval_s=2.0,
    )

