"""One simulated cluster: silos, clients, the Redis twins and the network, driven by one seed.

A :class:`World` is built inside a :class:`~silo.testing.sim.loop.SimLoop`
and runs a :class:`Scenario`: it starts the silos and clients, lets the
clients call grains for ``duration_s`` of virtual time while the fault plan
(drawn from the seed before the run, so a replay can drop faults one by one)
crashes, pauses, partitions and slows parts of it, then heals every fault,
reads every register once more, stops what still runs, and hands its
:class:`~silo.testing.sim.checks.History` to the checkers.

What each part is:

* **Silos** (:class:`SimSilo`) are :class:`~silo.testing.harness.InProcessSilo`
  on the network, the silo wiring the harness shares with ``silo/silo.py``
  (the real catalog, router, dispatcher, membership view, manifests,
  placement, idle collection), plus the real
  :class:`~silo.cluster.failure_detector.FailureDetector` (ring monitors,
  probes over the transport, votes) and a loop-driven heartbeat standing in
  for the heartbeat thread (:class:`LoopHeartbeat`: the same fencing rule,
  on the loop, since a thread cannot run on virtual time). Each silo's code
  runs in a context naming it (:data:`~silo.testing.sim.loop.SILO`), which
  is how the loop pauses one silo and the network knows who is talking.
  In the ``silo`` scenario each silo is :class:`silo.silo.Silo` itself
  (:class:`~silo.testing.sim.silos.RealSilo`, on a fakeredis server for
  everything Redis holds; :mod:`silo.testing.sim.silos`).
* **Clients** (:class:`SimClient`) are what ``ClusterClient`` builds: a
  router, a membership view and a transport, no grains.
* **Redis** is the twins (:mod:`silo.testing.directory`,
  :mod:`silo.testing.membership`, :mod:`silo.testing.store`), shared by all,
  each silo reaching them through a :class:`RedisLink` that adds a latency
  drawn from the seed, can be cut (a partition from Redis: ``StorageError``,
  as ``redis_errors`` raises), and counts commands. In scenarios with
  failovers the twins are a master with a replica
  (:class:`~silo.testing.sim.replication.Replication`): the link follows
  registrations and state writes with ``WAIT``, and a failover loses what the
  replica did not have yet.
* **Wall clocks.** ``time.time`` reads the loop's time plus the offset of
  the machine of the silo whose code runs (``clock_jump`` faults move it;
  ``time.monotonic`` never jumps).
* **The network** is :class:`~silo.testing.transport.InMemoryNetwork` with
  this world as its :class:`~silo.testing.transport.Links`: a delay per
  message drawn from the seed (order per connection kept), and cuts between
  two silos (bytes wait until the cut heals; new connections time out).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import inspect
import logging
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from grains import Grain, ObserverRef
from grains.ids import GrainId, SiloAddress
from grains.observer import CLIENT_PREFIX
from silo import errors
from silo.catalog.runtime import RefFactory
from silo.cluster.directory import DirectoryEntry, RedisGrainDirectory
from silo.cluster.failure_detector import (
    FailureDetector,
    HeartbeatStatistics,
    Liveness,
    ProbeResult,
    transport_probe,
    wait_event,
)
from silo.cluster.membership import RedisMembershipTable
from silo.cluster.placement import Placer
from silo.cluster.view import MembershipView
from silo.codec import Codec, TypeRegistry
from silo.messaging.manifests import Manifests, TypeInfo
from silo.messaging.observer_hub import ObserverHub
from silo.messaging.router import Router
from silo.records.membership import SiloLoad, SiloStatus
from silo.settings import CatalogSettings, MembershipSettings, TransportSettings
from silo.testing.directory import InMemoryGrainDirectory
from silo.testing.harness import InProcessSilo, PublishedManifests
from silo.testing.membership import InMemoryMembershipTable
from silo.testing.sim.checks import History, Op, StreamOp
from silo.testing.sim.grains import (
    RESULT_GRAINS,
    SERVICE_GRAINS,
    SIM_GRAINS,
    WORLD,
    SimCounter,
    SimLog,
    SimRegister,
    SimRoom,
    SimVersionedV1,
    SimVersionedV2,
)
from silo.testing.sim.loop import SILO, SimLoop
from silo.testing.sim.replication import MUTATIONS, WAITED, WINDOW_S, Replication
from silo.testing.store import InMemoryStateStore
from silo.testing.transport import InMemoryNetwork, InMemoryTransport, _Pipe

if TYPE_CHECKING:
    from silo.testing.sim.services import Services
    from silo.testing.sim.silos import RealRedis, RealSilo

log = logging.getLogger("redgrain.sim")

T = TypeVar("T")

CLOCK_RESOLUTION_S = 1e-9
"""asyncio runs a timer due within this of now at once (the monotonic clock's resolution)."""

ZOMBIE_KEY = "zreg"
"""The register the zombie workload writes (scenarios with pauses): see :meth:`World._drive_zombie_target`."""
ZOMBIE_GRAIN = f"SimRegister/{ZOMBIE_KEY}"

FAULT_KINDS = ("crash", "pause", "partition", "redis_cut", "slow_net", "reset", "slow_activation", "failover", "clock_jump")


@dataclass(frozen=True, slots=True)
class Scenario:
    """What one seed runs: the cluster, the workload, and which faults the plan may draw."""

    name: str
    silos: int = 3
    clients: int = 3
    registers: int = 3
    logs: int = 2
    duration_s: float = 20.0
    faults: tuple[str, ...] = ()
    max_faults: int = 4
    call_timeout_s: float = 5.0
    max_queue: int | None = None
    idle_timeout_s: float | None = None
    """Short idle timeouts make activations come and go under load."""
    wait_replicas: int = 1
    """``WAIT`` after registrations and state writes, as on a Sentinel URL (scenarios with failovers)."""

    @property
    def zombie(self) -> bool:
        """Whether the zombie workload runs: one writer on its own register, aimed at by the first long pause."""
        return "pause" in self.faults
    versions: int = 0
    """Registers of a type two versions of which run side by side, as in a rolling upgrade:
    every silo starts on version 1 (it knows the value only) and comes back from a restart on
    version 2 (a tag too, and the methods to use it); silo 1 is restarted on purpose early on."""
    results: int = 0
    """Grains whose streamed results (an async-generator method) the clients also iterate,
    leaving some streams early."""
    services: bool = False
    """Silos also run reminders and stream delivery on a command-level Redis twin (sim/services.py)."""
    settle_s: float = 8.0
    """Virtual time after the faults heal before the final reads (deaths declared, views refreshed)."""
    in_rotation: bool = True
    """Whether seeds cycle through it when no scenario is named (False: only by name)."""
    real: bool = False
    """Every silo is :class:`silo.silo.Silo` on a command-level Redis twin (sim/silos.py)."""


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("calls"),
        Scenario("churn", idle_timeout_s=0.3),
        # Mailboxes of 2 with slow activations: silos shed load (LoadShedError), calls retry.
        Scenario("shed", max_queue=2, logs=1, clients=4),
        Scenario("crash", faults=("crash", "slow_activation", "slow_net", "clock_jump")),
        Scenario("pause", faults=("pause",), max_faults=2),
        Scenario("partition", faults=("partition", "redis_cut", "reset")),
        Scenario("failover", faults=("failover", "pause", "crash"), max_faults=4),
        Scenario("mixed", faults=FAULT_KINDS, max_faults=6),
        # Out of the rotation: a new name would move every seed of the others to another
        # scenario. Settles longer, so the checkers see reminders and timers tick again after
        # the last fault's recovery (checks.RECOVERY_S).
        Scenario("services", clients=2, registers=2, logs=1, faults=("crash", "pause", "partition", "redis_cut"),
                 services=True, settle_s=20.0, in_rotation=False),
        # Streamed results beside the registers and logs, across the faults that cut a stream
        # short: its caller or callee crashed, paused or cut off, its connection reset.
        Scenario("results", registers=2, logs=1, results=2, faults=("crash", "pause", "partition", "reset", "slow_net"),
                 in_rotation=False),
        # A rolling upgrade that stays half done: calls the old version lacks move the grain
        # forward, calls both have land on either, and neither may lose what the other wrote.
        # Its crashes are upgrades too (a silo comes back on version 2).
        Scenario("versions", registers=1, logs=1, versions=2, faults=("crash", "pause", "partition"), in_rotation=False),
        # The production Silo class, every stage and service of it, on one fakeredis (decision 112).
        # Its "restart" is a graceful one (stop(): the hand-off, then the leave; a new process).
        Scenario("silo", registers=4, logs=2, faults=("crash", "pause", "partition", "redis_cut", "restart"), real=True,
                 settle_s=10.0, in_rotation=False),
        # The same with stops that skip the hand-off (stop(graceful=False): what a test fixture
        # and a loop's shutdown do): activations dropped in memory, none of them, their timers or
        # turns, left running past the stop (a CI run found a serving grain's poll timer ticking on).
        Scenario("stops", registers=4, logs=2, faults=("crash", "pause", "stop", "restart"), real=True,
                 settle_s=10.0, in_rotation=False),
    )
}


