"""Storage providers: where grain states live, chosen by name.

A provider is any object with the :class:`~silo.storage.store.StateStore`
interface (read, write, write_stream, clear, statistics; the rules are on the
protocol and in the contract tests every provider runs). ``redis``
(:class:`~silo.storage.store.RedisStateStore`) is built in and the default;
others are named in the settings::

    REDGRAIN_STORAGE__PROVIDERS='{"files": {"factory": "silo.storage.sqlite:provider",
                                             "options": {"path": "/var/lib/app/states.db"}}}'

and each silo builds its own at start by calling ``factory(context, **options)``
with a :class:`ProviderContext` (no process-wide registry: two silos in one
process may name different ones). A grain class picks one with
``@storage("files")``, a named state with ``self.named_state(..., storage="files")``;
``storage.default_provider`` is the provider of grains that name none.

Fencing: a provider must refuse a write whose token is not the one the grain's
directory entry holds (``context.owner`` reads it). Redis checks it in the same
script as the write; a provider outside Redis reads it before its own commit,
so a zombie whose check passed a moment before the grain moved may still land
one write. The new activation then finds an etag it did not read, its write is
refused with StateConflictError and it reloads: the zombie's write is never
lost silently, and nothing the new activation acknowledged is overwritten.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from grains.ids import GrainId
from grains.placement import grain_options
from silo import errors
from silo.keys import Keys
from silo.plugins import import_object
from silo.settings import StorageSettings
from silo.storage.store import RedisStateStore, StateStore, StorageStatistics

log = logging.getLogger("redgrain.storage")

REDIS = "redis"
"""The built-in provider's name."""


@dataclass(frozen=True, slots=True)
class ProviderContext:
    """What a provider factory is given."""

    name: str
    """The name the settings give the provider."""
    redis: aioredis.Redis
    """The silo's Redis client (a provider may keep indexes there; keys from ``keys``)."""
    keys: Keys
    """The cluster's key builder."""
    settings: StorageSettings
    """The storage section (retries, chunk sizes) for providers that want the same tuning."""
    owner: Callable[[GrainId], Awaitable[int]]
    """The fencing token of the grain's directory entry, read fresh from the directory; 0: none."""


class StorageProviders:
    """The storage providers of one silo, by name."""

    def __init__(self, stores: Mapping[str, StateStore], default: str = REDIS) -> None:
        if default not in stores:
            raise errors.ConfigError(f"default storage provider {default!r} is not one of {sorted(stores)}")
        self._stores = dict(stores)
        self.default = default

    @classmethod
    def build(
        cls,
        settings: StorageSettings,
        redis: aioredis.Redis,
        keys: Keys,
        owner: Callable[[GrainId], Awaitable[int]],
    ) -> StorageProviders:
        """Redis plus every provider ``settings.providers`` names, each from its factory."""
        stores: dict[str, StateStore] = {REDIS: RedisStateStore(redis, keys, settings)}
        for name, spec in settings.providers.items():
            factory = import_object(spec.factory, f"storage provider {name!r}")
            context = ProviderContext(name, redis, keys, settings, owner)
            try:
                store = factory(context, **spec.options)
            except Exception as exc:
                raise errors.ConfigError(
                    f"storage provider {name!r}: {spec.factory}(context, **{spec.options!r}) failed: {exc}"
                ) from exc
            missing = [m for m in ("read", "write", "write_stream", "clear", "statistics") if not hasattr(store, m)]
            if missing:
                raise errors.ConfigError(
                    f"storage provider {name!r}: {spec.factory} returned a {type(store).__name__},"
                    f" which lacks {', '.join(missing)} (see silo.storage.store.StateStore)"
                )
            stores[name] = store
        return cls(stores, settings.default_provider)

    def get(self, name: str | None = None) -> StateStore:
        """The provider called ``name`` (None: the default one)."""
        try:
            return self._stores[self.default if name is None else name]
        except KeyError:
            raise errors.ConfigError(
                f"no storage provider {name!r} on this silo (it has {', '.join(sorted(self._stores))};"
                " add it to storage.providers)"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._stores)

    def check(self, classes: Iterable[type]) -> None:
        """Every provider a grain class names exists (a typo fails the start, not the first call)."""
        for cls in classes:
            name = grain_options(cls).storage
            if name is not None and name not in self._stores:
                raise errors.ConfigError(
                    f"grain {cls.__qualname__} uses @storage({name!r}), which this silo's settings"
                    f" do not define (it has {', '.join(sorted(self._stores))})"
                )

    async def close(self) -> None:
        """Close the providers that have ``aclose()`` or ``close()`` (Redis belongs to the silo)."""
        for name, store in self._stores.items():
            if name == REDIS:
                continue
            closer = getattr(store, "aclose", None) or getattr(store, "close", None)
            if closer is None:
                continue
            try:
                result = closer()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("closing storage provider %r failed", name)

    def statistics(self) -> dict[str, StorageStatistics]:
        return {name: store.statistics() for name, store in self._stores.items()}


def directory_owner(directory: Any) -> Callable[[GrainId], Awaitable[int]]:
    """``ProviderContext.owner`` over a grain directory: its entry's token, read fresh."""

    async def owner(grain: GrainId) -> int:
        entry = await directory.lookup(grain)
        return 0 if entry is None else int(entry.token)

    return owner


__all__ = ["REDIS", "ProviderContext", "StorageProviders", "directory_owner"]
