"""A silo: builds the components, starts them in named stages, stops them in reverse.

The start stages (``Silo.START_STAGES``; stage ``name`` is ``Silo._stage_<name>``),
in order, with the reason for the order:

1. ``redis``: connect and PING. Every later stage reads or writes Redis; an
   unreachable Redis fails the start before anything is bound.
1a. ``logs``: the log stream handler (``silo/logstream.py``), before any task
   is made: the tasks made after it inherit the context that tags our records.
2. ``types``: grain classes, codec, torch device. The transport frames with
   the codec, which must know the grains' annotated types.
3. ``listen``: the transport and its TCP listener. The port (a free one by
   default) is part of the address, so listening comes before the address.
4. ``address``: a new generation (INCR), the address, the same-host Unix
   socket (its path derives from the address's endpoint), the event log.
5. ``components``: directory, membership view, manifests, router, store,
   checkpoints, reminders, runtime, catalog, heartbeat, failure detector,
   migrator, drain, dispatcher, control inbox, rebalancer, watchdog, stats
   publisher: each built with its collaborators, none started. Nothing can
   call them yet: no membership row names the address.
6. ``join``: the row, as Joining. We listen already, so a peer that probes
   the new row finds us.
7. ``publish``: our grain type manifests (one per type and ``@version``),
   before we are Active: a caller that routes to us must find the methods of
   the versions we host.
8. ``active``: the row Active, the membership view started, manifests read.
   From here calls arrive, and everything that serves them exists.
9. ``cluster``: heartbeat thread, failure detector, control inbox and drain
   requests, rebalancer. They act as a member (refresh our row, vote, lead),
   so they start once the row is Active.
10. ``services``: idle collection, loop watchdog, stats publisher, reminders,
    stream delivery to ``@subscribes`` grains. Late: they make work for the
    rest (a reminder tick and a stream item are calls; the stats record reads
    every component).
11. ``startup``: the grain modules' ``@on_silo_start`` tasks (``silo/startup.py``).
    Last: a task may call any grain, this silo's too, so everything that serves
    calls runs; and first a failed task fails the start, so nobody is told the
    silo is ready before they succeeded.

Each stage registers how to undo what it did as it does it; a start that
fails at any stage runs the undos registered so far, newest first, and
re-raises; ``stop()`` runs the same list. So the stop order is written once,
as the start order reversed: stream delivery (leases handed back), reminders,
stats, watchdog, idle collection;
rebalancer, control inbox, drain requests, migrator, failure detector,
heartbeat (all before the leave, so no heartbeat runs into our own Dead
row); the view; the leave (Dead, directory entries purged, and for a
graceful stop a quiet wait for callers); dispatcher and grain threads; the
event log, flushed; the transport (TCP and Unix socket); the log stream (its
last records written); the Redis client.
A start that failed after ``join`` thus leaves the row Dead; one that failed
before leaves no row.

A graceful stop first hands off (``silo/cluster/drain.py``: ShuttingDown,
keep-alive grains moved, every activation deactivated). A silo the cluster
declares dead stops serving at once (connections aborted, activations
dropped) and then runs the same undos, skipping the leave: the cluster wrote
it Dead already, and a zombie must not purge what its successors registered.

What a silo takes from its process and machine (the Redis connection, the
socket transport, the heartbeat thread, TCP handshakes, clocks, placement
draws, psutil's load, host name and pid) comes from its ``environment``
(``silo/environment.py``), production's by default; the simulator gives
its own to run this class on virtual time (``silo/testing/sim/silos.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import inspect
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ClassVar, Self, TypeVar, overload

import psutil
import redis.asyncio as aioredis

from grains.base import Grain
from grains.ids import SiloAddress
from grains.placement import grain_options
from grains.ref import GrainRef, Ref
from grains.streams import subscriptions
from silo import errors
from silo.catalog.catalog import Catalog
from silo.catalog.grain_types import GrainTypes
from silo.catalog.pipeline import CallFilter, OutgoingFilter
from silo.catalog.runtime import RefFactory, SiloRuntime, resolve_device
from silo.catalog.watchdog import LoopWatchdog
from silo.cluster.control import ControlInbox
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.drain import Departure, DrainRequests
from silo.cluster.events import ClusterEvents
from silo.cluster.failure_detector import FailureDetector, HeartbeatThread, transport_probe
from silo.cluster.failure_detector import handshake as tcp_handshake
from silo.cluster.housekeeping import Housekeeper
from silo.cluster.membership import RedisMembershipTable
from silo.cluster.migrator import Migrator
from silo.cluster.placement import Placer
from silo.cluster.rebalancer import Rebalancer
from silo.cluster.reminders import ReminderService, ReminderTable, ticks_through
from silo.cluster.view import MembershipView
from silo.codec import Codec, TypeRegistry
from silo.environment import Heartbeat, HeartbeatSpec, SiloEnvironment
from silo.keys import Keys, manifest_field
from silo.logstream import LogStream
from silo.messaging.dispatcher import Dispatcher
from silo.messaging.manifests import Manifests, TypeInfo
from silo.messaging.observer_hub import ObserverHub
from silo.messaging.router import Router
from silo.messaging.transport import Transport
from silo.plugins import load_filters
from silo.records.events import EventLog
from silo.records.membership import MemberRow, SiloLoad, SiloStatus
from silo.redis_url import redact
from silo.redis_util import close_redis, open_redis, redis_errors, redis_statistics
from silo.settings import SiloSettings
from silo.shutdown import ShutdownHook
from silo.startup import StartupTask, find_startup_tasks, run_startup_tasks
from silo.stats import CallStats, StatsPublisher
from silo.storage.checkpoint import Checkpoints
from silo.storage.provider import REDIS, StorageProviders, directory_owner
from silo.storage.store import RedisStateStore
from silo.streams.agent import StreamAgent
from silo.streams.retention import StreamRetention
from silo.streams.stream import Streams
from silo.tracing import Tracing

log = logging.getLogger("redgrain.silo")

G = TypeVar("G", bound=Grain)

Undo = Callable[[], Awaitable[Any] | None]


class SiloState(str, enum.Enum):
    """The silo object's own state (the membership row's status is ``SiloStatus``)."""

    CREATED = "created"
    STARTING = "starting"
    ACTIVE = "active"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"
    """Declared dead by the cluster: stopped serving at once; the process must exit."""


class Silo:
    """One silo process (or several in one process, for tests)."""

    START_STAGES: ClassVar[tuple[str, ...]] = (
        "redis",
        "logs",
        "types",
        "listen",
        "address",
        "components",
        "join",
        "publish",
        "active",
        "cluster",
        "services",
        "startup",
    )

    # The parts, each set by the stage that builds it (see the module docstring).
    redis: aioredis.Redis
    log_stream: LogStream | None = None
    types: GrainTypes
    codec: Codec
    device: str
    transport: Transport
    table: RedisMembershipTable
    events: EventLog
    cluster_events: ClusterEvents
    directory: RedisGrainDirectory
    view: MembershipView
    manifests: Manifests
    router: Router
    refs: RefFactory
    storage: StorageProviders
    store: RedisStateStore
    checkpoints: Checkpoints
    reminders: ReminderService
    observers: ObserverHub
    runtime: SiloRuntime
    call_stats: CallStats
    catalog: Catalog
    heartbeat: Heartbeat
    detector: FailureDetector
    migrator: Migrator
    drain: DrainRequests
    dispatcher: Dispatcher
    departure: Departure
    control: ControlInbox
    rebalancer: Rebalancer
    housekeeper: Housekeeper
    watchdog: LoopWatchdog
    stats_publisher: StatsPublisher
    streams: Streams

    def __init__(
        self,
        settings: SiloSettings | None = None,
        *,
        grains: Iterable[type[Grain]] = (),
        filters: Iterable[CallFilter] = (),
        outgoing_filters: Iterable[OutgoingFilter] = (),
        clock: Callable[[], float] = time.time,
        tracing: Tracing | None = None,
        environment: SiloEnvironment | None = None,
    ) -> None:
        self.settings = settings or SiloSettings()
        self._env = environment or SiloEnvironment()
        """What it takes from its process and machine (silo/environment.py; the simulator's differs)."""
        self._extra_classes = list(grains)
        self._user_filters = list(filters)
        """Incoming filters given in code; the settings' incoming_filters run after them."""
        self._outgoing_filters = list(outgoing_filters)
        """Outgoing filters given in code; the settings' outgoing_filters run after them."""
        self._startup_tasks: list[StartupTask] = []
        self._tracing = tracing
        """Spans for this silo's calls; None: what settings.tracing says (off by default)."""
        self._clock = clock
        # Given to every component explicitly: a default argument holds the clock of import time.
        self._monotonic = self._env.monotonic or time.monotonic
        self.keys = Keys(self.settings.cluster)
        self.status = SiloState.CREATED
        self.address: SiloAddress | None = None
        self.stopped = asyncio.Event()
        """Set once the silo has stopped (or failed to start, or was declared dead)."""
        self._process = psutil.Process()
        self._started_at = 0.0
        self._port = 0
        self._undo: list[tuple[str, Undo]] = []
        """(name, undo) of what the stages did so far; run newest first."""
        self._start_done = asyncio.Event()
        self._graceful = False
        self._declared_dead = False
        self._dead_unwind: asyncio.Task[None] | None = None
        self._dead_deadline: asyncio.TimerHandle | None = None
        self._hook: ShutdownHook | None = None
        self.stream_agents: list[StreamAgent] = []
        """One per (namespace, @subscribes grain type) this silo hosts (silo/streams/agent.py)."""

    # --- start -------------------------------------------------------------
    async def start(self) -> Silo:
        if self.status is not SiloState.CREATED:
            raise errors.ConfigError(f"a silo starts once (this one is {self.status.value})")
        self.status = SiloState.STARTING
        self._started_at = self._clock()
        stage = ""
        try:
            for stage in self.START_STAGES:
                await getattr(self, f"_stage_{stage}")()
                if self._declared_dead:
                    raise errors.MembershipError(f"silo {self.address} was declared dead while starting")
        except BaseException as exc:
            log.warning("silo start failed in stage %r (%s); stopping what it started", stage, exc)
            try:
                await self._unwind()
            finally:
                self._finish()
            raise
        finally:
            self._start_done.set()
        self.status = SiloState.ACTIVE
        # A script whose loop ends without stopping us (it raised): stop, without the
        # hand-off, so no task or heartbeat thread outlives the loop (silo/shutdown.py).
        self._hook = ShutdownHook(functools.partial(self.stop, graceful=False), name=f"silo {self.address}")
        log.info("silo %s active, hosting %s", self.address, ", ".join(self.types.names()))
        return self

    def _on_stop(self, name: str, undo: Undo) -> None:
        self._undo.append((name, undo))

    async def _stage_redis(self) -> None:
        s = self.settings
        if self._env.redis is not None:
            self.redis = await self._env.redis()
        else:
            self.redis = await open_redis(s.redis_url, f"connect to {redact(s.redis_url)}")
        self._on_stop("redis client", functools.partial(close_redis, self.redis))

    async def _stage_logs(self) -> None:
        if self.settings.logs.enabled:
            self.log_stream = LogStream(self.redis, self.keys, lambda: str(self.address or ""), self.settings.logs)
            self._on_stop("log stream", self.log_stream.stop)
            self.log_stream.install()

    async def _stage_types(self) -> None:
        s = self.settings
        self.types = GrainTypes.from_modules(s.grains) if s.grains else GrainTypes()
        for cls in self._extra_classes:
            self.types.add(cls)
        if not self.types.names():
            raise errors.ConfigError("a silo needs at least one grain class (--grains module)")
        registry = TypeRegistry()
        for cls in self.types.classes():
            registry.register_annotations(cls)
        self.codec = Codec(registry)
        self.device = resolve_device(s.device)
        # Imported here, with the grain modules: a bad path fails the start before anything is bound.
        self._user_filters += load_filters(s.incoming_filters, "incoming filter")
        self._outgoing_filters += load_filters(s.outgoing_filters, "outgoing filter")
        self._startup_tasks = find_startup_tasks(s.grains)

    async def _stage_listen(self) -> None:
        s = self.settings
        # Built without its request handler: that is the dispatcher, which needs
        # the address (the port is only known once this listens) and the router
        # (which sends through this transport). Set in "components", before any
        # row names the address, so no peer can have sent a request yet.
        if self._env.transport is None:
            self.transport = Transport(s.transport, self.codec)
        else:
            self.transport = self._env.transport(s.transport, self.codec)
        self._on_stop("transport", self.transport.close)  # also closes the Unix socket
        self._port = await self.transport.listen(s.host, s.port)

    async def _stage_address(self) -> None:
        s = self.settings
        self.table = RedisMembershipTable(self.redis, self.keys)
        generation = await self.table.new_generation()
        self.address = SiloAddress(s.advertise_host or _advertised(s.host), self._port, generation)
        await self.transport.listen_local(self.address.endpoint)
        # The dashboard's event stream (join, suspect, dead, rebalance, ...).
        self.events = EventLog(self.redis, self.keys, str(self.address), clock=self._clock)
        self._on_stop("event log", self.events.flush)

    async def _stage_components(self) -> None:
        s = self.settings
        me = self.address
        assert me is not None
        self.cluster_events = ClusterEvents()
        self.cluster_events.add_listener(self.events.on_event)
        # The router's location cache is the one calls read (directory.cache_size); the
        # directory's own entry cache would hold the same grains again at ~530 B each.
        self.directory = RedisGrainDirectory(self.redis, self.keys, cache_size=0)
        self.view = MembershipView(
            self.table,
            redis=self.redis,
            keys=self.keys,
            refresh_s=s.membership.refresh_s,
            load_sample=s.membership.load_sample,
        )
        self.manifests = Manifests(self.redis, self.keys, clock=self._monotonic)
        for name in self.types.names():
            opts = self.types.options(name)
            self.manifests.add_local(
                TypeInfo(
                    name, self.types.methods(name), opts.placement, opts.stateless_worker, opts.one_way, opts.version,
                    streams=self.types.streams(name),
                )
            )
        if self._tracing is None and s.tracing.enabled:
            self._tracing = Tracing.from_settings(s.tracing)
            assert self._tracing is not None
            # Flushing to a collector that is down can take its export timeout: off the loop.
            self._on_stop("tracing", functools.partial(asyncio.to_thread, self._tracing.shutdown))
        self.router = Router(
            transport=self.transport,
            directory=self.directory,
            view=self.view,
            manifests=self.manifests,
            placer=Placer(self._env.rng()),
            call_timeout_s=s.transport.call_timeout_s,
            stream_window=s.transport.stream_window,
            cache_size=s.directory.cache_size,
            tracing=self._tracing,
        )
        self.refs = RefFactory(self.router, self.manifests, self.codec)
        self.storage = StorageProviders.build(s.storage, self.redis, self.keys, directory_owner(self.directory))
        self._on_stop("storage providers", self.storage.close)
        self.storage.check(self.types.classes())
        store = self.storage.get(REDIS)
        assert isinstance(store, RedisStateStore)
        self.store = store
        self.checkpoints = Checkpoints(self.redis, self.keys, s.storage)
        # Its delivery (through the dispatcher) is given when it starts: see ReminderService.start.
        self.reminders = ReminderService(ReminderTable(self.redis, self.keys), s.reminders)
        self.observers = ObserverHub(
            owner=str(me), codec=self.codec, transport=self.transport, call_timeout_s=s.transport.call_timeout_s
        )
        self._on_stop("observers", self.observers.close)
        self.streams = Streams(self.redis, self.keys, self.codec, s.streams, clock=self._clock)
        self.stream_retention = StreamRetention(
            redis=self.redis, keys=self.keys, settings=s.streams, me=str(me), clock=self._clock
        )
        self.runtime = SiloRuntime(
            device=self.device,
            refs=self.refs,
            store=self.storage,
            codec=self.codec,
            threads=s.catalog.thread_pool_size,
            view=self.view,
            redis=self.redis,
            keys=self.keys,
            checkpoints=self.checkpoints,
            reminders=self.reminders,
            outgoing_filters=self._outgoing_filters,
            observers=self.observers,
            streams=self.streams,
        )
        self._on_stop("grain threads", self.runtime.shutdown)
        self.call_stats = CallStats()
        self.catalog = Catalog(
            settings=s.catalog,
            silo=me,
            types=self.types,
            directory=self.directory,
            runtime=self.runtime,
            filters=[self.call_stats, *self._user_filters],
            clock=self._monotonic,
        )
        if self._env.heartbeat is None:
            self.heartbeat = HeartbeatThread(
                redis_url=s.redis_url,
                keys=self.keys,
                address=str(me),
                settings=s.membership,
                load=self._load,
                on_dead=self._on_declared_dead,
                loop=asyncio.get_running_loop(),
                clock=self._clock,
                monotonic=self._monotonic,
            )
        else:
            self.heartbeat = self._env.heartbeat(
                HeartbeatSpec(self.redis, s.redis_url, self.keys, str(me), s.membership, self._load,
                              self._on_declared_dead, self._clock, self._monotonic)
            )  # fmt: skip
        self.detector = FailureDetector(
            table=self.table,
            me=me,
            settings=s.membership,
            # A fenced silo's probes vouch for nobody (Liveness.probed): it may be the one cut off.
            probe=transport_probe(
                self.transport,
                handshake=self._env.handshake or tcp_handshake,
                sender=lambda: None if self.heartbeat.fenced() else str(me),
            ),
            on_self_dead=self._on_declared_dead,
            events=self.cluster_events,
            clock=self._monotonic,
            on_monitors=self.heartbeat.watch_monitors,
        )
        self.transport.on_probe(self.heartbeat.probed)
        self.view.on_unreachable(self.detector.hint_unreachable)
        self.view.on_change(lambda old, new: self.detector.membership_changed())
        self.migrator = Migrator(
            me=me,
            catalog=self.catalog,
            router=self.router,
            view=self.view,
            manifests=self.manifests,
            placer=Placer(self._env.rng()),
            events=self.cluster_events,
            unreachable=self.detector.unreachable,
        )
        self.drain = DrainRequests(functools.partial(self.stop, graceful=True))
        self.dispatcher = Dispatcher(
            address=me,
            catalog=self.catalog,
            types=self.types,
            router=self.router,
            fenced=self.heartbeat.fenced,
            confirm_alive=self.heartbeat.confirm,
            moving=self.migrator.moving,
            system={"move": self.migrator.system_move, "drain": self.drain.system_drain},
            codec=self.codec,
            tracing=self._tracing,
            observers=self.observers,
        )
        self._on_stop("dispatcher", self.dispatcher.close)
        # The two links built after construction, both cycles: the router
        # delivers our own grains' calls through the dispatcher, which forwards
        # through the router (clients share Router and have no dispatcher: it
        # stays an optional part); the transport hands requests to the
        # dispatcher, which could not exist before the transport listened.
        self.router.set_local(self.dispatcher)
        self.transport.set_handler(self.dispatcher.on_frame)
        self.departure = Departure(
            me=me,
            table=self.table,
            directory=self.directory,
            dispatcher=self.dispatcher,
            catalog=self.catalog,
            migrator=self.migrator,
            reminders=self.reminders,
            events=self.cluster_events,
        )
        self.control = ControlInbox(self.redis, self.keys, me, {"drain": self.drain.command})
        self.rebalancer = Rebalancer(
            redis=self.redis,
            keys=self.keys,
            me=me,
            view=self.view,
            directory=self.directory,
            router=self.router,
            settings=s.rebalancer,
            events=self.cluster_events,
            clock=self._monotonic,
        )
        self.housekeeper = Housekeeper(
            self.redis, self.keys, self.table, self.directory, s.retention, me=me, clock=self._clock,
            rows=lambda: self.view.rows,
        )
        self.watchdog = LoopWatchdog(s.catalog.slow_turn_ms, self.catalog.running_turns)
        self.stats_publisher = StatsPublisher(
            self.redis,
            self.keys,
            str(me),
            self.statistics,
            status=lambda: self.status.value,
            started=self._started_at,
            interval_s=s.stats_interval_s,
            idle_interval_s=s.stats_idle_interval_s,
            clock=self._clock,
        )

    async def _stage_join(self) -> None:
        s = self.settings
        me = self.address
        assert me is not None
        gpu = ["gpu"] if self.device.startswith("cuda") and "gpu" not in s.roles else []
        row = MemberRow(
            address=str(me),
            host=me.host,
            port=me.port,
            generation=me.generation,
            status=SiloStatus.JOINING,
            roles=[*s.roles, *gpu],
            grain_types=self.types.names(),
            grain_versions=self.types.versions(),
            started=self._started_at,
            heartbeat=self._started_at,
            pid=os.getpid() if self._env.pid is None else self._env.pid,
            hostname=socket.gethostname() if self._env.hostname is None else self._env.hostname,
        )
        # Registered first: a join whose answer was lost may still have written the row.
        self._on_stop("leave", self._leave)
        await self.table.join(row)
        self.events.emit("join", roles=row.roles, grain_types=row.grain_types, pid=row.pid, host=row.hostname)

    async def _stage_publish(self) -> None:
        # One field per (type, version): silos of another version keep theirs (a rolling upgrade).
        mapping: dict[Any, Any] = {
            manifest_field(name, self.types.options(name).version): json.dumps(self.types.manifest(name))
            for name in self.types.names()
        }
        fields = list(mapping)
        with redis_errors("publish grain types"):
            before = await self.redis.hmget(self.keys.grain_manifests, fields)
            await self.redis.hset(self.keys.grain_manifests, mapping=mapping)
        for field, old in zip(fields, before, strict=True):
            if old is not None and json.loads(old).get("methods") != json.loads(mapping[field])["methods"]:
                # Same version, other methods: the last writer wins again, as without versions.
                log.warning(
                    "grain type %s: this silo's methods differ from those another silo published for the "
                    "same version; give the changed class a new @version(n)", field,
                )

    async def _stage_active(self) -> None:
        await self.table.set_status(str(self.address), SiloStatus.ACTIVE)
        self._on_stop("membership view", self.view.stop)
        await self.view.start()
        await self.manifests.refresh()

    async def _stage_cluster(self) -> None:
        self._on_stop("heartbeat", self.heartbeat.stop)
        self.heartbeat.start()
        self._on_stop("failure detector", self.detector.stop)
        self.detector.start()
        self._on_stop("migrator", self.migrator.stop)
        self._on_stop("drain requests", self.drain.close)
        self._on_stop("control inbox", self.control.stop)
        self.control.start()
        if self.settings.rebalancer.enabled:
            self._on_stop("rebalancer", self.rebalancer.stop)
            self.rebalancer.start()
        self._on_stop("housekeeping", self.housekeeper.stop)
        self.housekeeper.start()

    async def _stage_services(self) -> None:
        self._on_stop("idle collection", self.catalog.stop)
        self.catalog.start()
        self._on_stop("watchdog", self.watchdog.stop)
        self.watchdog.start()
        if self._env.load is None:
            self._process.cpu_percent(None)  # prime: the first reading is meaningless
        self._on_stop("stats publisher", self.stats_publisher.stop)
        self.stats_publisher.start()
        self._on_stop("reminders", self.reminders.stop)
        self.reminders.start(ticks_through(self.router, self.settings.reminders.delivery_timeout_s))
        # A silo that left may have been the one firing reminders others sleep past: look now.
        self.view.on_change(lambda old, new: self.reminders.wake())
        self._on_stop("stream delivery", self._stop_stream_agents)
        self._start_stream_agents()
        self._on_stop("stream retention", self.stream_retention.stop)
        self.stream_retention.start()

    def _start_stream_agents(self) -> None:
        """Deliver the namespaces our ``@subscribes`` grain types subscribe to (last: it makes calls)."""
        me = str(self.address)
        for cls in self.types.classes():
            type_name = grain_options(cls).type_name
            for namespace in subscriptions(cls):
                agent = StreamAgent(
                    redis=self.redis,
                    keys=self.keys,
                    namespace=namespace,
                    group=type_name,
                    me=me,
                    candidates=functools.partial(self._hosting, type_name),
                    is_dead=self._is_dead,
                    caller=self.router,
                    codec=self.codec,
                    settings=self.settings.streams,
                )
                self.stream_agents.append(agent)
                agent.start()

    async def _stop_stream_agents(self) -> None:
        # A silo declared dead touches nothing in Redis: its leases run out or are taken.
        await asyncio.gather(*(a.stop(release=not self._declared_dead) for a in self.stream_agents))

    def _hosting(self, type_name: str) -> list[str]:
        return [r.address for r in self.view.hosting(type_name)]

    def _is_dead(self, address: str) -> bool:
        try:
            row = self.view.row(SiloAddress.parse(address))
        except ValueError:
            return False
        return row is not None and row.status is SiloStatus.DEAD

    async def _stage_startup(self) -> None:
        await run_startup_tasks(self._startup_tasks, self, self.settings.startup_timeout_s)

    def _load(self) -> SiloLoad:
        if self._env.load is not None:
            return self._env.load(len(self.catalog))
        return SiloLoad(
            cpu_percent=self._process.cpu_percent(None),
            memory_percent=self._process.memory_percent(),
            activations=len(self.catalog),
            memory_available_bytes=psutil.virtual_memory().available,
        )

    # --- stop --------------------------------------------------------------
    async def stop(self, *, graceful: bool = True) -> None:
        if self.status is SiloState.STARTING:
            await self._start_done.wait()  # e.g. a drain asked while starting: stop once started
        if self.status is SiloState.CREATED:
            self._finish()
            return
        if self.status is not SiloState.ACTIVE:  # stopping, stopped or dead: someone else is
            await self.stopped.wait()
            return
        self.status = SiloState.STOPPING
        self._graceful = graceful
        try:
            if graceful:
                try:
                    await self.departure.hand_off()
                except Exception:
                    log.exception("silo %s: hand-off before stopping failed", self.address)
            await self._unwind()
        finally:
            self._finish()

    async def _unwind(self) -> None:
        """Run the undos registered so far, newest first; one that fails does not stop the rest."""
        while self._undo:
            name, undo = self._undo.pop()
            try:
                result = undo()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("silo %s: stopping %s failed", self.address, name)

    async def _leave(self) -> None:
        if self._declared_dead:
            return  # see the module docstring: a zombie touches nothing in Redis
        await self.departure.leave(graceful=self._graceful)

    def _finish(self) -> None:
        if self._hook is not None:
            self._hook.disarm()
        if self.status is not SiloState.DEAD:
            self.status = SiloState.STOPPED
        if self._dead_deadline is not None:
            self._dead_deadline.cancel()
        self.stopped.set()
        if self.address is not None:
            log.info("silo %s stopped", self.address)

    def _on_declared_dead(self) -> None:
        """Membership says we are dead: stop serving now, touch nothing in Redis."""
        if self._declared_dead or self.status is SiloState.STOPPED:
            return
        self._declared_dead = True
        was = self.status
        self.status = SiloState.DEAD
        self.transport.abort_all()
        self.stats_publisher.stop_nowait()
        self.events.cancel_pending()
        self.catalog.drop_all_nowait()
        self.dispatcher.closed = True
        loop = asyncio.get_running_loop()
        # Whoever waits for the end (the CLI exits with 3) must not wait on a cleanup that hangs.
        self._dead_deadline = loop.call_later(5.0, self.stopped.set)
        if was is SiloState.ACTIVE:
            self._dead_unwind = loop.create_task(self._stop_dead())
        # STARTING: start() sees the flag after the stage and unwinds; STOPPING: the
        # stop in progress goes on, and its leave does nothing now.

    async def _stop_dead(self) -> None:
        try:
            await self._unwind()
        finally:
            self._finish()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def declared_dead(self) -> bool:
        """The cluster declared this silo dead: it stopped serving and must exit."""
        return self.status is SiloState.DEAD

    # --- client-like access, for grains' callers inside the silo process ---
    @overload
    def get_grain(self, grain: type[G], key: Any) -> Ref[G]: ...
    @overload
    def get_grain(self, grain: str, key: Any) -> GrainRef: ...
    def get_grain(self, grain: type[Grain] | str, key: Any) -> GrainRef:
        """A reference whose calls start in this silo, outside any grain; typed as the
        client's (``Ref[G]`` for a class, ``GrainRef`` for a type name)."""
        return self.refs.get_grain(grain, key)

    def statistics(self) -> dict[str, Any]:
        """Every component's statistics(), for the stats publisher and the dashboard."""
        return {
            "transport": self.transport.statistics(),
            "catalog": self.catalog.statistics(),
            "directory": self.directory.statistics(),
            "membership": self.view.statistics(),
            "router": self.router.statistics(),
            "manifests": self.manifests.statistics(),
            "dispatcher": self.dispatcher.statistics(),
            "observers": self.observers.statistics(),
            "storage": self.store.statistics(),
            "redis": redis_statistics(self.redis),
            "reminders": self.reminders.statistics(),
            "checkpoints": self.checkpoints.statistics(),
            "methods": self.call_stats.statistics(),
            "watchdog": self.watchdog.statistics(),
            "heartbeat": self.heartbeat.statistics(),
            "failure_detector": self.detector.statistics(),
            "rebalancer": self.rebalancer.statistics(self.migrator),
            "housekeeping": self.housekeeper.statistics(),
            "streams": {f"{a.namespace}/{a.group}": dataclasses.asdict(a.statistics()) for a in self.stream_agents},
            "stream_retention": self.stream_retention.statistics(),
        }


def _advertised(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host