@dataclass(frozen=True, slots=True)
class Fault:
    at: float
    kind: str
    target: int
    """Index of the silo it strikes (``partition``: the first of the two)."""
    other: int = 0
    length_s: float = 0.0

    def __str__(self) -> str:
        peer = f"<->s{self.other}" if self.kind == "partition" else ""
        return f"{self.kind}(s{self.target}{peer}, {self.length_s:.2f}s)@{self.at:.2f}"


def plan_faults(rng: random.Random, scenario: Scenario) -> list[Fault]:
    """The faults of one run, drawn before it starts (a replay may keep any subset)."""
    if not scenario.faults:
        return []
    out = []
    for _ in range(rng.randint(1, scenario.max_faults)):
        kind = rng.choice(scenario.faults)
        at = rng.uniform(1.0, scenario.duration_s * 0.8)
        target = rng.randrange(scenario.silos)
        other = (target + rng.randrange(1, scenario.silos)) % scenario.silos
        # Most pauses outlast dead_after_s (4 s): the silo comes back as a zombie.
        pause = rng.uniform(0.5, 3.0) if rng.random() < 0.3 else rng.uniform(4.5, 9.0)
        # clock_jump: by how much the silo's wall clock (time.time) jumps, back or forward.
        jump = rng.choice((-1, 1)) * rng.uniform(2.0, 60.0)
        length = {"pause": pause, "failover": rng.uniform(1.0, 3.0), "clock_jump": jump, "partition": rng.uniform(0.5, 8.0), "redis_cut": rng.uniform(0.5, 6.0),
                  "slow_net": rng.uniform(1.0, 6.0), "slow_activation": rng.uniform(1.0, 6.0)}.get(kind, 0.0)  # fmt: skip
        out.append(Fault(round(at, 3), kind, target, other, round(length, 3)))
    return sorted(out, key=lambda f: (f.at, f.kind, f.target))


# --- Redis ------------------------------------------------------------------------------


class RedisLink:
    """One silo's (or client's) way to the Redis twins: latency, cuts, command counts."""

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.commands = 0
        world.redis_links[name] = self

    async def enter(self, what: str, args: tuple[Any, ...] = (), *, error: type[Exception] = errors.StorageError) -> None:
        world = self.world
        self.commands += 1
        world.commands += 1
        slow = what in ("write", "write_stream", "clear")
        if world.latency:
            # A state write carries the state and waits for a replica: slower than a lookup.
            await asyncio.sleep(world.net_rng.uniform(0.002, 0.03) if slow else world.net_rng.uniform(0.0002, 0.002))
        armed = world.pause_at_write.get(self.name) if slow else None
        if armed is not None and (armed[1] is None or (args and str(args[0]) == armed[1])):
            # A pause at the worst moment (a GC pause just as a state write leaves): the
            # write lands when the silo goes on, by then perhaps as a zombie's.
            del world.pause_at_write[self.name]
            world.pause_now(self.name, armed[0], zombie_write=armed[1])
            await asyncio.sleep(0)
        if self.name in world.redis_cut:
            raise error(f"{what}: Redis unreachable (simulated partition of {self.name})")
        if self.name in world.gone:
            raise error(f"{what}: the process {self.name} is gone (crashed or exited)")
        if world.redis_down:
            raise error(f"{what}: Redis unreachable (simulated failover: no master yet)")

    def wrap(self, target: Any) -> Any:
        return _Gated(target, self)


