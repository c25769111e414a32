"""Grain type manifests: the method lists (and markers) of every version of every grain type.

Each silo publishes one manifest per (type, ``@version``) it hosts, under its
own field of ``Keys.grain_manifests``, so silos of two versions side by side
do not overwrite each other; which version each silo hosts is in its
membership row (``MemberRow.grain_versions``). A caller (silo or client)
caches them all and routes by them (:mod:`silo.cluster.versions` holds the
rule).

A caller whose cache lacks a method does not refuse the call at once: the
method may belong to a version that joined after the cache was read (a
rolling upgrade). It re-reads the manifests, at most once per
``refresh_period_s`` for each (type, method) it misses (so a caller that
keeps asking for a method nobody has costs one Redis read a period, not one
a call); concurrent misses of one method share one read. Still missing after that:
``UnknownMethodError`` naming the type, the method and the versions known.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from grains.placement import Placement
from silo import errors
from silo.keys import Keys, parse_manifest_field
from silo.redis_util import redis_errors

log = logging.getLogger("redgrain.manifests")

MAX_REMEMBERED_MISSES = 10_000
"""(type, method) misses remembered for the refresh bound; forgotten all at once past this."""


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """What a caller needs to route calls to a grain type.

    Built from one version's manifest (``version``), or combined over every
    version known (:func:`combine`): then ``methods`` is every version's methods
    together and ``versions`` says which version has which.
    """

    name: str
    methods: frozenset[str]
    placement: Placement
    stateless_worker: int = 0
    one_way: frozenset[str] = frozenset()
    version: int = 1
    """The newest version this describes."""
    versions: Mapping[int, frozenset[str]] = field(default_factory=dict)
    """Version -> its methods (empty: ``{version: methods}``)."""
    keep_alive: bool = False
    streams: frozenset[str] = frozenset()
    """Methods written as async generators: iterated by the caller (grains/result_stream.py)."""

    def __post_init__(self) -> None:
        if not self.versions:
            object.__setattr__(self, "versions", {self.version: self.methods})

    def versions_with(self, method: str) -> list[int]:
        """The known versions whose method list has ``method``, oldest first."""
        return sorted(v for v, methods in self.versions.items() if method in methods)


def combine(infos: Mapping[int, TypeInfo]) -> TypeInfo:
    """One TypeInfo over several versions of a type: markers from the newest version, and a
    method's one-way and stream markers from the newest version that has it."""
    newest = infos[max(infos)]
    methods = frozenset().union(*(i.methods for i in infos.values()))
    if len(infos) == 1:
        return newest
    newest_with = {m: infos[max(v for v, i in infos.items() if m in i.methods)] for m in methods}
    one_way = frozenset(m for m in methods if m in newest_with[m].one_way)
    streams = frozenset(m for m in methods if m in newest_with[m].streams)
    return TypeInfo(
        name=newest.name,
        methods=methods,
        placement=newest.placement,
        stateless_worker=newest.stateless_worker,
        one_way=one_way,
        version=newest.version,
        versions={v: i.methods for v, i in sorted(infos.items())},
        keep_alive=any(i.keep_alive for i in infos.values()),
        streams=streams,
    )


def info_from_manifest(name: str, version: int, m: Mapping[str, Any]) -> TypeInfo:
    return TypeInfo(
        name=name,
        methods=frozenset(m["methods"]),
        placement=Placement(m["placement"], m.get("role")),
        stateless_worker=int(m.get("stateless_worker", 0)),
        one_way=frozenset(m.get("one_way", ())),
        version=version,
        keep_alive=bool(m.get("keep_alive", False)),
        streams=frozenset(m.get("streams", ())),
    )


def parse_manifests(raw: Mapping[Any, Any]) -> dict[str, dict[int, TypeInfo]]:
    """The ``grain_manifests`` hash as type -> version -> TypeInfo (unreadable entries skipped)."""
    out: dict[str, dict[int, TypeInfo]] = {}
    for key, text in raw.items():
        try:
            name, version = parse_manifest_field(key)
            out.setdefault(name, {})[version] = info_from_manifest(name, version, json.loads(text))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("skipping unreadable grain manifest %r: %s", key, exc)
    return out


@dataclass(frozen=True, slots=True)
class ManifestsStatistics:
    reads: int
    """Times every manifest was read from Redis (start, refreshes, misses)."""
    versions: dict[str, list[int]]
    """Grain type -> the versions whose method lists are known here."""


