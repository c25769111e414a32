"""A silo: wires the components together and starts and stops them in stages.

Start: Redis → grain types → transport listener → generation and address →
directory, membership, catalog → join as Joining → publish grain types →
Active → heartbeats, idle collection, stats. Stop (graceful): ShuttingDown →
deactivate every activation (queued calls re-routed to other silos) → Dead →
close. A silo that finds itself declared Dead stops serving at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any, Self

import psutil

from grains.base import DeactivationReason, Grain
from grains.ids import SiloAddress
from silo import errors
from silo.catalog.catalog import CallFilter, Catalog
from silo.catalog.grain_types import GrainTypes
from silo.catalog.runtime import RefFactory, SiloRuntime, resolve_device
from silo.catalog.watchdog import LoopWatchdog
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.failure_detector import FailureDetector, HeartbeatThread, transport_probe
from silo.cluster.membership import ClusterEvents, MembershipView, RedisMembershipTable
from silo.cluster.placement import Placer
from silo.cluster.rebalancer import ControlInbox, Migrator, Rebalancer
from silo.cluster.reminders import ReminderService, ReminderTable, RouterDelivery
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.messaging.dispatcher import Dispatcher
from silo.messaging.router import Manifests, Router, TypeInfo
from silo.messaging.transport import Transport
from silo.records import EventLog, MemberRow, SiloLoad, SiloStatus
from silo.redis_util import connect_redis, redis_errors
from silo.settings import SiloSettings
from silo.stats import CallStats, StatsPublisher
from silo.storage.checkpoint import Checkpoints
from silo.storage.store import RedisStateStore

log = logging.getLogger("redgrain.silo")


class Silo:
    """One silo process (or several in one process, for tests)."""

    def __init__(
        self,
        settings: SiloSettings | None = None,
        *,
        grains: Iterable[type[Grain]] = (),
        filters: Iterable[CallFilter] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or SiloSettings()
        self._extra_classes = list(grains)
        self._user_filters = list(filters)
        self._clock = clock
        self.keys = Keys(self.settings.cluster)
        self.status = "created"
        self.address: SiloAddress | None = None
        self.stopped = asyncio.Event()
        self._process = psutil.Process()
        self._started_at = 0.0
        self._background: list[Any] = []

    # --- start -------------------------------------------------------------
    async def start(self) -> Silo:
        s = self.settings
        self.redis = connect_redis(s.redis_url)
        with redis_errors(f"connect to {s.redis_url}"):
            await self.redis.ping()
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

        self.transport = Transport(s.transport, self.codec)
        port = await self.transport.listen(s.host, s.port)
        self.table = RedisMembershipTable(self.redis, self.keys)
        generation = await self.table.new_generation()
        self.address = SiloAddress(s.advertise_host or _advertised(s.host), port, generation)
        await self.transport.listen_local(self.address.endpoint)
        # Cluster events (join, suspect, dead, rebalance, ...): components call self.events.emit(kind, **data).
        self.events = EventLog(self.redis, self.keys, str(self.address), clock=self._clock)

        self.directory = RedisGrainDirectory(self.redis, self.keys)
        self.view = MembershipView(self.table, redis=self.redis, keys=self.keys, refresh_s=s.membership.refresh_s)
        self.manifests = Manifests(self.redis, self.keys)
        for name in self.types.names():
            opts = self.types.options(name)
            self.manifests.add_local(
                TypeInfo(name, self.types.methods(name), opts.placement, opts.stateless_worker)
            )
        self.router = Router(
            transport=self.transport,
            directory=self.directory,
            view=self.view,
            manifests=self.manifests,
            placer=Placer(),
            call_timeout_s=s.transport.call_timeout_s,
        )
        self.refs = RefFactory(self.router, self.manifests, self.codec)
        self.store = RedisStateStore(self.redis, self.keys, s.storage)
        self.runtime = SiloRuntime(
            device=self.device,
            refs=self.refs,
            store=self.store,
            codec=self.codec,
            threads=s.catalog.thread_pool_size,
            view=self.view,
            redis=self.redis,
            keys=self.keys,
        )
        self.call_stats = CallStats()
        self.catalog = Catalog(
            settings=s.catalog,
            silo=self.address,
            types=self.types,
            directory=self.directory,
            runtime=self.runtime,
            filters=[self.call_stats, *self._user_filters],
        )
        self.dispatcher = Dispatcher(address=self.address, catalog=self.catalog, types=self.types, router=self.router)
        self.router.set_local(self.dispatcher)
        self.transport.set_handler(self.dispatcher.on_frame)
        self.checkpoints = Checkpoints(self.redis, self.keys, s.storage)
        self.runtime.set_checkpoints(self.checkpoints)
        self.reminders = ReminderService(
            ReminderTable(self.redis, self.keys),
            s.reminders,
            RouterDelivery(
                router=self.router,
                manifests=self.manifests,
                dispatcher=self.dispatcher,
                transport=self.transport,
                timeout_s=s.reminders.delivery_timeout_s,
            ),
        )
        self.runtime.set_reminders(self.reminders)

        self._started_at = self._clock()
        row = MemberRow(
            address=str(self.address),
            host=self.address.host,
            port=self.address.port,
            generation=generation,
            status=SiloStatus.JOINING,
            roles=list(s.roles) + (["gpu"] if self.device.startswith("cuda") and "gpu" not in s.roles else []),
            grain_types=self.types.names(),
            started=self._started_at,
            heartbeat=self._started_at,
            pid=os.getpid(),
            hostname=socket.gethostname(),
        )
        await self.table.join(row)
        await self._publish_types()
        await self.table.set_status(str(self.address), SiloStatus.ACTIVE)
        await self.view.start()
        await self.manifests.refresh()
        self._start_cluster_services()
        self.catalog.start()
        self.reminders.start()
        self.watchdog = LoopWatchdog(s.catalog.slow_turn_ms, self.catalog.running_turns)
        self.watchdog.start()
        self._process.cpu_percent(None)  # prime: the first reading is meaningless
        self.status = "active"
        self.events.emit("join", roles=row.roles, grain_types=row.grain_types, pid=row.pid, host=row.hostname)
        self.stats_publisher = StatsPublisher(
            self.redis,
            self.keys,
            str(self.address),
            self.statistics,
            status=lambda: self.status,
            started=self._started_at,
            interval_s=s.stats_interval_s,
            clock=self._clock,
        )
        self.stats_publisher.start()
        log.info("silo %s active, hosting %s", self.address, ", ".join(self.types.names()))
        return self

    async def _publish_types(self) -> None:
        mapping: dict[Any, Any] = {name: json.dumps(self.types.manifest(name)) for name in self.types.names()}
        with redis_errors("publish grain types"):
            await self.redis.hset(self.keys.grain_types, mapping=mapping)

    def _load(self) -> SiloLoad:
        return SiloLoad(
            cpu_percent=self._process.cpu_percent(None),
            memory_percent=self._process.memory_percent(),
            activations=len(self.catalog),
        )

    def _start_cluster_services(self) -> None:
        """Heartbeat thread, failure detector, rebalancer (silo/cluster/failure_detector.py, rebalancer.py)."""
        s = self.settings
        assert self.address is not None
        self.cluster_events = ClusterEvents()
        self.cluster_events.add_listener(self._forward_event)
        self.heartbeat = HeartbeatThread(
            redis_url=s.redis_url,
            keys=self.keys,
            address=str(self.address),
            settings=s.membership,
            load=self._load,
            on_dead=self._on_declared_dead,
            loop=asyncio.get_running_loop(),
            clock=self._clock,
        )
        self.dispatcher.fenced = self.heartbeat.fenced
        self.dispatcher.confirm_alive = self.heartbeat.confirm
        self.detector = FailureDetector(
            table=self.table,
            me=self.address,
            settings=s.membership,
            probe=transport_probe(self.transport),
            on_self_dead=self._on_declared_dead,
            events=self.cluster_events,
        )
        self.view.on_unreachable(self.detector.hint_unreachable)
        self.migrator = Migrator(
            me=self.address,
            catalog=self.catalog,
            dispatcher=self.dispatcher,
            router=self.router,
            view=self.view,
            manifests=self.manifests,
            placer=Placer(),
            events=self.cluster_events,
        )
        self.rebalancer = Rebalancer(
            redis=self.redis,
            keys=self.keys,
            me=self.address,
            view=self.view,
            directory=self.directory,
            router=self.router,
            settings=s.rebalancer,
            events=self.cluster_events,
        )
        self.dispatcher.system["move"] = self._system_move
        self.dispatcher.system["drain"] = self._system_drain
        self.control = ControlInbox(self.redis, self.keys, self.address, {"drain": self._drain_command})
        self.heartbeat.start()
        self.detector.start()
        self.control.start()
        if s.rebalancer.enabled:
            self.rebalancer.start()

    async def _stop_cluster_services(self) -> None:
        await self.control.stop()
        await self.rebalancer.stop()
        await self.migrator.stop()
        await self.detector.stop()
        await self.heartbeat.stop()

    def _forward_event(self, kind: str, data: dict[str, Any]) -> None:
        events = getattr(self, "events", None)  # the dashboard's event stream, once started
        if events is not None:
            events.emit(kind, **data)

    async def _system_move(self, count: int, targets: list[str]) -> int:
        # The leader may not know we cannot reach a target (a partition): a move there
        # would hold the grain's calls until the activation request times out.
        unreachable = self.detector.unreachable()
        return self.migrator.move_out_nowait(int(count), [str(t) for t in targets if str(t) not in unreachable])

    async def _system_drain(self) -> str:
        self._drain_command({"by": "system call"})
        return "draining"

    def _drain_command(self, cmd: dict[str, Any]) -> None:
        """Drain (graceful stop) asked by an admin: the process then exits as after SIGTERM."""
        log.info("drain requested by %s", cmd.get("by", "?"))
        self._background.append(asyncio.get_running_loop().create_task(self.stop(graceful=True)))

    async def _quiesce(self, quiet_s: float = 0.2, limit_s: float = 1.0) -> None:
        """Wait until callers stop sending (they have seen us Dead) before closing connections."""
        loop = asyncio.get_running_loop()
        end = loop.time() + limit_s
        seen = self.dispatcher.statistics().requests
        quiet_since = loop.time()
        while loop.time() < end and loop.time() - quiet_since < quiet_s:
            await asyncio.sleep(0.05)
            now = self.dispatcher.statistics().requests
            if now != seen:
                seen, quiet_since = now, loop.time()

    # --- stop --------------------------------------------------------------
    async def stop(self, *, graceful: bool = True) -> None:
        if self.status in ("stopping", "stopped", "dead"):
            await self.stopped.wait()
            return
        self.status = "stopping"
        addr = str(self.address)
        try:
            await self.reminders.stop()
            if graceful:
                try:
                    await self.table.set_status(addr, SiloStatus.SHUTTING_DOWN)
                except errors.RedgrainError as exc:
                    log.warning("could not mark %s ShuttingDown: %s", addr, exc)
                self.dispatcher.draining = True
                self.cluster_events.emit("drain", {"silo": addr, "activations": len(self.catalog)})
                await self.migrator.hand_off_keep_alive()
                await self.catalog.deactivate_all(DeactivationReason.SHUTDOWN)
            await self._stop_cluster_services()
            await self.stats_publisher.stop()
            await self.catalog.stop()
            await self.watchdog.stop()
            try:
                await self.table.set_status(addr, SiloStatus.DEAD)
                await self.directory.purge_silo(self.address)  # type: ignore[arg-type]
            except errors.RedgrainError as exc:
                log.warning("could not mark %s Dead: %s", addr, exc)
            if graceful:
                await self._quiesce()
            self.events.emit("leave", graceful=graceful)
            await self.events.flush()
            await self.dispatcher.close()
            await self.view.stop()
            await self.transport.close()
            self.runtime.shutdown()
            await self.redis.aclose()
        finally:
            self.status = "stopped"
            self.stopped.set()
            log.info("silo %s stopped", addr)

    def _on_declared_dead(self) -> None:
        """Membership says we are dead: stop serving now, touch nothing in Redis."""
        if self.status in ("dead", "stopped"):
            return
        self.status = "dead"
        self.transport.abort_all()
        if hasattr(self, "stats_publisher"):  # declared dead before start finished
            self.stats_publisher.stop_nowait()
        self.events.cancel_pending()
        self.catalog.drop_all_nowait()
        self.dispatcher.closed = True
        loop = asyncio.get_running_loop()
        self._background.append(loop.create_task(self._finish_dead()))
        # Whoever waits for the end (the CLI exits with 3) must not wait on a cleanup that hangs.
        loop.call_later(5.0, self.stopped.set)

    async def _finish_dead(self) -> None:
        try:
            await self.reminders.stop()
            await self._stop_cluster_services()
            await self.catalog.stop()
            await self.watchdog.stop()
            await self.dispatcher.close()
            await self.view.stop()
            self.runtime.shutdown()
            await self.redis.aclose()
        except Exception:
            log.exception("cleanup after being declared dead failed")
        finally:
            self.stopped.set()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def declared_dead(self) -> bool:
        """The cluster declared this silo dead: it stopped serving and must exit."""
        return self.status == "dead"

    # --- client-like access, for grains' callers inside the silo process ---
    def get_grain(self, grain: Any, key: Any) -> Any:
        return self.refs.get_grain(grain, key)

    def statistics(self) -> dict[str, Any]:
        """Every component's statistics(), for the stats publisher and the dashboard."""
        return {
            "transport": self.transport.statistics(),
            "catalog": self.catalog.statistics(),
            "directory": self.directory.statistics(),
            "membership": self.view.statistics(),
            "router": self.router.statistics(),
            "dispatcher": self.dispatcher.statistics(),
            "storage": self.store.statistics(),
            "reminders": self.reminders.statistics(),
            "checkpoints": self.checkpoints.statistics(),
            "methods": self.call_stats.statistics(),
            "watchdog": self.watchdog.statistics(),
            "heartbeat": self.heartbeat.statistics(),
            "failure_detector": self.detector.statistics(),
            "rebalancer": self.rebalancer.statistics(self.migrator),
        }


def _advertised(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


