"""Grain state in a SQLite file: a storage provider outside Redis.

Register it by name in the settings and pick it with ``@storage``::

    REDGRAIN_STORAGE__PROVIDERS='{"files": {"factory": "silo.storage.sqlite:provider",
                                             "options": {"path": "/var/lib/app/states.db"}}}'

It keeps the :class:`~silo.storage.store.StateStore` contract (the contract
tests run on it as on Redis): one row per (grain, state name) holding the
value's stream, its etag and the fencing token of its last writer. Every
operation runs on one thread of its own (a big state never holds the event
loop) inside ``BEGIN IMMEDIATE``, so the etag check and the write are one
step for every process that opens the file (silos on one host may share it).

Fencing: the grain's directory token is read from the directory (Redis) just
before the transaction, and the row also refuses a token below the one that
last wrote it (tokens only grow). What the directory check cannot close is
the moment between that read and the commit; ``silo/storage/provider.py``
says why a write landing there is never lost silently.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

_SCHEMA = """
CREATE TABLE IF NOT EXISTS grain_state (
    grain TEXT NOT NULL,
    state TEXT NOT NULL,
    etag TEXT NOT NULL,
    token INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (grain, state)
)
"""
_BUSY_TIMEOUT_S = 30.0
"""How long a transaction waits for another process's lock on the file before StorageError."""


class SqliteStateStore(EncodedWrites):
    """Grain states in one SQLite file, fenced by ``owner`` (the directory's token of a grain)."""

    def __init__(self, path: str | Path, owner: Callable[[GrainId], Awaitable[int]] | None = None) -> None:
        self.path = Path(path)
        self._owner = owner
        # One thread owns the connection: SQLite calls block, and never on the loop.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="redgrain-sqlite")
        self._db: sqlite3.Connection | None = None
        self._reads = self._writes = self._conflicts = self._errors = 0
        self._bytes_written = self._bytes_read = 0

    # --- the thread's side ---------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(_SCHEMA)
            self._db = db
        return self._db

    def _read_row(self, grain: str, state: str) -> tuple[bytes, str] | None:
        row = self._conn().execute(
            "SELECT data, etag FROM grain_state WHERE grain = ? AND state = ?", (grain, state)
        ).fetchone()
        return None if row is None else (bytes(row[0]), str(row[1]))

    def _commit(self, grain: str, state: str, etag: str | None, token: int, owner: int | None,
                data: bytes | None) -> str:  # fmt: skip
        """Check and write (``data``) or delete (None) in one transaction; the new etag, or why not."""
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute(
                "SELECT etag, token FROM grain_state WHERE grain = ? AND state = ?", (grain, state)
            ).fetchone()
            cur, last = (row[0], int(row[1])) if row else ("", 0)
            if etag != "*" and cur != (etag or ""):
                db.execute("ROLLBACK")
                return "!etag"
            # As the Redis store's owned(): the directory's token, or 0 while no entry names an
            # owner (or with etag "*", an admin overwrite); and never a token older than the last.
            if owner is not None and ((token and owner != token) or (not token and etag != "*" and owner)):
                db.execute("ROLLBACK")
                return "!fence"
            if token and token < last:
                db.execute("ROLLBACK")
                return "!fence"
            new = uuid.uuid4().hex
            if data is None:
                db.execute("DELETE FROM grain_state WHERE grain = ? AND state = ?", (grain, state))
            else:
                db.execute(
                    "INSERT OR REPLACE INTO grain_state (grain, state, etag, token, data) VALUES (?, ?, ?, ?, ?)",
                    (grain, state, new, max(token, last), data),
                )
            db.execute("COMMIT")
            return new
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    # --- the loop's side -------------------------------------------------------------
    async def _run(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        except sqlite3.Error as exc:
            self._errors += 1
            raise errors.StorageError(f"{what}: SQLite {self.path}: {exc}") from exc

    async def read(self, grain: GrainId, *, state: str = DEFAULT_STATE) -> StoredState | None:
        found = await self._run(f"read state of {grain}", self._read_row, str(grain), state)
        if found is None:
            return None
        data, etag = found
        self._reads += 1
        self._bytes_read += len(data)
        return parse_stream(memoryview(bytearray(data)), etag)

    async def write_stream(
        self, grain: GrainId, parts: list[memoryview], etag: str | None, token: int, *, state: str = DEFAULT_STATE
    ) -> str:
        data = b"".join(parts)
        new = await self._change(grain, state, etag, token, data)
        self._writes += 1
        self._bytes_written += len(data)
        return new

    async def clear(self, grain: GrainId, etag: str | None, token: int, *, state: str = DEFAULT_STATE) -> None:
        await self._change(grain, state, etag, token, None)

    async def _change(self, grain: GrainId, state: str, etag: str | None, token: int, data: bytes | None) -> str:
        owner = None if self._owner is None else await self._owner(grain)
        where = str(grain) if state == DEFAULT_STATE else f"{grain} (state {state!r})"
        what = ("write" if data is not None else "clear") + f" state of {where}"
        result: str = await self._run(what, self._commit, str(grain), state, etag, token, owner, data)
        if result.startswith("!"):
            self._conflicts += 1
            raise errors.StateConflictError(where, _CONFLICTS[result[1:]])
        return result

    async def aclose(self) -> None:
        def close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await asyncio.get_running_loop().run_in_executor(self._thread, close)
        self._thread.shutdown(wait=False)

    def statistics(self) -> StorageStatistics:
        return StorageStatistics(
            reads=self._reads,
            writes=self._writes,
            conflicts=self._conflicts,
            errors=self._errors,
            bytes_written=self._bytes_written,
            bytes_read=self._bytes_read,
            chunks_written=0,
        )


def provider(context: ProviderContext, path: str) -> SqliteStateStore:
    """The storage-provider factory (``silo.storage.sqlite:provider``, option ``path``)."""
    return SqliteStateStore(path, owner=context.owner)


if TYPE_CHECKING:
    _provider: StateStore = SqliteStateStore(":memory:")  # mypy holds it to the protocol