class Manifests:
    """Every version's manifest of every grain type, cached; this silo's own types always known."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        refresh_period_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._period_s = refresh_period_s
        self._clock = clock
        self._published: dict[str, dict[int, TypeInfo]] = {}
        self._local: dict[str, TypeInfo] = {}
        self._types: dict[str, TypeInfo] = {}
        """Type -> its versions combined: what get_nowait answers (one dict lookup per call)."""
        self._missed: dict[tuple[str, str], float] = {}
        """(type, method or '@version') -> when a refresh was last made for it."""
        self._reading: asyncio.Task[None] | None = None
        self._pending: dict[tuple[str, str], asyncio.Task[None]] = {}
        """Reads under way for a miss, shared by whoever misses the same meanwhile."""
        self.refreshes = 0

    def add_local(self, info: TypeInfo) -> None:
        self._local[info.name] = info
        self._combine(info.name)

    def get_nowait(self, name: str) -> TypeInfo | None:
        return self._types.get(name)

    async def get(self, name: str) -> TypeInfo:
        info = self._types.get(name)
        if info is None:
            await self.refresh()
            info = self._types.get(name)
        if info is None:
            raise errors.UnknownGrainError(name, "no silo in the cluster hosts it")
        return info

    async def with_method(self, name: str, method: str) -> TypeInfo:
        """The type's info once some version of it has ``method`` (see the module docstring)."""
        info = self._types.get(name)
        if info is None:
            info = await self.get(name)  # a type not seen yet: read now (UnknownGrainError if none)
        if method not in info.methods:
            await self._read_for((name, method))
            info = self._types[name]
        if method not in info.methods:
            raise errors.UnknownMethodError(name, method, sorted(info.versions))
        return info

    async def with_version(self, name: str, version: int) -> TypeInfo | None:
        """The type's info once it knows ``version`` (re-read at most once a period), else None."""
        info = self._types.get(name)
        if info is None or version not in info.versions:
            await self._read_for((name, f"@{version}"))
            info = self._types.get(name)
        return info if info is not None and version in info.versions else None

    async def _read_for(self, miss: tuple[str, str]) -> None:
        """Re-read for one miss: a read of its own (one begun before the miss may predate what it
        looks for), shared by whoever misses the same meanwhile; none if one ran this period."""
        pending = self._pending.get(miss)
        if pending is None:
            now = self._clock()
            last = self._missed.get(miss)
            if last is not None and now - last < self._period_s:
                return
            if len(self._missed) >= MAX_REMEMBERED_MISSES:
                self._missed.clear()
            self._missed[miss] = now
            pending = self._pending[miss] = asyncio.get_running_loop().create_task(self._read())

            def done(task: asyncio.Task[None]) -> None:
                self._pending.pop(miss, None)
                if not task.cancelled():
                    task.exception()  # retrieved: every awaiter may have been cancelled

            pending.add_done_callback(done)
        await asyncio.shield(pending)

    async def refresh(self) -> None:
        """Re-read every manifest now; concurrent callers share one read."""
        task = self._reading
        if task is None or task.done():
            task = self._reading = asyncio.get_running_loop().create_task(self._read())
            # Retrieved here too: every awaiter may have been cancelled before it ends.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(task)

    async def _read(self) -> None:
        published = await self._fetch()
        self.refreshes += 1
        # Merged, not replaced: manifests are never deleted, and of two reads that overlap the
        # older may finish last.
        for name, versions in published.items():
            self._published.setdefault(name, {}).update(versions)
        for name in {*published, *self._local}:
            self._combine(name)

    async def _fetch(self) -> dict[str, dict[int, TypeInfo]]:
        with redis_errors("grain type manifests"):
            raw = await self._redis.hgetall(self._keys.grain_manifests)
        return parse_manifests(raw)

    def _combine(self, name: str) -> None:
        infos = dict(self._published.get(name, {}))
        local = self._local.get(name)
        if local is not None:
            infos[local.version] = local  # our own version as this process knows it
        if infos:
            self._types[name] = combine(infos)

    def names(self) -> list[str]:
        return sorted(self._types)

    def statistics(self) -> ManifestsStatistics:
        return ManifestsStatistics(
            reads=self.refreshes, versions={n: sorted(i.versions) for n, i in sorted(self._types.items())}
        )
