"""Silos in-process, on the twins: grain and cluster tests without Redis or TCP.

:class:`InProcessSilo` assembles what a silo runs a call with (grain types,
codec, :class:`~silo.catalog.catalog.Catalog`, the runtime services, the
dispatcher) over the in-memory directory and state store. It has two modes.

Alone (no ``network``), it replaces the router (directory lookups,
placement, the network) with a caller that hands every call straight to this
silo's dispatcher. Calls between grains take the same way, carrying their
call chain, so turn order, reentrancy, deadlock detection, re-routing after a
deactivation, idle collection, timers and state conflicts behave as on a
real silo::

    async with InProcessSilo([Counter], clock=clock) as silo:
        counter = silo.get_grain(Counter, "c")
        assert await counter.add(2) == 2
        await clock.advance(silo.settings.idle_timeout_s)
        ...

Every grain lives on that one silo: a call the directory says belongs to
another silo (a test registered one there) fails with SiloUnavailableError.

On a network (:class:`~silo.testing.transport.InMemoryNetwork`), it is wired
as ``silo/silo.py`` wires a silo: a real :class:`~silo.messaging.router.Router`
(directory, a real :class:`~silo.cluster.view.MembershipView` over the
membership twin, manifests, placement) over the transport twin, whose
requests go to the dispatcher; starting joins the membership table (Joining,
then Active) and publishes the grain types. :class:`InProcessCluster` builds
N of them on one network, sharing one directory, membership table and state
store, so forwarding, re-routing, deadlines, a silo's death and failover run
through the same code as in a cluster of processes::

    async with InProcessCluster([Counter], silos=2, clock=clock) as cluster:
        a, b = cluster.silos
        counter = a.get_grain(Counter, "c")
        await a.router.activate(counter.grain_id, b.address)  # lives on b
        assert await counter.add(1) == 1                       # a -> b over the twin
        await cluster.kill(b)
        await cluster.declare_dead(b)
        assert await counter.add(1) == 2                       # re-activated on a

Given a Redis client (``redis``: a real one, or a command-level twin such
as fakeredis, which is what the simulator gives it), the silo also runs the
services that talk to Redis directly, wired as ``silo/silo.py`` wires them:
the reminder service (its poller delivering ticks through the router) and one
stream agent per ``@subscribes`` namespace and type (rendezvous over the
active silos hosting the type, from the membership view); grains publish
through the same :class:`~silo.streams.stream.Streams`.

What stays out: the heartbeat thread and failure detector (a test declares a
silo dead with :meth:`InProcessCluster.declare_dead`, as their vote would),
the rebalancer, migrator, stream retention, stats and event log.

With a :class:`~silo.testing.clock.VirtualClock` installed and passed as
``clock``, idle collection, timers, call deadlines, router retries and the
view's periodic refresh follow virtual time. This module is the one place
that knows how a silo wires its catalog and messaging, so a change to that
wiring is mended here.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast, overload

from grains.base import DeactivationReason, Grain
from grains.call import Call, started
from grains.ids import GrainId, SiloAddress
from grains.observer import ObserverRef
from grains.placement import grain_options
from grains.ref import GrainRef, Ref
from grains.result_stream import StreamChannel
from grains.streams import subscriptions
from silo import errors
from silo.catalog.catalog import Catalog
from silo.catalog.grain_types import GrainTypes
from silo.catalog.pipeline import CallFilter, OutgoingFilter
from silo.catalog.runtime import RefFactory, SiloRuntime
from silo.cluster.placement import Placer
from silo.cluster.reminders import ReminderService, ReminderTable, ticks_through
from silo.cluster.view import MembershipView
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.messaging.dispatcher import Dispatcher
from silo.messaging.manifests import Manifests, TypeInfo
from silo.messaging.observer_hub import ObserverHub
from silo.messaging.router import MAX_RETRY_BACKOFF_S, RETRY_BACKOFF_S, Router
from silo.records.membership import MemberRow, SiloStatus
from silo.settings import CatalogSettings, RemindersSettings, StreamSettings, TransportSettings
from silo.storage.provider import REDIS, StorageProviders
from silo.storage.store import StateStore
from silo.streams.agent import StreamAgent
from silo.streams.stream import Streams
from silo.testing.directory import InMemoryGrainDirectory
from silo.testing.membership import InMemoryMembershipTable
from silo.testing.store import InMemoryStateStore
from silo.testing.transport import InMemoryNetwork, InMemoryTransport
from silo.tracing import call_carrier

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from silo.catalog.activation import Activation

ADDRESS = SiloAddress("127.0.0.1", 11111, 1)

G = TypeVar("G", bound=Grain)


class _LocalRouter:
    """The router's part for a silo alone: every call goes to its own dispatcher.

    The silo's real router does the same for a grain it finds on its own silo
    (a deadline from the call's timeout, the chain as the reference read it). A
    call the dispatcher forwards to this same silo (the directory named it the
    owner) is served again one hop further, as the real router's trip over the
    network back to its own silo would be.
    """

    def __init__(self, address: SiloAddress, call_timeout_s: float) -> None:
        self.dispatcher: Dispatcher | None = None
        self._address = address
        self._timeout_s = call_timeout_s
        self.stream_window = TransportSettings().stream_window
        self.calls = 0
        self.forwards = 0

    async def invoke(self, call: Call, one_way: bool = False, stream: StreamChannel | None = None) -> Any:
        assert self.dispatcher is not None, "InProcessSilo wires the dispatcher before any call"
        call = started(call)
        timeout = call.timeout_s if call.timeout_s is not None else self._timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        self.calls += 1
        trace = call_carrier(None)  # the request context, as the real router sends it
        if one_way:
            self.dispatcher.post(call, deadline, trace)
            return None
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                if stream is not None:
                    # As the real router opens a stream on its own silo (Router._opened).
                    stream.begin(self.stream_window, timeout)
                    scope = asyncio.timeout_at(deadline)
                    try:
                        async with scope:
                            return await self.dispatcher.dispatch(call, deadline, None, trace, stream=stream)
                    except TimeoutError:
                        if not scope.expired():
                            raise
                        raise errors.GrainTimeoutError(str(call.grain), call.method, timeout) from None
                return await self.dispatcher.dispatch(call, deadline, None, trace)
            except errors.LoadShedError as exc:
                # Shed unrun (a full mailbox): as the real router, back off (jittered) and send
                # it again until the deadline.
                attempt += 1
                backoff = min(RETRY_BACKOFF_S * 2**attempt, MAX_RETRY_BACKOFF_S) * random.uniform(0.5, 1.0)
                await asyncio.sleep(min(backoff, max(0.0, deadline - loop.time())))
                if deadline - loop.time() <= 0:
                    raise errors.GrainTimeoutError(str(call.grain), call.method, timeout) from exc

    async def versions_with(self, type_name: str, method: str) -> list[int]:
        raise errors.UnknownMethodError(type_name, method)  # one silo, one version: it has none

    async def newest_version(self, type_name: str, method: str | None) -> int | None:
        return None  # no other silo, so no newer version elsewhere

    async def refresh_membership(self) -> None:
        pass

    def forget(self, grain: GrainId) -> None:
        pass  # nothing cached: every call goes to this silo

    async def forward(
        self, target: SiloAddress, call: Call, deadline: float, trace: Any = None, *, stream: StreamChannel | None = None
    ) -> Any:
        assert self.dispatcher is not None
        if target != self._address:
            raise errors.SiloUnavailableError(
                str(target), f"{call.grain} is registered there; an in-process silo reaches no other"
            )
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise errors.GrainTimeoutError(str(call.grain), call.method, 0.0)
        self.forwards += 1
        if stream is not None:
            stream.begin(self.stream_window, call.timeout_s or self._timeout_s)
        return await self.dispatcher.dispatch(call.forwarded(remaining), deadline, None, trace, stream=stream)


class PublishedManifests(Manifests):
    """Manifests read from ``published`` (type -> version -> manifest: what every silo of the
    world published) instead of Redis."""

    def __init__(self, published: dict[str, dict[int, TypeInfo]], clock: Callable[[], float] = time.monotonic) -> None:
        # ``clock`` paces the re-reads after a miss (at most one a period): on virtual time,
        # the loop's, or a version published mid-run is never read again.
        super().__init__(cast(Any, None), Keys("in-process"), clock=clock)
        self.published = published

    async def _fetch(self) -> dict[str, dict[int, TypeInfo]]:
        return {name: dict(versions) for name, versions in self.published.items()}


class InProcessSilo:
    """A silo's catalog and dispatcher over the twins (see the module docstring).

    ``directory`` and ``store`` default to fresh twins (the store fenced by the
    directory's tokens); pass shared ones to give several silos one backend.
    ``clock`` is the catalog's clock (idle collection) and the membership
    twin's. With ``network``, the silo is reached at ``address`` (default: a
    free port there) through a transport twin, and ``membership`` (default: a
    fresh twin) and ``published`` (the world's grain types) are shared with the
    other silos. ``store`` stands in for the built-in "redis" storage provider;
    ``storage`` adds others by name (``@storage("name")``). ``filters`` and
    ``outgoing_filters`` are the silo's incoming and outgoing call filters;
    ``fenced`` and ``confirm_alive`` its liveness (a heartbeat's, as ``silo/silo.py``
    gives the dispatcher; the simulator's loop heartbeat), by default always live.
    ``wall_clock`` stamps the membership row's start and first heartbeat, as
    ``silo/silo.py`` stamps them with ``time.time`` (default: ``clock``); the
    simulator gives it a wall clock that jumps.
    ``redis`` (with ``keys``, ``reminders`` and ``streams`` settings) adds the
    services that talk to Redis directly: reminders and stream delivery.
    """

    def __init__(
        self,
        grains: Iterable[type[Grain]],
        *,
        clock: Callable[[], float] = time.monotonic,
        settings: CatalogSettings | None = None,
        directory: InMemoryGrainDirectory | None = None,
        store: InMemoryStateStore | None = None,
        address: SiloAddress | None = None,
        call_timeout_s: float = 30.0,
        network: InMemoryNetwork | None = None,
        membership: InMemoryMembershipTable | None = None,
        published: dict[str, dict[int, TypeInfo]] | None = None,
        transport_settings: TransportSettings | None = None,
        placer: Placer | None = None,
        roles: Sequence[str] = (),
        refresh_s: float = 2.0,
        storage: Mapping[str, StateStore] | None = None,
        filters: Sequence[CallFilter] = (),
        outgoing_filters: Sequence[OutgoingFilter] = (),
        fenced: Callable[[], bool] | None = None,
        confirm_alive: Callable[[float], Awaitable[bool]] | None = None,
        wall_clock: Callable[[], float] | None = None,
        redis: aioredis.Redis | None = None,
        keys: Keys | None = None,
        reminders: RemindersSettings | None = None,
        streams: StreamSettings | None = None,
    ) -> None:
        if address is None:
            address = ADDRESS if network is None else SiloAddress("127.0.0.1", network.free_port(), 1)
        self.address = address
        self.settings = settings or CatalogSettings()
        self.clock = clock
        self.wall_clock = wall_clock or clock
        self.roles = list(roles)
        self.types = GrainTypes(grains)
        registry = TypeRegistry()
        for cls in self.types.classes():
            registry.register_annotations(cls)
        self.codec = Codec(registry)
        self.network = network
        self.membership = membership or (InMemoryMembershipTable(clock) if network is not None else None)
        default_directory = InMemoryGrainDirectory(self.membership.is_alive) if self.membership else None
        self.directory = directory or default_directory or InMemoryGrainDirectory()
        self.store = store or InMemoryStateStore(owner=self.directory.token_of)
        self.manifests = PublishedManifests({} if published is None else published, clock)
        for name in self.types.names():
            opts = self.types.options(name)
            self.manifests.add_local(
                TypeInfo(
                    name, self.types.methods(name), opts.placement, opts.stateless_worker, opts.one_way, opts.version,
                    streams=self.types.streams(name),
                )
            )
        self.transport: InMemoryTransport | None = None
        self.view: MembershipView | None = None
        router: Router | _LocalRouter
        if network is None:
            router = _LocalRouter(address, call_timeout_s)
        else:
            assert self.membership is not None
            ts = transport_settings or TransportSettings(call_timeout_s=call_timeout_s, local_sockets=False)
            self.transport = InMemoryTransport(ts, self.codec, network=network)
            self.view = MembershipView(self.membership, refresh_s=refresh_s)
            router = Router(
                transport=self.transport,
                directory=self.directory,
                view=self.view,
                manifests=self.manifests,
                placer=placer or Placer(),
                call_timeout_s=ts.call_timeout_s,
                stream_window=ts.stream_window,
            )
        self.router = router
        self.refs = RefFactory(router, self.manifests, self.codec)
        # The in-memory store stands in for "redis", the built-in default provider.
        self.storage = StorageProviders({REDIS: self.store, **(storage or {})})
        self.storage.check(self.types.classes())
        # Observers made here (by grains, or by the test through observer()) are owned by this
        # silo; on a network, calls to other silos' observers go over the transport twin.
        self.observers = ObserverHub(
            owner=str(address), codec=self.codec, transport=self.transport, call_timeout_s=call_timeout_s
        )
        self.redis = redis
        self.keys = keys or Keys("in-process")
        self.reminder_settings = reminders or RemindersSettings()
        self.stream_settings = streams or StreamSettings()
        self.reminders: ReminderService | None = None
        self.streams: Streams | None = None
        self.stream_agents: list[StreamAgent] = []
        if redis is not None:
            # As silo.py builds them; the delivery is given at start (ReminderService.start).
            self.reminders = ReminderService(ReminderTable(redis, self.keys), self.reminder_settings)
            # The clock read at each call: a simulation replaces time.time for its run.
            self.streams = Streams(redis, self.keys, self.codec, self.stream_settings, clock=lambda: time.time())
        self.runtime = SiloRuntime(
            device="cpu",
            refs=self.refs,
            store=self.storage,
            codec=self.codec,
            threads=self.settings.thread_pool_size,
            view=self.view,
            redis=redis,
            keys=self.keys if redis is not None else None,
            reminders=self.reminders,
            outgoing_filters=list(outgoing_filters),
            observers=self.observers,
            streams=self.streams,
        )
        self.catalog = Catalog(
            settings=self.settings,
            silo=address,
            types=self.types,
            directory=self.directory,
            runtime=self.runtime,
            filters=list(filters),
            clock=clock,
        )
        liveness: dict[str, Any] = {}
        if fenced is not None:
            liveness["fenced"] = fenced
        if confirm_alive is not None:
            liveness["confirm_alive"] = confirm_alive
        self.dispatcher = Dispatcher(address=address, catalog=self.catalog, types=self.types, router=cast(Any, router),
                                     codec=self.codec, observers=self.observers, **liveness)  # fmt: skip
        if isinstance(router, _LocalRouter):
            router.dispatcher = self.dispatcher
        else:
            # The two links silo.py makes after construction: own grains' calls go to the
            # dispatcher without the network, and requests from the network go to it too.
            router.set_local(self.dispatcher)
            assert self.transport is not None
            self.transport.set_handler(self.dispatcher.on_frame)
        self._started = False
        self.killed = False

    # --- life ----------------------------------------------------------------------
    async def start(self) -> Self:
        """Start idle collection (every ``collection_interval_s`` of the loop's time); on a
        network, first listen, join the membership table and publish the grain types."""
        if self.transport is not None and self.membership is not None and self.view is not None:
            me = self.address
            await self.transport.listen(me.host, me.port)
            now = self.wall_clock()
            row = MemberRow(
                address=str(me), host=me.host, port=me.port, generation=me.generation, roles=self.roles,
                grain_types=self.types.names(), grain_versions=self.types.versions(), started=now, heartbeat=now, pid=os.getpid(), hostname="in-process",
            )  # fmt: skip
            await self.membership.join(row)
            for name in self.types.names():
                opts = self.types.options(name)
                own = TypeInfo(
                    name, self.types.methods(name), opts.placement, opts.stateless_worker, opts.one_way, opts.version,
                    streams=self.types.streams(name),
                )
                self.manifests.published.setdefault(name, {})[opts.version] = own
            await self.membership.set_status(str(me), SiloStatus.ACTIVE)
            await self.view.start()
            await self.manifests.refresh()
        self.catalog.start()
        self._started = True
        self._start_redis_services()
        return self

    def _start_redis_services(self) -> None:
        """Reminders and stream delivery, last as in silo.py's ``_stage_services`` (they make calls)."""
        if self.reminders is not None:
            self.reminders.start(ticks_through(cast(Any, self.router), self.reminder_settings.delivery_timeout_s))
            if self.view is not None:
                # A silo that left may have been the one firing reminders others sleep past.
                reminders = self.reminders
                self.view.on_change(lambda old, new: reminders.wake())
        if self.redis is None:
            return
        for cls in self.types.classes():
            type_name = grain_options(cls).type_name
            for namespace in subscriptions(cls):
                agent = StreamAgent(
                    redis=self.redis, keys=self.keys, namespace=namespace, group=type_name, me=str(self.address),
                    candidates=functools.partial(self._hosting, type_name), is_dead=self._is_dead,
                    caller=cast(Any, self.router), codec=self.codec, settings=self.stream_settings,
                )  # fmt: skip
                self.stream_agents.append(agent)
                agent.start()

    def _hosting(self, type_name: str) -> list[str]:
        if self.view is None:
            return [str(self.address)]
        return [r.address for r in self.view.hosting(type_name)]

    def _is_dead(self, address: str) -> bool:
        if self.view is None:
            return False
        try:
            row = self.view.row(SiloAddress.parse(address))
        except ValueError:
            return False
        return row is not None and row.status is SiloStatus.DEAD

    async def _stop_redis_services(self, *, release: bool) -> None:
        # A killed silo touches nothing in Redis: its leases run out or are taken.
        await asyncio.gather(*(a.stop(release=release) for a in self.stream_agents))
        self.stream_agents = []
        if self.reminders is not None:
            await self.reminders.stop()

    async def stop(self) -> None:
        """Deactivate every activation (as a silo shutting down does), then stop.

        On a network, the row goes ShuttingDown first (callers place elsewhere) and the
        dispatcher drains (calls re-routed from a deactivated grain are turned away, and the
        callers' routers retry elsewhere); then the row is Dead, the directory purged of this
        silo, the transport closed.
        """
        if not self._started:
            return
        self._started = False
        await self._stop_redis_services(release=True)
        alive = self.membership is not None and self.membership.is_alive(self.address)
        if self.membership is not None and alive:
            await self.membership.set_status(str(self.address), SiloStatus.SHUTTING_DOWN)
            self.dispatcher.draining = True
        await self.catalog.deactivate_all(DeactivationReason.SHUTDOWN)
        await self.catalog.stop()
        if self.membership is not None and alive:
            await self.membership.set_status(str(self.address), SiloStatus.DEAD)
            await self.directory.purge_silo(self.address)
        if self.view is not None:
            await self.view.stop()
        self.observers.close()
        await self.dispatcher.close()
        if self.transport is not None:
            await self.transport.close()
        self.runtime.shutdown()

    async def kill(self) -> None:
        """The process is gone: its endpoint stops answering, its connections reset, its
        activations vanish. Nothing is written to the membership table or the directory:
        the row stays as it was until the cluster declares the silo dead."""
        if self.transport is None:
            raise RuntimeError("only a silo on a network can be killed (InProcessSilo(network=...))")
        self.killed = True
        self.transport.abort_all()
        self.catalog.drop_all_nowait()
        self.observers.close()
        self.dispatcher.closed = True
        if not self._started:
            return
        self._started = False
        await self._stop_redis_services(release=False)
        if self.view is not None:
            await self.view.stop()
        await self.catalog.stop()
        await self.dispatcher.close()
        self.runtime.shutdown()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --- calls and activations -------------------------------------------------------
    @overload
    def get_grain(self, grain: type[G], key: Any) -> Ref[G]: ...
    @overload
    def get_grain(self, grain: str, key: Any) -> GrainRef: ...
    def get_grain(self, grain: type[Grain] | str, key: Any) -> GrainRef:
        """A reference whose calls come from outside any grain (as a client's do); typed as
        the client's (``Ref[G]`` for a class, ``GrainRef`` for a type name)."""
        return self.refs.get_grain(grain, key)

    def observer(self, handler: object) -> ObserverRef:
        """A reference to ``handler`` that grains can call back (as ``client.observer`` makes), owned
        by this silo: it lives until disposed or the silo stops."""
        return self.observers.create(handler)

    def activation(self, ref: GrainRef | GrainId) -> Activation | None:
        """The live activation of a reference's grain (or a GrainId's), if there is one."""
        grain = ref if isinstance(ref, GrainId) else ref.grain_id
        return self.catalog.get(grain)

    @overload
    def instance(self, ref: Ref[G]) -> G: ...
    @overload
    def instance(self, ref: GrainRef | GrainId) -> Any: ...
    def instance(self, ref: GrainRef | GrainId) -> Any:
        """The grain object behind a reference (its activation must be live): a ``G`` for a
        ``Ref[G]``, so a test reads its fields typed."""
        act = self.activation(ref)
        if act is None:
            raise LookupError(f"{ref!r} has no live activation on this silo")
        return act.instance

    async def deactivate(self, ref: GrainRef | GrainId, reason: DeactivationReason = DeactivationReason.REQUESTED) -> None:
        """Deactivate a grain's activation now and wait until it is gone."""
        act = self.activation(ref)
        if act is not None:
            await self.catalog.deactivate(act, reason)


class InProcessCluster:
    """N :class:`InProcessSilo` on one :class:`InMemoryNetwork`, sharing one directory,
    membership table and state store (see the module docstring).

    ``silos``: how many start with the cluster (more join with :meth:`add_silo`).
    ``seed`` makes random placement repeatable (silo ``i`` places with ``seed + i``).
    """

    def __init__(
        self,
        grains: Iterable[type[Grain]],
        *,
        silos: int = 2,
        clock: Callable[[], float] = time.monotonic,
        settings: CatalogSettings | None = None,
        transport_settings: TransportSettings | None = None,
        call_timeout_s: float = 30.0,
        refresh_s: float = 2.0,
        seed: int = 0,
    ) -> None:
        self.grains = list(grains)
        self.clock = clock
        self.settings = settings
        self.transport_settings = transport_settings
        self.call_timeout_s = call_timeout_s
        self.refresh_s = refresh_s
        self.seed = seed
        self.network = InMemoryNetwork()
        self.membership = InMemoryMembershipTable(clock)
        self.directory = InMemoryGrainDirectory(self.membership.is_alive)
        self.store = InMemoryStateStore(owner=self.directory.token_of)
        self.published: dict[str, dict[int, TypeInfo]] = {}
        """The grain types every silo published (the Redis hash of manifests)."""
        self.silos: list[InProcessSilo] = []
        self._initial = silos

    async def add_silo(self, grains: Iterable[type[Grain]] | None = None, *, roles: Sequence[str] = ()) -> InProcessSilo:
        """Start one more silo (hosting ``grains``, default the cluster's) and let every view see it."""
        generation = await self.membership.new_generation()
        silo = InProcessSilo(
            self.grains if grains is None else grains,
            clock=self.clock,
            settings=self.settings,
            directory=self.directory,
            store=self.store,
            address=SiloAddress("127.0.0.1", self.network.free_port(), generation),
            call_timeout_s=self.call_timeout_s,
            network=self.network,
            membership=self.membership,
            published=self.published,
            transport_settings=self.transport_settings,
            placer=Placer(random.Random(self.seed + len(self.silos))),
            roles=roles,
            refresh_s=self.refresh_s,
        )
        self.silos.append(silo)
        await silo.start()
        await self.refresh()  # as the table's channel announces a join within ~50 ms
        return silo

    async def kill(self, silo: InProcessSilo) -> None:
        """``silo``'s process is gone (see :meth:`InProcessSilo.kill`); it stays Active in the
        table until :meth:`declare_dead`."""
        await silo.kill()

    async def declare_dead(self, silo: InProcessSilo) -> None:
        """What the failure detector's vote does: the row Dead, and every live view told."""
        row = self.membership.rows.get(str(silo.address))
        if row is not None and row.status is not SiloStatus.DEAD:
            await self.membership.set_status(str(silo.address), SiloStatus.DEAD)
        await self.refresh()

    async def refresh(self) -> None:
        """Every running silo re-reads the membership table now."""
        for silo in self.silos:
            if silo._started and silo.view is not None:
                await silo.view.refresh()

    def silo_of(self, ref: Any) -> InProcessSilo | None:
        """The silo the directory names as the grain's owner now (a reference or a GrainId)."""
        grain = ref if isinstance(ref, GrainId) else ref.grain_id
        entry = self.directory.entries().get(grain)
        return next((s for s in self.silos if entry is not None and s.address == entry.silo), None)

    async def start(self) -> Self:
        for _ in range(self._initial - len(self.silos)):
            await self.add_silo()
        return self

    async def stop(self) -> None:
        """Stop every silo still running, last joined first."""
        for silo in reversed(self.silos):
            await silo.stop()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
