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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self, TypeVar

from silo import errors
from silo.catalog.runtime import RefFactory
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.membership import RedisMembershipTable
from silo.cluster.placement import Placer
from silo.cluster.view import MembershipView
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.messaging.manifests import Manifests
from silo.messaging.router import Router
from silo.messaging.transport import Transport
from silo.redis_util import connect_redis, verify_redis
from silo.settings import ClientSettings
from silo.shutdown import ShutdownHook

if TYPE_CHECKING:
    from silo.tracing import Tracing

log = logging.getLogger("redgrain.client")

G = TypeVar("G")


class ClusterClient:
    def __init__(
        self, settings: ClientSettings, *, types: Iterable[type] = (), tracing: Tracing | None = None
    ) -> None:
        self.settings = settings
        self.tracing = tracing
        self.keys = Keys(settings.cluster)
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
    ) -> ClusterClient:
        """Connect to the cluster whose state lives in ``redis_url`` ("embedded": a private Redis).

        ``tracing``: spans for the calls made through this client (None: what
        ``settings.tracing`` says, off by default, at no cost).
        """
        base = settings or ClientSettings()
        update: dict[str, Any] = {}
        if redis_url is not None:
            update["redis_url"] = redis_url
        if cluster is not None:
            update["cluster"] = cluster
        client = cls(base.model_copy(update=update) if update else base, types=types, tracing=tracing)
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
        self.redis = connect_redis(url)
        try:
            await verify_redis(self.redis, f"connect to {url}")
        except (errors.StorageError, errors.ConfigError):
            await self.redis.aclose()
            raise
        registry = TypeRegistry()
        for t in self._types:
            registry.register_annotations(t)
        self.codec = Codec(registry)
        self.transport = Transport(s.transport, self.codec)
        table = RedisMembershipTable(self.redis, self.keys)
        self.view = MembershipView(table, redis=self.redis, keys=self.keys, refresh_s=s.membership.refresh_s)
        self.directory = RedisGrainDirectory(self.redis, self.keys)
        self.manifests = Manifests(self.redis, self.keys)
        self.router = Router(
            transport=self.transport,
            directory=self.directory,
            view=self.view,
            manifests=self.manifests,
            placer=Placer(),
            call_timeout_s=s.transport.call_timeout_s,
            tracing=self.tracing,
        )
        caller = self.router if self.tracing is None else self.tracing.caller(self.router)
        self._refs = RefFactory(caller, self.manifests, self.codec)
        await self.view.start()
        await self.manifests.refresh()
        self.closed = False
        # A script that raises before closing us must still end: when asyncio.run
        # (or any loop's shutdown) cancels its tasks, this closes the client.
        self._hook = ShutdownHook(self.close, name="cluster client")

    def get_grain(self, grain: type[G] | str, key: Any) -> G:
        """A reference to a grain; no lookup, no activation until the first call."""
        if self.closed:
            raise errors.SiloClosedError("cluster client")
        return self._refs.get_grain(grain, key)  # type: ignore[arg-type, no-any-return]

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
            "membership": self.view.statistics(),
        }


