"""Grain state in a dict: the Redis state store's contract, for unit tests.

Same rules as :class:`silo.storage.store.RedisStateStore` (the contract tests
in ``tests/silo/storage/test_store_contract.py`` run the same cases on both):
a write names the etag it expects (``None``: no state yet, ``"*"``: any) and
the writer's fencing token (0: unfenced), the etag is checked first, then
the token against the grain's directory entry, and a refused write or clear
raises StateConflictError saying which. A value is kept as the same stream
the Redis store writes and read back through the same parser, so what a
grain reads is byte for byte what Redis would give it. Big values need no
chunks here; there is one bytes object per grain.

``owner`` plays the directory: the fencing token of the grain's entry (0
when it has none), a plain or an async function. Wire it to a directory twin with
``InMemoryStateStore(owner=directory.token_of)``; without one, tokens are not
checked. :func:`memory_provider` builds one as a storage provider a silo names
in its settings (fenced by the silo's directory), for tests of provider choice.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from grains.ids import GrainId
from silo import errors
from silo.storage.store import (
    _CONFLICTS,
    DEFAULT_STATE,
    EncodedWrites,
    StateStore,
    StorageStatistics,
    StoredState,
    parse_stream,
)

if TYPE_CHECKING:
    from silo.storage.provider import ProviderContext


class InMemoryStateStore(EncodedWrites):
    """A ``StateStore`` in a dict (all silos of a test may share one)."""

    def __init__(self, owner: Callable[[GrainId], int | Awaitable[int]] | None = None) -> None:
        self._data: dict[tuple[GrainId, str], tuple[bytes, str]] = {}
        self._owner = owner
        self._reads = self._writes = self._conflicts = 0
        self._bytes_written = self._bytes_read = 0

    async def read(self, grain: GrainId, *, state: str = DEFAULT_STATE) -> StoredState | None:
        found = self._data.get((grain, state))
        if found is None:
            return None
        data, etag = found
        self._reads += 1
        self._bytes_read += len(data)
        # A private, writable copy, as the Redis store assembles one: tensors decode in place.
        return parse_stream(memoryview(bytearray(data)), etag)

    async def write_stream(
        self, grain: GrainId, parts: list[memoryview], etag: str | None, token: int, *, state: str = DEFAULT_STATE
    ) -> str:
        """Commit a stream as the grain's state; ``etag="*"`` with token 0 overwrites whatever is there."""
        await self._check(grain, state, etag, token)
        new = uuid.uuid4().hex
        data = b"".join(parts)
        self._data[(grain, state)] = (data, new)
        self._writes += 1
        self._bytes_written += len(data)
        return new

    async def clear(self, grain: GrainId, etag: str | None, token: int, *, state: str = DEFAULT_STATE) -> None:
        await self._check(grain, state, etag, token)
        self._data.pop((grain, state), None)

    async def _check(self, grain: GrainId, state: str, etag: str | None, token: int) -> None:
        cur = self._data.get((grain, state))
        if etag != "*" and (cur[1] if cur else "") != (etag or ""):
            self._refuse(grain, state, "etag")
        if self._owner is not None:
            owner = self._owner(grain)
            if inspect.isawaitable(owner):
                owner = await owner
            # Token 0 (a stateless worker) only while no activation owns the grain; with
            # etag "*" it is an admin overwrite (as RedisStateStore's owned() in Lua).
            if (token and owner != token) or (not token and etag != "*" and owner):
                self._refuse(grain, state, "fence")

    def _refuse(self, grain: GrainId, state: str, why: str) -> None:
        self._conflicts += 1
        where = str(grain) if state == DEFAULT_STATE else f"{grain} (state {state!r})"
        raise errors.StateConflictError(where, _CONFLICTS[why])

    # --- for tests -------------------------------------------------------------
    def etag_of(self, grain: GrainId, state: str = DEFAULT_STATE) -> str | None:
        """The etag of the grain's stored state (``state``: a named one), None if it has none."""
        found = self._data.get((grain, state))
        return None if found is None else found[1]

    def grains(self, state: str = DEFAULT_STATE) -> list[GrainId]:
        """Grains that have stored state (``state``: a named one)."""
        return [g for g, s in self._data if s == state]

    def statistics(self) -> StorageStatistics:
        return StorageStatistics(
            reads=self._reads,
            writes=self._writes,
            conflicts=self._conflicts,
            errors=0,
            bytes_written=self._bytes_written,
            bytes_read=self._bytes_read,
            chunks_written=0,
        )


def memory_provider(context: ProviderContext) -> InMemoryStateStore:
    """A storage provider (``storage.providers`` in the settings) keeping states in this
    process's memory, fenced by the silo's directory: for tests; lost when the silo stops."""
    return InMemoryStateStore(owner=context.owner)


if TYPE_CHECKING:
    _twin: StateStore = InMemoryStateStore()  # mypy holds the twin to the protocol