class _Gated:
    """``target`` with every coroutine method passing through a :class:`RedisLink` first."""

    def __init__(self, target: Any, link: RedisLink) -> None:
        self._target = target
        self._link = link

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        link = self._link

        async def gated(*args: Any, **kwargs: Any) -> Any:
            await link.enter(name, args)
            result = await attr(*args, **kwargs)
            replication = link.world.replication
            if replication is not None and name in MUTATIONS:
                at = replication.wrote()
                if name in WAITED and (name != "register" or result.activation_id == args[2]):
                    await replication.wait(at, str(args[0]))
            return result

        return gated


class RecordingDirectory(InMemoryGrainDirectory):
    """The directory twin, recording each registration that changed a grain's owner."""

    def __init__(self, world: World, is_alive: Callable[[SiloAddress], bool]) -> None:
        super().__init__(is_alive)
        self._world = world

    async def register(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> DirectoryEntry:
        before = self.entries().get(grain)
        live = before is not None and self._world.membership.is_alive(before.silo)
        entry = await super().register(grain, silo, activation_id)
        if before is not None and entry.activation_id != before.activation_id:
            self._world.history.moves.append((self._world.now(), str(grain), str(before.silo), str(entry.silo), live))
        return entry


class RecordingMembership(InMemoryMembershipTable):
    """The membership twin, noting when each silo's row turned Dead."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self.dead_at: dict[str, float] = {}

    def _change_status(self, address: str, status: SiloStatus) -> None:
        super()._change_status(address, status)
        if status is SiloStatus.DEAD:
            self.dead_at.setdefault(address, self.clock())


class RecordingStore(InMemoryStateStore):
    """The state twin, recording the fencing token of each write it accepted."""

    def __init__(self, world: World, owner: Callable[[GrainId], int]) -> None:
        super().__init__(owner=owner)
        self._world = world

    async def write_stream(self, grain: GrainId, parts: list[memoryview], etag: str | None, token: int, **kw: Any) -> str:
        etag_out = await super().write_stream(grain, parts, etag, token, **kw)
        # The directory's token now: the activation the directory names is the only one that may write.
        self._world.history.writes.append((self._world.now(), str(grain), token, self._world.directory.token_of(grain)))
        return etag_out


# --- silos and clients --------------------------------------------------------------------


class LoopHeartbeat(Liveness):
    """The heartbeat thread's job on the loop (see the module docstring): the same lease, doubt
    and fencing rule (:class:`~silo.cluster.failure_detector.Liveness`), beats when it says;
    told Dead, call ``on_dead``."""

    def __init__(self, table: Any, address: str, settings: MembershipSettings, on_dead: Callable[[], Any], clock: Callable[[], float],
                 load: Callable[[], SiloLoad] = SiloLoad) -> None:  # fmt: skip
        self._table, self._address, self._on_dead, self._load = table, address, on_dead, load
        self._init_liveness(settings, clock)
        self.beats = self.failures = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def _wake_beat(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self.last_confirmed = self._monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        tick = min(self._settings.heartbeat_s, self._silence_s / 4)
        while True:
            wait = self.next_beat(self._monotonic(), self.beats + self.failures == 0)
            # A wait within the loop's clock resolution ends on the same virtual instant (asyncio
            # runs such a timer at once): it would spin; the thread's real clock moves on instead.
            if wait > CLOCK_RESOLUTION_S:
                await wait_event(self._wake, min(wait, tick))
                self._wake.clear()
                continue
            sent = self._monotonic()
            self.beat_sent(sent)
            try:
                status = await self._table.heartbeat(self._address, sent, self._load())
            except errors.StorageError:
                self.failures += 1
            else:
                if status in (SiloStatus.DEAD, None):
                    self.dead = True
                    self._on_dead()
                    return
                self.beats += 1
                self.beat_confirmed(sent)

    def statistics(self) -> HeartbeatStatistics:
        return HeartbeatStatistics(
            beats=self.beats, failures=self.failures, last_confirmed_age_s=self._monotonic() - self.last_confirmed,
            fenced=self.fenced(), in_doubt=self.doubt_since is not None,
        )  # fmt: skip


class SimSilo:
    """One simulated silo process (see the module docstring)."""

    def __init__(self, world: World, index: int, generation: int) -> None:
        self.world = world
        self.index = index
        self.name = f"s{index}.{generation}"
        self.context = world.context_for(self.name)
        self.link = RedisLink(world, self.name)
        self.state = "created"
        self.context.run(self._build, generation)

    def _build(self, generation: int) -> None:
        w = self.world
        sc = w.scenario
        catalog = CatalogSettings(
            **{k: v for k, v in (("max_queue", sc.max_queue), ("idle_timeout_s", sc.idle_timeout_s),
                                 ("collection_interval_s", 0.5 if sc.idle_timeout_s else None)) if v is not None}
        )  # fmt: skip
        address = SiloAddress("127.0.0.1", w.network.free_port(), generation)
        self.heartbeat = LoopHeartbeat(
            self.link.wrap(w.membership), str(address), w.membership_settings, self._declared_dead, w.now
        )
        services: dict[str, Any] = {}
        self.redis: Any = None
        if w.services is not None:
            self.redis = w.services.client(self.name)
            services = {"redis": self.redis, "keys": w.services.keys, "reminders": w.services.reminders,
                        "streams": w.services.streams}  # fmt: skip
        self.silo = InProcessSilo(
            w.grains_for(self.index),
            clock=w.now,
            settings=catalog,
            directory=self.link.wrap(w.directory),
            store=self.link.wrap(w.store),
            address=address,
            call_timeout_s=sc.call_timeout_s,
            network=w.network,
            membership=self.link.wrap(w.membership),
            published=w.published,
            transport_settings=w.transport_settings,
            placer=Placer(random.Random(w.seed * 1_000 + self.index)),
            refresh_s=w.membership_settings.refresh_s,
            fenced=self._fenced,
            confirm_alive=self.heartbeat.confirm,
            wall_clock=lambda: w.now() + w.wall_offset(self.name),
            **services,
        )
        self.address = address
        assert self.silo.transport is not None
        self.detector = FailureDetector(
            table=self.link.wrap(w.membership),
            me=address,
            settings=w.membership_settings,
            probe=transport_probe(
                self.silo.transport, handshake=w.handshake, sender=lambda: None if self.heartbeat.fenced() else str(address)
            ),
            on_self_dead=self._declared_dead,
            clock=w.now,
            on_monitors=self.heartbeat.watch_monitors,
        )
        self.silo.transport.on_probe(self.heartbeat.probed)

    def _fenced(self) -> bool:
        fenced = self.heartbeat.fenced()
        if fenced:
            # A fenced silo turns calls away and sends its one-way calls on again: the order
            # of calls across that is not promised (docs/concepts.md, "Order").
            disruptions = self.world.history.disruptions
            now = self.world.now()
            if not disruptions or disruptions[-1] != now:
                disruptions.append(now)
        return fenced

    async def start(self) -> None:
        await self.silo.start()
        self.heartbeat.start()
        self.detector.start()
        self.state = "active"

    def _declared_dead(self) -> None:
        # A silo told it is dead exits (the CLI's exit code 3): as a crash from here on.
        if self.state == "active":
            self.world.trace("declared_dead", self.name)
            if self.world.services is not None:
                self.world.services.window(0.0)
            self.state = "dying"
            self.world.spawn(self.name, self.crash())

    async def crash(self) -> None:
        """The process is gone: memory, tasks and connections with it."""
        if self.state in ("crashed", "stopped"):
            return
        self.state = "crashed"
        await self.silo.kill()
        await self.detector.stop()
        await self.heartbeat.stop()
        self.world.reap(self.name, check=False)

    async def stop(self) -> None:
        if self.state != "active":
            return
        self.state = "stopped"
        await self.detector.stop()
        await self.heartbeat.stop()
        await self.silo.stop()
        if self.redis is not None:
            await self.redis.aclose()


class _Notes:
    """A client's observer handler: records what it was told."""

    def __init__(self, world: World, client: str) -> None:
        self._world = world
        self._client = client

    async def on_note(self, seq: int) -> str:
        self._world.trace("note", self._client, seq)
        self._world.history.notes.append((self._client, seq))
        return self._client


class SimClient:
    """What ``ClusterClient`` builds, on the twins: router, view, manifests, transport."""

    def __init__(self, world: World, index: int) -> None:
        self.world = world
        self.name = f"c{index}"
        self.context = world.context_for(self.name)
        self.link = RedisLink(world, self.name)
        self.context.run(self._build)

    def _build(self) -> None:
        w = self.world
        registry = TypeRegistry()
        for cls in w.grains:
            registry.register_annotations(cls)
        codec = Codec(registry)
        self.redis: Any = None if w.services is None else w.services.client(self.name)
        self.transport = InMemoryTransport(w.transport_settings, codec, network=w.network)
        directory: Any
        self.manifests: Any
        if w.real is not None:
            # As ClusterClient builds them, on the scenario's Redis.
            self.redis = w.real.client(self.name)
            keys = w.real.keys
            self.view = MembershipView(RedisMembershipTable(self.redis, keys), redis=self.redis, keys=keys,
                                       refresh_s=w.membership_settings.refresh_s)  # fmt: skip
            directory = RedisGrainDirectory(self.redis, keys, cache_size=0)
            self.manifests = Manifests(self.redis, keys)
        else:
            self.view = MembershipView(self.link.wrap(w.membership), refresh_s=w.membership_settings.refresh_s)
            directory = self.link.wrap(w.directory)
            self.manifests = PublishedManifests(w.published, w.now)
        self.router = Router(
            transport=self.transport,
            directory=directory,
            view=self.view,
            manifests=self.manifests,
            placer=Placer(random.Random(w.seed * 1_000 + 500 + int(self.name[1:]))),
            call_timeout_s=w.scenario.call_timeout_s,
            # Streams of up to 12 items outrun a window of 4: a caller that leaves one early
            # finds its generator waiting for credit, which only its CANCEL ends.
            stream_window=4,
        )
        self.refs = RefFactory(self.router, self.manifests, codec)
        # As ClusterClient wires it: observers answer on the connections this client opened. Only
        # where the workload uses them: a handler changes how the client's connections start,
        # and with it every other scenario's trace (the seeds the mutant tests rely on).
        self.observers: ObserverHub | None = None
        if w.scenario.results:
            self.observers = ObserverHub(owner=CLIENT_PREFIX + self.name, codec=codec, transport=self.transport,
                                         call_timeout_s=w.scenario.call_timeout_s)  # fmt: skip
            self.transport.set_handler(self.observers.on_frame)
        self.observer: ObserverRef | None = None

    def observe(self) -> ObserverRef:
        """This client's observer for ``SimRoom`` (made once): it records each notification."""
        assert self.observers is not None, "observers are wired in the results scenario only"
        if self.observer is None:
            self.observer = self.observers.create(_Notes(self.world, self.name))
            self.transport.identify_as(self.name)
        return self.observer

    async def start(self) -> None:
        await self.view.start()
        await self.manifests.refresh()

    async def stop(self) -> None:
        await self.view.stop()
        if self.observers is not None:
            self.observers.close()
        await self.transport.close()
        if self.redis is not None:
            await self.redis.aclose()


# --- the world ------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one seed's run came to."""

    seed: int
    scenario: str
    violation: Any
    digest: str
    events: int
    faults: list[Fault] = field(default_factory=list)
    calls: int = 0
    virtual_s: float = 0.0
    failovers: int = 0
    lost_acknowledged: int = 0
    """Acknowledged writes or registrations a failover lost, each acknowledged short of its replica."""
    cluster_events: dict[str, int] = field(default_factory=dict)
    """The ``silo`` scenario: cluster events the silos wrote, by kind (``moved``: activations
    the rebalancer moved)."""


class World:
    """One seed's cluster (see the module docstring)."""

    def __init__(self, seed: int, scenario: Scenario, loop: SimLoop, *, faults: list[Fault] | None = None) -> None:
        self.seed = seed
        self.scenario = scenario
        self.loop = loop
        master = random.Random(seed)
        self.work_rng = random.Random(master.getrandbits(64))
        self.net_rng = random.Random(master.getrandbits(64))
        fault_rng = random.Random(master.getrandbits(64))
        replication_rng = random.Random(master.getrandbits(64))
        planned = plan_faults(fault_rng, scenario)
        self.faults = planned if faults is None else faults
        self.history = History(faults=len(self.faults))
        self._trace = hashlib.sha256()
        self.events = 0
        self.commands = 0
        self.latency = True
        self.redis_links: dict[str, RedisLink] = {}
        """Process name -> its link to Redis (the command-level twin finds the sender's here)."""
        self.grains: list[type[Grain]] = list(SIM_GRAINS)
        self.services: Services | None = None
        if scenario.services:
            from silo.testing.sim.services import Services  # fakeredis: a development dependency

            self.services = Services(self)
            self.grains += SERVICE_GRAINS
        if scenario.results:
            self.grains += RESULT_GRAINS
        if scenario.versions:
            self.grains.append(SimVersionedV2)
        self.real: RealRedis | None = None
        if scenario.real:
            from silo.testing.sim.silos import RealRedis  # fakeredis: a development dependency

            self.real = RealRedis(self)
        self.gone: set[str] = set()
        """Processes that crashed or exited: their Redis links refuse every command from now on."""
        self._stopping = False
        self._notes = 0
        self._upgraded: set[int] = set()
        """Silos restarted at least once: on the new version in ``versions``."""
        self._generators: dict[str, tuple[str | None, bool]] = {}
        """Stream -> (the silo its generator runs on, whether it ended)."""
        self.membership_settings = MembershipSettings(probe_interval_s=0.25)
        self.transport_settings = TransportSettings(call_timeout_s=scenario.call_timeout_s, local_sockets=False, connect_timeout_s=1.0)
        self.membership = RecordingMembership(self.now)
        self.membership_dead_at = self.membership.dead_at
        self.directory = RecordingDirectory(self, self.membership.is_alive)
        self.store = RecordingStore(self, owner=self.directory.token_of)
        self.network = InMemoryNetwork(links=self)
        self.replication = (
            Replication(self.directory, self.membership, self.store, replication_rng, self.now, wait_replicas=scenario.wait_replicas)
            if "failover" in scenario.faults
            else None
        )
        """The replica and its failover (scenarios with failovers; elsewhere Redis never fails over)."""
        self.redis_down = False
        self.wall_offsets: dict[int, float] = {}
        """Silo index -> how far its machine's wall clock is off (clock_jump faults; monotonic is not)."""
        self.published: dict[str, dict[int, TypeInfo]] = {}
        self.base = contextvars.copy_context()
        self.base.run(WORLD.set, self)
        self.silos: list[Any] = []
        """SimSilo, or RealSilo in the ``silo`` scenario."""
        self.clients: list[SimClient] = []
        self.redis_cut: set[str] = set()
        self.pause_at_write: dict[str, tuple[float, str | None]] = {}
        """Silo -> (pause length, grain or None: any): pause it when it next writes that grain's
        state (armed by a "pause" fault)."""
        self.zombie_pending: str | None = None
        """The silo paused just as its write to :data:`ZOMBIE_KEY` left, until it goes on."""
        self._aimed = False
        self.cuts: set[frozenset[str]] = set()
        self.slow_links = 0
        self.slow_activations = 0
        self._incarnations = 0
        self._tasks: dict[str, set[asyncio.Task[Any]]] = {}
        self._values = 0

    # --- for the parts ---------------------------------------------------------------
    def now(self) -> float:
        return self.loop.time()

    def wall_offset(self, name: str | None = None) -> float:
        """How far the wall clock of ``name``'s machine (default: the silo whose code runs) is off."""
        name = SILO.get() if name is None else name
        if not name or not name.startswith("s"):
            return 0.0
        return self.wall_offsets.get(int(name[1:].partition(".")[0]), 0.0)

    def context_for(self, name: str) -> contextvars.Context:
        ctx = self.base.copy()
        ctx.run(SILO.set, name)
        return ctx

    def trace(self, kind: str, *details: Any) -> None:
        self.events += 1
        self._trace.update(repr((round(self.now(), 6), kind, details)).encode())

    def record(self, kind: str, *details: Any) -> None:
        self.trace(kind, *details)

    def next_incarnation(self) -> int:
        self.history.disruptions.append(self.now())
        self._incarnations += 1
        return self._incarnations

    def applied(self, grain: str, incarnation: int, sender: str, seq: int) -> None:
        self.trace("applied", grain, incarnation, sender, seq)
        self.history.applied.append((grain, incarnation, sender, seq))
        self.history.applied_at.append(self.now())

    def grains_for(self, index: int) -> list[type[Grain]]:
        """The grain classes silo ``index`` hosts: in ``versions``, the old version until it restarts."""
        if self.scenario.versions and index not in self._upgraded:
            return [SimVersionedV1 if cls is SimVersionedV2 else cls for cls in self.grains]
        return self.grains

    def generator_started(self, stream: str) -> None:
        self.trace("generator_started", stream)
        self._generators[stream] = (SILO.get(), False)

    def generator_ended(self, stream: str) -> None:
        self.trace("generator_ended", stream)
        self._generators[stream] = (SILO.get(), True)

    def leave_after_turn(self) -> bool:
        return self.scenario.idle_timeout_s is not None and self.work_rng.random() < 0.15

    def activation_delay(self) -> float:
        if self.slow_activations:
            return self.work_rng.uniform(0.5, 3.0)
        return self.work_rng.uniform(0.0, 0.01)

    def spawn(self, owner: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        ctx = self.base if owner == "world" else self._context_of(owner)
        return self.loop.create_task(coro, context=ctx.copy())

    def _context_of(self, owner: str) -> contextvars.Context:
        parts: list[SimSilo | SimClient] = [*self.silos, *self.clients]
        for part in parts:
            if part.name == owner:
                return part.context
        raise KeyError(owner)

    def reap(self, owner: str, *, check: bool) -> None:
        """After ``owner`` stopped: its tasks still running are leaks (``check``) or, for a crash, gone."""
        for task in self.loop.tasks_of(owner):
            if _redis_side(task):
                # fakeredis' wait for a blocking read the silo sent: Redis' work, not the silo's
                # (it ends at the read's timeout); made in the sender's context, so listed under it.
                task.cancel()
                continue
            if check:
                self.history.leaks.append((owner, repr(task.get_coro())))
            task.cancel()
        if check:
            for context, local, remote in self.network.open_ends():
                if context.get(SILO) == owner:
                    self.history.open_connections.append((owner, f"{local} -> {remote}"))

    # --- Links (the network's conditions) -----------------------------------------------
    def delay(self, sender: _Pipe, receiver: _Pipe) -> float | None:
        a, b = sender.context.get(SILO), receiver.context.get(SILO)
        if frozenset((_proc(a), _proc(b))) in self.cuts:
            return None
        if self.slow_links:
            return self.net_rng.expovariate(1 / 0.05)
        return self.net_rng.choice((0.0, 0.0, 0.0005, 0.002))

    def connectable(self, connector: contextvars.Context, endpoint: str) -> bool:
        owner = self._owner_of(endpoint)
        return frozenset((_proc(connector.get(SILO)), _proc(owner))) not in self.cuts

    async def handshake(self, endpoint: str, timeout_s: float) -> ProbeResult:
        """The failure detector's bare TCP handshake, on this network."""
        if not self.network.is_listening(endpoint):
            return ProbeResult.REFUSED
        if not self.connectable(contextvars.copy_context(), endpoint):
            await asyncio.sleep(timeout_s)
            return ProbeResult.UNREACHABLE
        return ProbeResult.TIMEOUT

    def _owner_of(self, endpoint: str) -> str | None:
        for s in self.silos:
            if s.address is not None and s.address.endpoint == endpoint:
                return s.name
        return None

    # --- the run ---------------------------------------------------------------------------
    async def run(self) -> Outcome:
        sc = self.scenario
        for i in range(sc.silos):
            if self.real is not None:
                await self.add_real_silo(i)
            else:
                await self.add_silo(i)
        for i in range(sc.clients):
            client = SimClient(self, i)
            self.clients.append(client)
            await self.spawn(client.name, client.start())
        self.trace("started", [s.name for s in self.silos])
        end = self.now() + sc.duration_s
        drivers = [self.spawn(c.name, self._drive(c, end)) for c in self.clients]
        if sc.zombie:
            drivers.append(self.spawn(self.clients[0].name, self._drive_zombie_target(self.clients[0], end)))
        if self.services is not None:
            drivers.append(self.spawn(self.clients[0].name, self.services.drive(self.clients[0], end)))
        if sc.versions:
            drivers.append(self.spawn("world", self._upgrade(1, at=self.now() + 4.0)))
        injector = self.spawn("world", self._inject(end))
        await asyncio.gather(*drivers, injector)
        await self._heal()
        # Let the cluster settle (deaths declared, views refreshed), then read every register once.
        await asyncio.sleep(sc.settle_s)
        keys = [f"reg{k}" for k in range(sc.registers)] + ([ZOMBIE_KEY] if sc.zombie else [])
        reads = [self.spawn(self.clients[0].name, self._final_read(k)) for k in keys]
        reads += [self.spawn(self.clients[0].name, self._call(self.clients[0], f"ver{k}", method, None))
                  for k in range(sc.versions) for method in ("read", "read_tag")]  # fmt: skip
        await asyncio.gather(*reads)
        if self.services is not None:
            await self.spawn("world", self.services.collect())
        cluster_events = {} if self.real is None else await self.spawn("world", self.real.collect())
        self.history.generators_left = self._generators_left()
        await self._stop_all()
        from silo.testing.sim.checks import check, lost_acknowledged

        if self.replication is not None:
            self.history.failovers = [lost.at for lost in self.replication.failovers]
            self.history.short_writes = list(self.replication.short_writes)
        violation = check(self.history)
        return Outcome(
            self.seed, sc.name, violation, self._trace.hexdigest(), self.events, list(self.faults),
            len(self.history.ops), self.now() - 1_000.0, len(self.history.failovers), len(lost_acknowledged(self.history)),
            cluster_events,
        )  # fmt: skip

    async def add_silo(self, index: int) -> SimSilo:
        generation = await self.membership.new_generation()
        if self.replication is not None:
            self.replication.wrote()
        if index < len(self.silos):
            self._upgraded.add(index)
        silo = SimSilo(self, index, generation)
        if index < len(self.silos):
            self.silos[index] = silo
        else:
            self.silos.append(silo)
        await self.spawn(silo.name, silo.start())
        self.trace("silo_started", silo.name)
        return silo

    def link_for(self, name: str) -> RedisLink:
        return RedisLink(self, name)

    async def add_real_silo(self, index: int) -> RealSilo:
        """Start a new process running :class:`silo.silo.Silo` as silo ``index`` (sim/silos.py)."""
        from silo.testing.sim.silos import RealSilo

        self._incarnations += 1
        silo = RealSilo(self, index, self._incarnations)
        if index < len(self.silos):
            self.silos[index] = silo
        else:
            self.silos.append(silo)
        try:
            await self.spawn(silo.name, silo.start())
        except errors.RedgrainError:
            # A failed start unwound what it did; nothing of it may be left running.
            self.reap(silo.name, check=True)
            self.gone.add(silo.name)
            raise
        self.trace("silo_started", silo.name)
        return silo

    async def _restart(self, index: int, *, graceful: bool) -> None:
        """Stop silo ``index`` through ``Silo.stop()`` (graceful: the hand-off first; then the
        leave) and start a new process."""
        silo = self.silos[index]
        await self.spawn(silo.name, silo.stop(graceful=graceful))
        self.reap(silo.name, check=True)
        await self.restart_real(index, 0.5)

    async def restart_real(self, index: int, delay: float) -> None:
        """A supervisor starting silo ``index`` again after its process ended, until one start succeeds."""
        await asyncio.sleep(delay)
        while not self._stopping:
            try:
                await self.add_real_silo(index)
                return
            except errors.RedgrainError as exc:
                self.trace("start_failed", index, type(exc).__name__)
                await asyncio.sleep(1.0)

    async def _drive(self, client: SimClient, end: float) -> None:
        rng = random.Random(self.work_rng.getrandbits(64))
        sc = self.scenario
        seq = 0
        while self.now() < end:
            roll = rng.random()
            if sc.versions and roll >= 0.6:
                key = f"ver{rng.randrange(sc.versions)}"
                method = rng.choice(("write", "read", "write", "read", "write_tag", "read_tag"))
                self._values += 1
                await self._call(client, key, method, self._values if method.startswith("write") else None)
            elif sc.results and roll >= 0.8:
                seq += 1
                await self._stream(client, f"{client.name}-{seq}", rng)
            elif sc.results and roll >= 0.7:
                await self._room(client, rng)
            elif roll < 0.3 and sc.logs:
                key = f"log{rng.randrange(sc.logs)}"
                ref = client.refs.get_grain(SimLog, key)
                for _ in range(rng.randint(1, 5)):
                    seq += 1
                    self.trace("send", client.name, key, seq)
                    self.history.sent[(client.name, seq)] = self.now()
                    try:
                        await ref.append(client.name, seq)
                    except errors.RedgrainError as exc:
                        self.trace("send_failed", client.name, key, seq, type(exc).__name__)
            else:
                # Skewed: the last registers are mostly read, so a new activation often has not
                # written yet when an old one comes back (the case only fencing catches).
                key = f"reg{min(int(rng.expovariate(1.0)), sc.registers - 1)}"
                if roll < 0.65:
                    self._values += 1
                    await self._call(client, key, "write", self._values)
                else:
                    await self._call(client, key, "read", None)
            await asyncio.sleep(rng.expovariate(1 / 0.05))

    async def _call(self, client: SimClient, key: str, method: str, arg: Any) -> None:
        """A register's write or read; on a versioned register also of its tag, which the
        checkers see as a register of its own (``key#tag``)."""
        timeout = self.scenario.call_timeout_s
        versioned = key.startswith("ver")
        ref: Any = client.refs.get_grain(SimVersionedV2 if versioned else SimRegister, key).with_timeout(timeout)
        register = f"{key}#tag" if method.endswith("_tag") else key
        op = Op(client.name, register, method.removesuffix("_tag"), arg, self.now(), timeout)
        self.history.ops.append(op)
        self.trace("call", client.name, key, method, arg)
        try:
            result = await getattr(ref, method)(*([] if arg is None else [arg]))
        except errors.RedgrainError as exc:
            op.error = f"{type(exc).__name__}: {exc}"
            self.trace("failed", client.name, key, method, arg, type(exc).__name__)
        else:
            op.ok, op.result = True, result
            self.trace("answered", client.name, key, method, arg, result)
        op.end = self.now()

    async def _stream(self, client: SimClient, stream: str, rng: random.Random) -> None:
        """Iterate one streamed call, leaving it early one time in three."""
        timeout = self.scenario.call_timeout_s
        key = f"count{rng.randrange(self.scenario.results)}"
        n = rng.randint(1, 12)
        leave = rng.randint(1, n - 1) if n > 1 and rng.random() < 0.33 else None
        op = StreamOp(client.name, stream, n, leave, self.now(), timeout)
        self.history.streams.append(op)
        self.trace("stream", client.name, key, stream, n, leave)
        ref = client.refs.get_grain(SimCounter, key).with_timeout(timeout)
        try:
            async for item in ref.count(stream, n):
                op.items.append(item)
                op.received_at.append(self.now())
                if leave is not None and len(op.items) >= leave:
                    break
        except errors.RedgrainError as exc:
            op.error = f"{type(exc).__name__}: {exc}"
            self.trace("stream_failed", client.name, stream, type(exc).__name__)
        op.end = self.now()
        self.trace("stream_ended", client.name, stream, op.items)

    async def _room(self, client: SimClient, rng: random.Random) -> None:
        """Join the room with this client's observer (renewing its entry), or notify everyone in it."""
        room = client.refs.get_grain(SimRoom, "room").with_timeout(self.scenario.call_timeout_s)
        try:
            if rng.random() < 0.5:
                await room.join(client.observe())
            else:
                self._notes += 1
                seq = self._notes
                self.trace("say", client.name, seq)
                answered = await room.say(seq)
                self.history.said.append((seq, answered))
        except errors.RedgrainError as exc:
            self.trace("room_failed", client.name, type(exc).__name__)

    def _generators_left(self) -> list[tuple[str, str]]:
        """Generators still running on a silo that is up (a crashed silo's went with it)."""
        live: set[str] = {s.name for s in self.silos if s.state == "active"}
        return [(stream, silo) for stream, (silo, ended) in self._generators.items() if not ended and silo in live]

    async def _drive_zombie_target(self, client: SimClient, end: float) -> None:
        """One writer on a register of its own, the one the first long pause strikes mid-write.

        While that pause holds the write, the writer only reads: once the silo is declared dead
        a read activates the register elsewhere (a new fencing token), and since no read moves
        the etag, the zombie's write, when it goes on, still names the stored etag. Only the
        fence stands between it and the store (the drivers' writes to the shared registers
        move the etag first on almost every seed, and the etag check refuses the zombie).
        """
        rng = random.Random(self.work_rng.getrandbits(64))
        while self.now() < end:
            if self.zombie_pending is None:
                self._values += 1
                await self._call(client, ZOMBIE_KEY, "write", self._values)
            else:
                await self._call(client, ZOMBIE_KEY, "read", None)
            await asyncio.sleep(rng.expovariate(1 / 0.2))

    async def _final_read(self, key: str) -> None:
        await self._call(self.clients[0], key, "read", None)

    async def _inject(self, end: float) -> None:
        start = self.now()
        if self.replication is not None:
            for fault in self.faults:
                if fault.kind == "failover":
                    self.replication.plan(start + fault.at)
                    self.loop.call_at(start + fault.at - WINDOW_S, self.replication.checkpoint)
        for fault in self.faults:
            wait = start + fault.at - self.now()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._apply(fault)

    async def _apply(self, fault: Fault) -> None:
        silo = self.silos[fault.target]
        self.trace("fault", str(fault), silo.name)
        self.history.disruptions.append(self.now())
        if self.services is not None:
            # A pause's window is opened when it strikes (pause_now); the others', now.
            self.services.window({"crash": 2.0, "partition": fault.length_s, "redis_cut": fault.length_s}.get(fault.kind, 0.0))
        if fault.kind == "crash":
            if silo.state == "active" and not self.loop.is_paused(silo.name):
                await silo.crash()
                restart = self.restart_real if self.real is not None else self._restart_later
                self.spawn("world", restart(fault.target, 2.0))
        elif fault.kind == "pause":
            aimed = self._zombie_holder() if fault.length_s > 3.0 and not self._aimed else None
            if aimed is not None:
                # The first long pause strikes the silo holding the zombie workload's register,
                # at its next write of it (see _drive_zombie_target).
                self._aimed = True
                self.trace("aimed", aimed.name)
                grain = ZOMBIE_GRAIN if self.real is not None else str(self._zombie_grain)
                self.pause_at_write[aimed.name] = (fault.length_s + 6.0, grain)
            elif silo.state == "active" and not self.loop.is_paused(silo.name):
                if fault.length_s > 3.0:
                    # At its next state write, and long enough for the cluster to declare it
                    # dead and activate its grains elsewhere: it comes back as a zombie mid-write.
                    self.pause_at_write[silo.name] = (fault.length_s + 6.0, None)
                else:
                    self.pause_now(silo.name, fault.length_s)
        elif fault.kind == "partition":
            other = self.silos[fault.other]
            cut = frozenset((_proc(silo.name), _proc(other.name)))
            self.cuts.add(cut)
            self.spawn("world", self._later(fault.length_s, lambda: self._heal_cut(cut)))
        elif fault.kind == "redis_cut":
            self.redis_cut.add(silo.name)
            self.spawn("world", self._later(fault.length_s, lambda: self.redis_cut.discard(silo.name)))
        elif fault.kind == "slow_net":
            self.slow_links += 1
            self.spawn("world", self._later(fault.length_s, self._fast_again))
        elif fault.kind == "slow_activation":
            self.slow_activations += 1
            self.spawn("world", self._later(fault.length_s, self._quick_activations))
        elif fault.kind == "failover" and self.replication is not None and not self.redis_down:
            # The master dies; the replica (as of now) is promoted once the sentinels agree.
            lost = self.replication.fail_over()
            self.trace("failover", sorted(lost.grains))
            self.redis_down = True
            self.spawn("world", self._later(fault.length_s, self._master_again))
        elif fault.kind == "clock_jump":
            # NTP steps the clock, or an operator sets it: time.time moves, monotonic does not.
            self.wall_offsets[fault.target] = self.wall_offsets.get(fault.target, 0.0) + fault.length_s
        elif fault.kind in ("restart", "stop") and silo.state == "active" and not self.loop.is_paused(silo.name):
            self.spawn("world", self._restart(fault.target, graceful=fault.kind == "restart"))
        elif fault.kind == "reset" and silo.state == "active" and silo.silo.transport is not None:
            silo.silo.transport.abort_all()
            # abort_all stops listening too; the process lives on and listens again.
            await silo.silo.transport.listen(silo.address.host, silo.address.port)

    @property
    def _zombie_grain(self) -> GrainId | None:
        return next((g for g in self.directory.entries() if g.key == ZOMBIE_KEY), None)

    def _zombie_holder(self) -> SimSilo | None:
        """The live, running silo whose activation of :data:`ZOMBIE_KEY` the directory names, if any."""
        if self.real is not None:
            owner = self.real.owner_of(ZOMBIE_GRAIN) if self.scenario.zombie else None
        else:
            grain = self._zombie_grain
            entry = None if grain is None else self.directory.entries()[grain]
            owner = None if not self.scenario.zombie or entry is None else str(entry.silo)
        if owner is None:
            return None
        for s in self.silos:
            if str(s.address) == owner and s.state == "active" and not self.loop.is_paused(s.name):
                return s
        return None

    def pause_now(self, name: str, length_s: float, *, zombie_write: str | None = None) -> None:
        silo = next(s for s in self.silos if s.name == name)
        if silo.state != "active" or self.loop.is_paused(name):
            return
        if zombie_write is not None:
            self.zombie_pending = name
        self.trace("pause", name, length_s)
        self.history.disruptions.append(self.now())
        if self.services is not None:
            self.services.window(length_s)
        self.loop.pause(name)
        self.spawn("world", self._later(length_s, lambda: self._resume(silo)))

    async def _later(self, delay: float, then: Callable[[], Any]) -> None:
        await asyncio.sleep(delay)
        then()

    def _resume(self, silo: SimSilo) -> None:
        if self.zombie_pending == silo.name:
            self.zombie_pending = None
        self.trace("resume", silo.name)
        self.history.disruptions.append(self.now())
        self.loop.resume(silo.name)

    def _heal_cut(self, cut: frozenset[str]) -> None:
        self.cuts.discard(cut)
        self.network.release()

    def _master_again(self) -> None:
        self.redis_down = False
        self.trace("promoted")

    def _fast_again(self) -> None:
        self.slow_links -= 1

    def _quick_activations(self) -> None:
        self.slow_activations -= 1

    async def _upgrade(self, index: int, at: float) -> None:
        """Stop silo ``index`` gracefully and start it again (on the new version)."""
        await asyncio.sleep(at - self.now())
        silo = self.silos[index]
        if silo.state != "active" or self.loop.is_paused(silo.name):
            return  # a fault got there first: its restart is the upgrade
        self.trace("upgrade", silo.name)
        self.history.disruptions.append(self.now())
        await self.spawn(silo.name, silo.stop())
        self.reap(silo.name, check=True)
        await self.add_silo(index)

    async def _restart_later(self, index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        while True:
            # A silo cannot join while Redis has no master (a failover): its supervisor retries.
            while self.redis_down:
                await asyncio.sleep(0.5)
            try:
                await self.add_silo(index)
                return
            except errors.StorageError:
                await self.spawn(self.silos[index].name, self.silos[index].crash())
                await asyncio.sleep(1.0)

    async def _heal(self) -> None:
        for silo in self.silos:
            if self.loop.is_paused(silo.name):
                self._resume(silo)
        self.cuts.clear()
        self.network.release()
        self.redis_cut.clear()
        self.redis_down = False
        self.pause_at_write.clear()
        self.slow_links = self.slow_activations = 0
        self.trace("healed")

    async def _stop_all(self) -> None:
        # One-way calls lost and counted (docs/concepts.md: shed past the bound, deadline passed):
        # what the one_way_delivered check allows to be missing, and nothing more.
        self._stopping = True
        for silo in self.silos:
            dispatcher = getattr(silo.silo, "dispatcher", None)
            if dispatcher is not None:
                self.history.one_way_counted += dispatcher.statistics().one_way_failed
        for client in self.clients:
            await self.spawn(client.name, client.stop())
            self.reap(client.name, check=True)
        for silo in self.silos:
            if silo.state == "active":
                await self.spawn(silo.name, silo.stop())
                self.reap(silo.name, check=True)
            elif silo.state in ("dying", "starting"):
                await self.spawn(silo.name, silo.crash())


def _redis_side(task: asyncio.Task[Any]) -> bool:
    return getattr(task.get_coro(), "__qualname__", "").startswith("AsyncFakeSocket.")


def _proc(name: str | None) -> str:
    """``s1.4`` (silo 1, generation 4) and ``c0`` name processes; a restarted silo is a new one."""
    return name or "world"


def run_world(seed: int, scenario: Scenario, *, faults: list[Fault] | None = None, shuffle: bool = True) -> Outcome:
    """Run one seed to its end on a fresh :class:`SimLoop`."""
    loop = SimLoop(random.Random(seed ^ 0x5EED), shuffle=shuffle)
    try:
        world = World(seed, scenario, loop, faults=faults)
        return loop.run_until_complete(world.run())
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        with contextlib.suppress(Exception):  # a stalled or broken world is being thrown away
            loop.run_until_complete(asyncio.sleep(0))
        loop.close()
