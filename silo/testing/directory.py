"""The grain directory in a dict: the Redis directory's rules, for unit tests.

Same contract as :class:`silo.cluster.directory.RedisGrainDirectory` (the
contract tests in ``tests/silo/cluster/test_directory_contract.py`` run the
same cases on both): register returns the winner and hands out increasing
fencing tokens, a registrant that is not live is refused, an entry whose silo
is not live is taken over, unregister is compare-and-delete, a per-silo index
lets survivors purge a dead silo's entries (in steps of at most
``purge_batch`` grains, never a live silo's), and lookups go through the same
bounded local cache (so a test sees what a silo sees after an invalidation).

``is_alive`` plays the membership table; by default every silo is live. Wire
it to a membership twin with ``InMemoryGrainDirectory(table.is_alive)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.cluster.directory import (
    PURGE_BATCH,
    DirectoryEntry,
    DirectoryStatistics,
    GrainDirectory,
    PurgedBatch,
    _Cache,
    purge_in_steps,
)


def _always_alive(silo: SiloAddress) -> bool:
    return True


class InMemoryGrainDirectory:
    """A ``GrainDirectory`` in a dict (all silos of a test may share one)."""

    def __init__(
        self,
        is_alive: Callable[[SiloAddress], bool] = _always_alive,
        *,
        cache_size: int = 100_000,
        purge_batch: int = PURGE_BATCH,
    ) -> None:
        if purge_batch < 1:
            raise errors.ConfigError(f"purge_batch must be at least 1, not {purge_batch}")
        self._purge_count = purge_batch
        self._entries: dict[GrainId, DirectoryEntry] = {}
        self._index: dict[SiloAddress, set[GrainId]] = {}
        self._is_alive = is_alive
        self._token = 0
        self._cache = _Cache(cache_size)
        self._registrations = self._conflicts = self._unregistrations = self._purged = 0

    async def register(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> DirectoryEntry:
        entry = self._register(grain, silo, activation_id)
        # Counted as the Redis directory counts: by whether the winner is the registrant.
        if entry.activation_id == activation_id:
            self._registrations += 1
        else:
            self._conflicts += 1
        self._cache.put(grain, entry)
        return entry

    def _register(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> DirectoryEntry:
        cur = self._entries.get(grain)
        if cur is not None and cur.silo == silo:
            return cur
        if not self._is_alive(silo):
            raise errors.MembershipError(
                f"silo {silo} is not live in the membership table: it may not register {grain}"
            )
        if cur is not None:
            if self._is_alive(cur.silo):
                return cur
            self._index.get(cur.silo, set()).discard(grain)
        self._token += 1
        entry = DirectoryEntry(silo, activation_id, self._token)
        self._entries[grain] = entry
        self._index.setdefault(silo, set()).add(grain)
        return entry

    async def unregister(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> bool:
        self._cache.drop(grain)
        cur = self._entries.get(grain)
        if cur is None or cur.activation_id != activation_id:
            return False
        del self._entries[grain]
        self._index.get(silo, set()).discard(grain)
        self._unregistrations += 1
        return True

    async def lookup(self, grain: GrainId) -> DirectoryEntry | None:
        entry = self._entries.get(grain)
        if entry is not None:
            self._cache.put(grain, entry)
        else:
            self._cache.drop(grain)
        return entry

    async def purge_batch(self, silo: SiloAddress) -> PurgedBatch:
        if self._is_alive(silo):
            raise errors.MembershipError(f"silo {silo} is live: its directory entries are not purged")
        index = self._index.get(silo, set())
        removed = []
        for _ in range(min(self._purge_count, len(index))):
            grain = index.pop()
            cur = self._entries.get(grain)
            if cur is not None and cur.silo == silo:
                del self._entries[grain]
                removed.append(grain)
        if not index:
            self._index.pop(silo, None)
        self._purged += len(removed)
        return PurgedBatch(tuple(removed), len(index))

    async def purge_silo(self, silo: SiloAddress) -> int:
        self._cache.drop_silo(silo)
        return await purge_in_steps(self, silo)

    async def entries_of(self, silo: SiloAddress) -> list[GrainId]:
        return list(self._index.get(silo, ()))

    def cached(self, grain: GrainId) -> DirectoryEntry | None:
        return self._cache.get(grain)

    def invalidate(self, grain: GrainId) -> None:
        self._cache.drop(grain)

    def invalidate_silo(self, silo: SiloAddress) -> None:
        self._cache.drop_silo(silo)

    # --- for tests -------------------------------------------------------------
    def token_of(self, grain: GrainId) -> int:
        """The fencing token of the grain's current entry, 0 if it has none.

        ``InMemoryStateStore(owner=directory.token_of)`` fences writes as the
        Redis store does against the directory entry.
        """
        entry = self._entries.get(grain)
        return 0 if entry is None else entry.token

    def entries(self) -> dict[GrainId, DirectoryEntry]:
        """Every entry, as the directory holds it now (not through the cache)."""
        return dict(self._entries)

    def statistics(self) -> DirectoryStatistics:
        return DirectoryStatistics(
            registrations=self._registrations,
            conflicts=self._conflicts,
            unregistrations=self._unregistrations,
            purged=self._purged,
            cache_size=len(self._cache),
            cache_hits=self._cache.hits,
            cache_misses=self._cache.misses,
        )


if TYPE_CHECKING:
    _twin: GrainDirectory = InMemoryGrainDirectory()  # mypy holds the twin to the protocol
