"""ClusterClient: call grains from outside the cluster.

::

    async with await ClusterClient.connect("redis://127.0.0.1:6379", cluster="dev") as client:
        counter = client.get_grain(Counter, "user-42")
        await counter.add(5)

The client reads membership and grain-type manifests from Redis, places new
activations itself (as a silo would), and talks to silos directly over TCP.
``ClusterClient.connect("embedded")`` starts a private redis-server for a
single-machine try-out. ``tracing=Tracing(provider)`` (:mod:`silo.tracing`)
makes every call a CLIENT span whose context travels with the call.
Outgoing call filters (``outgoing_filters=[...]``, then the settings'
``outgoing_filters`` by import path) run around every call the client makes.

``await client.observer(handler)`` makes a reference grains can call back
(:mod:`grains.observer`); the calls come back over the connections this client
opened, which it names with its ``client_id`` (:mod:`silo.messaging.observer_hub`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self, TypeVar, overload

from grains.base import Grain
from grains.observer import CLIENT_PREFIX, ObserverRef
from grains.ref import GrainRef, Ref
from silo import errors
from silo.catalog.pipeline import OutgoingFilter, filtered_caller
from silo.catalog.runtime import RefFactory
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.membership import RedisMembershipTable
from silo.cluster.placement import Placer
from silo.cluster.view import MembershipView
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.messaging.manifests import Manifests
from silo.messaging.observer_hub import ObserverHub
from silo.messaging.router import Router
from silo.messaging.transport import Transport
from silo.plugins import load_filters
from silo.redis_url import redact
from silo.redis_util import open_redis
from silo.settings import ClientSettings
from silo.shutdown import ShutdownHook
from silo.streams.stream import RedisStream, Streams

if TYPE_CHECKING:
    from silo.tracing import Tracing

log = logging.getLogger("redgrain.client")

G = TypeVar("G", bound=Grain)


class ClusterClient:
    def __init__(
        self,
        settings: ClientSettings,
        *,
        types: Iterable[type] = (),
        tracing: Tracing | None = None,
        outgoing_filters: Iterable[OutgoingFilter] = (),
    ) -> None:
        self.settings = settings
        self.tracing = tracing
        self._outgoing = [*outgoing_filters, *load_filters(settings.outgoing_filters, "outgoing filter")]
        self.keys = Keys(settings.cluster)
        self.client_id = uuid.uuid4().hex
        """Names this client to the silos it connects to (its observers' calls come back to it)."""
        self._types = list(types)
        self._embedded: Any = None
        self._hook: ShutdownHook | None = None
        self.closed = True
        self._own_tracing = tracing is None and settings.tracing.enabled
        if self._own_tracing:
            from silo.tracing import Tracing

            self.tracing = Tracing.from_settings(settings.tracing)

    @classmethod
    async def connect(
        cls,
        redis_url: str | None = None,
        *,
        cluster: str | None = None,
        settings: ClientSettings | None = None,
        types: Iterable[type] = (),
        tracing: Tracing | None = None,
        outgoing_filters: Iterable[OutgoingFilter] = (),
    ) -> ClusterClient:
        """Connect to the cluster whose state lives in ``redis_url`` ("embedded": a private Redis).

        ``tracing``: spans for the calls made through this client (None: what
        ``settings.tracing`` says, off by default, at no cost). ``outgoing_filters``:
        ``async def f(ctx, call_next)`` run around every call, before the settings' ones.
        """
        base = settings or ClientSettings()
        update: dict[str, Any] = {}
        if redis_url is not None:
            update["redis_url"] = redis_url
        if cluster is not None:
            update["cluster"] = cluster
        client = cls(
            base.model_copy(update=update) if update else base,
            types=types,
            tracing=tracing,
            outgoing_filters=outgoing_filters,
        )
        await client._start()
        return client

    async def _start(self) -> None:
        s = self.settings
        url = s.redis_url
        if url == "embedded":
            from silo.testing.embedded import RedisServer

            self._embedded = RedisServer(data_dir=".redgrain", appendonly=True)
            await self._embedded.__aenter__()
            url = self._embedded.url
        self.redis_url = url
        self.redis = await open_redis(url, f"connect to {redact(url)}")
        registry = TypeRegistry()
        for t in self._types:
            registry.register_annotations(t)
        self.codec = Codec(registry)
        self.transport = Transport(s.transport, self.codec)
        self.observers = ObserverHub(
            owner=CLIENT_PREFIX + self.client_id,
            codec=self.codec,
            transport=self.transport,
            call_timeout_s=s.transport.call_timeout_s,
        )
        self.transport.set_handler(self.observers.on_frame)
        table = RedisMembershipTable(self.redis, self.keys)
        self.view = MembershipView(
            table, redis=self.redis, keys=self.keys, refresh_s=s.membership.refresh_s, load_sample=s.membership.load_sample
        )
        # The router's location cache is the one calls read (directory.cache_size); the
        # directory's own entry cache would hold the same grains again at ~530 B each.
        self.directory = RedisGrainDirectory(self.redis, self.keys, cache_size=0)
        self.manifests = Manifests(self.redis, self.keys)
        self.router = Router(
            transport=self.transport,
            directory=self.directory,
            view=self.view,
            manifests=self.manifests,
            placer=Placer(),
            call_timeout_s=s.transport.call_timeout_s,
            stream_window=s.transport.stream_window,
            cache_size=s.directory.cache_size,
            tracing=self.tracing,
        )
        caller = self.router if self.tracing is None else self.tracing.caller(self.router)
        self._refs = RefFactory(filtered_caller(caller, self._outgoing), self.manifests, self.codec)
        self.streams = Streams(self.redis, self.keys, self.codec, s.streams)
        await self.view.start()
        await self.manifests.refresh()
        self.closed = False
        # A script that raises before closing us must still end: when asyncio.run
        # (or any loop's shutdown) cancels its tasks, this closes the client.
        self._hook = ShutdownHook(self.close, name="cluster client")

    @overload
    def get_grain(self, grain: type[G], key: Any) -> Ref[G]: ...
    @overload
    def get_grain(self, grain: str, key: Any) -> GrainRef: ...
    def get_grain(self, grain: type[Grain] | str, key: Any) -> GrainRef:
        """A reference to a grain; no lookup, no activation until the first call.

        ``Ref[G]`` for a grain class (typed with its public async methods by the mypy
        plugin, grains/mypy_plugin.py); a plain ``GrainRef`` for a type name."""
        if self.closed:
            raise errors.SiloClosedError("cluster client")
        return self._refs.get_grain(grain, key)

    async def observer(self, handler: object) -> ObserverRef:
        """A reference to ``handler`` (a plain object: its public async methods are the interface)
        that grains can be given and call back, for as long as this client is open or until
        ``await obs.dispose()``. See :mod:`grains.observer` and ``grains.ObserverSet``."""
        if self.closed:
            raise errors.SiloClosedError("cluster client")
        ref = self.observers.create(handler)
        self.transport.identify_as(self.client_id)  # from the first observer on (see identify_as)
        return ref

    def stream(self, namespace: str, key: Any) -> RedisStream:
        """A handle on stream ``(namespace, key)``: ``await s.publish(item)`` returns the item's
        token; ``async for ev in s.subscribe(from_start=True)`` reads it (grains/streams.py)."""
        if self.closed:
            raise errors.SiloClosedError("cluster client")
        return self.streams.stream(namespace, key)

    async def refresh(self) -> None:
        """Re-read membership and grain types now (they also refresh by themselves)."""
        await self.view.refresh()
        await self.manifests.refresh()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._hook is not None:
            self._hook.disarm()
        self.observers.close()
        await self.view.stop()
        await self.transport.close()
        await self.redis.aclose()
        if self._own_tracing and self.tracing is not None:
            # Flushing to a collector that is down can take its export timeout: off the loop.
            await asyncio.to_thread(self.tracing.shutdown)
        if self._embedded is not None:
            await self._embedded.__aexit__(None, None, None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def statistics(self) -> dict[str, Any]:
        return {
            "transport": self.transport.statistics(),
            "router": self.router.statistics(),
            "observers": self.observers.statistics(),
            "membership": self.view.statistics(),
        }


