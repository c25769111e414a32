"""Grain state in Redis: etag + fencing checked in one Lua script, chunked bulk.

Layout per grain (keys from ``silo/keys.py``)::

    rg:{cluster:g:<grain>}:state              hash: etag, nchunks, size, [d: inline stream]
    rg:{cluster:g:<grain>}:state:v{etag}:{i}  chunk i of the version whose etag is {etag}

All in the grain's own hash slot, with its directory entry: the commit script
below touches only those keys and declares every one (Redis Cluster).

A value is stored as one *stream* (``<u32 meta_len> <u32 nbuf> <u64 len>*nbuf
meta buffers...``, the codec's ``Encoded`` laid end to end). A stream up to
``inline_bytes`` goes inline in the head with one script call. A bigger one is
streamed into chunk keys (``chunk_bytes`` each) named by the *new* etag, each with a TTL, while the
old version stays visible; one commit script then checks the etag and the
writer's fencing token against the directory entry, checks every chunk is
there, makes them permanent, points the head at them and deletes the old
version's chunks. So a reader sees the old version or the new one, never a
mix, and a writer that dies mid-stream leaves only orphan chunks that expire.

The same head+chunks machinery (:class:`Blobs`, :data:`LUA_BLOBS`) stores
checkpoint snapshots (``silo/storage/checkpoint.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
import redis.exceptions
from redis.commands.core import AsyncScript

from grains.ids import GrainId
from silo import errors
from silo.codec import Encoded
from silo.keys import Keys, chunk_key
from silo.redis_util import (
    CLOSED_UNDER_US,
    PoolExhaustedError,
    closed_under_us,
    is_cluster,
    run_replicated,
)
from silo.settings import StorageSettings

log = logging.getLogger("redgrain.storage")

_HEAD = struct.Struct("<II")
_LEN = struct.Struct("<Q")
_READ_BATCH = 4  # chunks per MGET: bounds memory beyond the result to a few chunks
_INDEXED_LIMIT = 100_000  # (index, grain) pairs a store remembers having listed


@dataclass(frozen=True, slots=True)
class StoredState:
    """A decoded-ready stored value: memoryviews into one buffer, plus its etag."""

    meta: memoryview
    buffers: list[memoryview]
    etag: str


DEFAULT_STATE = ""
"""The state name of ``self.state``; ``Grain.named_state`` names the others."""


class StateStore(Protocol):
    """The storage-provider interface: where grains' states live (``silo/storage/provider.py``).

    One value per (grain, state name): ``state`` is ``DEFAULT_STATE`` for ``self.state``,
    else the name given to ``Grain.named_state``. The rules, which the contract tests in
    ``tests/silo/storage/test_store_contract.py`` hold every provider to:

    - ``read`` gives the stored stream sliced by :func:`parse_stream` with its etag, or None.
    - ``write`` names the etag it expects (None: nothing stored yet, ``"*"``: anything) and
      the writer's fencing token; the etag is checked first, then the token against the
      grain's directory entry (0: the writer is outside the directory, a stateless worker,
      allowed only while no entry names an owner, or with etag ``"*"``: an admin overwrite).
      A refusal raises ``StateConflictError`` saying which check failed and changes nothing.
      It returns the new etag, never one used before for that value.
    - ``clear`` is checked like a write; afterwards ``read`` gives None.
    - Any other failure raises ``StorageError`` (the activation then reloads).
    - ``write_stream`` writes an already encoded stream (checkpoint restores) and
      ``statistics()`` counts reads, writes, conflicts, errors and bytes.
    """

    async def read(self, grain: GrainId, *, state: str = DEFAULT_STATE) -> StoredState | None: ...

    async def write(
        self, grain: GrainId, value: Encoded, etag: str | None, token: int, *, state: str = DEFAULT_STATE
    ) -> str: ...

    async def write_stream(
        self, grain: GrainId, parts: list[memoryview], etag: str | None, token: int, *, state: str = DEFAULT_STATE
    ) -> str: ...

    async def clear(self, grain: GrainId, etag: str | None, token: int, *, state: str = DEFAULT_STATE) -> None: ...

    def statistics(self) -> StorageStatistics: ...


class EncodedWrites:
    """``write`` as ``write_stream`` of the value's encoded stream: what every provider stores,
    so a provider writes only ``write_stream``."""

    async def write(
        self, grain: GrainId, value: Encoded, etag: str | None, token: int, *, state: str = DEFAULT_STATE
    ) -> str:
        return await self.write_stream(grain, stream_parts(value), etag, token, state=state)

    async def write_stream(
        self, grain: GrainId, parts: list[memoryview], etag: str | None, token: int, *, state: str = DEFAULT_STATE
    ) -> str:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class StorageStatistics:
    reads: int
    """State reads served."""
    writes: int
    """State writes committed."""
    conflicts: int
    """Writes refused by the etag or fencing check."""
    errors: int
    """Operations that failed after their retries (Redis down or erroring)."""
    bytes_written: int
    """Stream bytes of committed writes."""
    bytes_read: int
    """Stream bytes of reads."""
    chunks_written: int
    """Chunk keys written for big states (committed or not)."""


# --- the stream ---------------------------------------------------------------


def stream_parts(value: Encoded) -> list[memoryview]:
    """The stream of ``value`` as byte views: a small header, the meta, then each buffer as is."""
    head = bytearray(_HEAD.pack(len(value.meta), len(value.buffers)))
    for b in value.buffers:
        head += _LEN.pack(b.nbytes)
    return [memoryview(bytes(head)), memoryview(value.meta), *(b.cast("B") for b in value.buffers)]


def split_chunks(parts: list[memoryview], size: int) -> Iterator[list[memoryview]]:
    """Split the stream into pieces of at most ``size`` bytes, as views (no copy)."""
    piece: list[memoryview] = []
    room = size
    for part in parts:
        pos = 0
        while pos < part.nbytes:
            take = min(room, part.nbytes - pos)
            piece.append(part[pos : pos + take])
            pos += take
            room -= take
            if room == 0:
                yield piece
                piece, room = [], size
    if piece:
        yield piece


def parse_stream(stream: memoryview, etag: str) -> StoredState:
    """Slice a stream back into meta and buffers; the slices share ``stream``'s memory."""
    if stream.nbytes < _HEAD.size:
        raise errors.StorageError("stored state is truncated")
    meta_len, nbuf = _HEAD.unpack_from(stream, 0)
    pos = _HEAD.size
    if pos + nbuf * _LEN.size > stream.nbytes:
        raise errors.StorageError("stored state header is truncated")
    lens = []
    for _ in range(nbuf):
        lens.append(_LEN.unpack_from(stream, pos)[0])
        pos += _LEN.size
    if pos + meta_len + sum(lens) != stream.nbytes:
        raise errors.StorageError(
            f"stored state holds {stream.nbytes} bytes but its header describes {pos + meta_len + sum(lens)}"
        )
    meta = stream[pos : pos + meta_len]
    pos += meta_len
    bufs = []
    for n in lens:
        bufs.append(stream[pos : pos + n])
        pos += n
    return StoredState(meta, bufs, etag)


# --- Lua shared by state and checkpoint scripts -------------------------------

# Every key a script touches comes in KEYS (Redis Cluster routes a script by its keys, and a
# name built in Lua could sit in another slot). A head+chunks script gets, after its fixed keys,
# the new version's n chunk keys and then the m chunk keys of the version the head names now;
# the caller learns that version from the head (or remembers it) and the script refuses with
# {0, 'old', etag, nchunks} when the head names another, so the caller declares those instead.
LUA_BLOBS = """
-- unlink(first, m): delete the m declared chunk keys from KEYS[first] on
local function unlink(first, m)
  for i = first, first + m - 1 do redis.call('UNLINK', KEYS[i]) end
end
-- declared(head, old, m): does the head still name the version whose m chunks were declared?
local function declared(cur, old, m)
  return (cur[1] or '') == old and (tonumber(cur[2] or '0') or 0) == m
end
-- local_keys(): touch every declared key once before the first write. While a slot migrates,
-- Redis refuses a script's command on a key absent from this node ("non local key") and does
-- not roll back what the script already wrote; a refusal here comes before any write.
-- (Redis checks the declared keys before it runs a script too; this holds if it ever does not.)
local function local_keys()
  for i = 1, #KEYS do redis.call('EXISTS', KEYS[i]) end
end
-- swap(head, first, n, ver, size, data, m): make version ver visible in head. With n == 0 the
-- stream is data, stored inline; otherwise its n staged chunks (KEYS[first..]) must all exist:
-- they are made permanent. The m chunks of the version the head named before (the KEYS after
-- the new ones) are deleted. False if a chunk is missing.
-- The head is written in place, never deleted and recreated: during a slot migration a key
-- this script deleted counts as moved away, its recreation is refused, and the head (every
-- acknowledged write) would be gone on both nodes.
local function swap(head, first, n, ver, size, data, m)
  for i = first, first + n - 1 do
    if redis.call('EXISTS', KEYS[i]) == 0 then return false end
  end
  for i = first, first + n - 1 do redis.call('PERSIST', KEYS[i]) end
  if n == 0 then
    redis.call('HSET', head, 'etag', ver, 'nchunks', 0, 'size', size, 'd', data)
  else
    redis.call('HSET', head, 'etag', ver, 'nchunks', n, 'size', size)
    redis.call('HDEL', head, 'd')
  end
  unlink(first + n, m)
  return true
end
-- fenced(entry, token): may this caller save a snapshot member of the grain? The directory's
-- activation, by its token; token '0' (a stateless worker, a client) only while no entry names
-- an owner, so it never writes over the snapshot the owning activation is taking.
local function fenced(entry, token)
  if token == '0' then return redis.call('EXISTS', entry) == 0 end
  return redis.call('HGET', entry, 'token') == token
end
"""

# owned(entry, token, expected): may this writer change the grain's state? The directory's
# activation, by its token. Token '0' is an activation outside the directory (a stateless
# worker, kept apart from its siblings by the etag): only while no entry names an owner, so it
# never overwrites the state of the activation the directory names. '0' with etag '*' is an
# admin overwrite (restore_group), unfenced on purpose: the live activation's next write is
# refused by the etag, and it reloads.
_OWNED = """
local function owned(entry, token, expected)
  if token == '0' then return expected == '*' or redis.call('EXISTS', entry) == 0 end
  return redis.call('HGET', entry, 'token') == token
end
"""

# KEYS: head, directory entry, the n new chunks, the m chunks of the version the head names
# ARGV: expected etag ('' none, '*' any), new etag, token, n, size, inline data, declared old etag, m
_WRITE = (
    LUA_BLOBS
    + _OWNED
    + """
local_keys()
local cur = redis.call('HMGET', KEYS[1], 'etag', 'nchunks')
if cur[1] == ARGV[2] then return {1, 'again'} end  -- our own earlier try committed; its reply was lost
if ARGV[1] ~= '*' and (cur[1] or '') ~= ARGV[1] then return {0, 'etag'} end
if not owned(KEYS[2], ARGV[3], ARGV[1]) then return {0, 'fence'} end
local m = tonumber(ARGV[8])
if not declared(cur, ARGV[7], m) then return {0, 'old', cur[1] or '', cur[2] or '0'} end
if not swap(KEYS[1], 3, tonumber(ARGV[4]), ARGV[2], ARGV[5], ARGV[6], m) then return {0, 'missing'} end
return {1, 'ok'}
"""
)

# KEYS: head, directory entry, the m chunks of the version the head names.
# ARGV: expected etag ('*' any), token, declared old etag, m
_CLEAR = (
    LUA_BLOBS
    + _OWNED
    + """
local_keys()
local cur = redis.call('HMGET', KEYS[1], 'etag', 'nchunks')
if ARGV[1] ~= '*' and (cur[1] or '') ~= ARGV[1] then return {0, 'etag'} end
if not owned(KEYS[2], ARGV[2], ARGV[1]) then return {0, 'fence'} end
local m = tonumber(ARGV[4])
if not declared(cur, ARGV[3], m) then return {0, 'old', cur[1] or '', cur[2] or '0'} end
unlink(3, m)
redis.call('DEL', KEYS[1])
return {1, 'ok'}
"""
)

_DECLARE_TRIES = 5
"""Commit tries at most when the head keeps naming a version other than the declared one."""

_CONFLICTS = {
    "etag": "the stored state changed since this activation read it (etag mismatch)",
    "fence": "another activation owns the grain now (fencing token mismatch)",
}


@dataclass(frozen=True, slots=True)
class Staged:
    """A stream ready for a commit script: inline (``nchunks == 0``) or in staged chunks."""

    version: str
    nchunks: int
    size: int
    inline: bytes


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class _Versions:
    """Chunk counts of versions (etags) this process read or wrote, so a commit declares the
    old version's chunk keys right the first time (a wrong guess costs one more try)."""

    LIMIT = 100_000

    def __init__(self) -> None:
        self._n: OrderedDict[str, int] = OrderedDict()

    def get(self, etag: str) -> int:
        return self._n.get(etag, 0)

    def put(self, etag: str, n: int) -> None:
        if n <= 0:
            self._n.pop(etag, None)
            return
        self._n[etag] = n
        self._n.move_to_end(etag)
        if len(self._n) > self.LIMIT:
            self._n.popitem(last=False)


class Blobs:
    """Head+chunks values in Redis: bounded retries, chunk streaming, consistent reads.

    Shared by the state store and checkpoints so both stream big tensors the same way.
    """

    def __init__(self, redis: aioredis.Redis, settings: StorageSettings) -> None:
        self.redis = redis
        self.settings = settings
        self.errors = 0
        self.chunks_written = 0
        self.versions = _Versions()

    async def commit(
        self,
        what: str,
        script: AsyncScript,
        fixed_keys: list[str],
        base: str,
        staged: Staged | None,
        args: Callable[[str, int], list[Any]],
        guess: str | None,
    ) -> Any:
        """Run a head+chunks script with every chunk key declared (see :data:`LUA_BLOBS`).

        ``args(old_etag, m)`` builds ARGV for a declared old version; ``guess`` is the etag
        the head is expected to name (None or '*': unknown). Returns the script's reply.
        """
        old = guess if guess and guess != "*" else ""
        m = self.versions.get(old) if old else 0
        new = [chunk_key(base, staged.version, i) for i in range(staged.nchunks)] if staged else []
        for _ in range(_DECLARE_TRIES):
            keys = [*fixed_keys, *new, *(chunk_key(base, old, i) for i in range(m))]
            argv = args(old, m)
            res = await self.retry(what, functools.partial(run_replicated, self.redis, script, keys, argv))
            if int(res[0]) == 0 and _text(res[1]) == "old":
                old, m = _text(res[2]), int(res[3])
                continue
            if int(res[0]) == 1 and staged is not None:
                self.versions.put(old, 0)
                self.versions.put(staged.version, staged.nchunks)
            return res
        raise errors.StorageError(f"{what}: the stored value kept changing under the commit")

    async def retry(self, what: str, op: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``op``; retry connection errors with doubling backoff, then raise StorageError."""
        delay = self.settings.retry_backoff_s
        for attempt in range(self.settings.retries + 1):
            try:
                return await op()
            except (PoolExhaustedError, redis.exceptions.MaxConnectionsError) as exc:
                # Redis is up; this process has more calls in flight than connections and the
                # caller waited the pool's timeout already: no retry on top of that wait.
                self.errors += 1
                raise errors.StorageError(f"{what}: Redis connection pool exhausted ({exc})") from exc
            except (
                redis.exceptions.ConnectionError,
                redis.exceptions.TimeoutError,
                OSError,
                *CLOSED_UNDER_US,
            ) as exc:
                if isinstance(exc, CLOSED_UNDER_US) and not closed_under_us(exc):
                    raise
                if attempt == self.settings.retries:
                    self.errors += 1
                    raise errors.StorageError(
                        f"{what}: Redis unreachable after {attempt + 1} tries ({exc})"
                    ) from exc
                await asyncio.sleep(delay)
                delay *= 2
            except redis.exceptions.RedisError as exc:
                self.errors += 1
                raise errors.StorageError(f"{what}: Redis error ({exc})") from exc
        raise AssertionError("unreachable")

    async def stage(self, what: str, base: str, parts: list[memoryview]) -> Staged:
        """Prepare a stream for commit: small ones inline, big ones as expiring chunks.

        Each chunk goes out as the views it is made of (SET, then SETRANGE for a chunk that
        spans parts), so the whole stream is never joined; redis-py copies at most one
        chunk at a time into its socket buffer.
        """
        version = uuid.uuid4().hex
        size = sum(p.nbytes for p in parts)
        if size <= self.settings.inline_bytes:
            # Small: one round trip. Big values are slow as script arguments, so they go to chunks.
            return Staged(version, 0, size, b"".join(parts))
        ttl = self.settings.orphan_ttl_s
        n = 0
        for n, piece in enumerate(split_chunks(parts, self.settings.chunk_bytes), start=1):
            key = chunk_key(base, version, n - 1)
            if len(piece) == 1:
                await self.retry(what, functools.partial(self.redis.set, key, piece[0], ex=ttl))
            else:
                await self.retry(what, functools.partial(self._set_pieces, key, piece, ttl))
            self.chunks_written += 1
        return Staged(version, n, size, b"")

    async def _set_pieces(self, key: str, piece: list[memoryview], ttl: int) -> None:
        # SET, then each further part at its offset: every command may run twice (a reply lost
        # and the command sent again, by redis-py's own retry or by ours) and the chunk still
        # comes out right; APPEND, used before, added a part twice (seen while a slot migrated).
        # A retry starts again at SET, so a half-sent pipeline leaves nothing behind.
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(key, piece[0], ex=ttl)
        offset = piece[0].nbytes
        for p in piece[1:]:
            pipe.setrange(key, offset, p)
            offset += p.nbytes
        await pipe.execute()

    async def _chunks(self, names: list[str]) -> list[Any]:
        if not is_cluster(self.redis):
            return list(await self.redis.mget(names))
        # On a Cluster, GETs in a pipeline rather than one MGET: while the slot migrates, its
        # chunks may lie on two masters, where a multi-key command gets TRYAGAIN until the move
        # ends, but each GET follows its own ASK redirection (the read failed for the whole move).
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.get(name)
            return list(await pipe.execute())

    async def discard(self, base: str, staged: Staged) -> None:
        """Best effort: delete the chunks of a stream whose commit was refused (else they expire)."""
        if staged.nchunks <= 0:
            return
        try:
            await self.redis.unlink(
                *(chunk_key(base, staged.version, i) for i in range(staged.nchunks))
            )
        except (redis.exceptions.RedisError, OSError, *CLOSED_UNDER_US) as exc:
            if isinstance(exc, CLOSED_UNDER_US) and not closed_under_us(exc):
                raise
            log.warning("could not delete uncommitted chunks under %s (they expire): %s", base, exc)

    async def load(self, what: str, head_key: str, base: str) -> tuple[memoryview, str] | None:
        """The visible stream under ``head_key`` and its etag, or None if there is none.

        Big streams are assembled into one bytearray, so the views the codec gets are
        writable and tensors decode without a copy.
        """
        for _ in range(5):
            head = await self.retry(what, lambda: self.redis.hgetall(head_key))
            if not head:
                return None
            etag = head[b"etag"].decode()
            n, size = int(head.get(b"nchunks", 0)), int(head.get(b"size", 0))
            self.versions.put(etag, n)
            if n == 0:
                return memoryview(bytearray(head.get(b"d", b""))), etag
            stream = bytearray(size)
            pos = 0
            complete = True
            for start in range(0, n, _READ_BATCH):
                names = [
                    chunk_key(base, etag, i) for i in range(start, min(n, start + _READ_BATCH))
                ]
                got = await self.retry(what, functools.partial(self._chunks, names))
                for part in got:
                    if part is None or pos + len(part) > size:
                        complete = False
                        break
                    stream[pos : pos + len(part)] = part
                    pos += len(part)
                del got
                if not complete:
                    break
            if complete and pos == size:
                return memoryview(stream), etag
            # A newer version replaced this one while we read it: read the head again.
        raise errors.StorageError(f"{what}: the value kept changing while being read")


class RedisStateStore(EncodedWrites):
    """Grain state in Redis, fenced by the directory's token."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: StorageSettings) -> None:
        self._redis = redis
        self._keys = keys
        self._settings = settings
        self.blobs = Blobs(redis, settings)
        self._indexed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._write = redis.register_script(_WRITE)
        self._clear = redis.register_script(_CLEAR)
        self._reads = self._writes = self._conflicts = 0
        self._bytes_written = self._bytes_read = 0

    def _layout(self, grain: GrainId, state: str) -> tuple[str, str, str, str, str]:
        """(what, head, chunk base, index, types) of one state of a grain."""
        g, k = str(grain), self._keys
        if state == DEFAULT_STATE:
            return g, k.state_head(g), k.state_chunk_base(g), k.state_index(grain.type_name), k.state_types()
        return (f"{g} (state {state!r})", k.named_state_head(g, state), k.named_state_chunk_base(g, state),
                k.named_state_index(grain.type_name, state), k.named_state_types(state))  # fmt: skip

    async def read(self, grain: GrainId, *, state: str = DEFAULT_STATE) -> StoredState | None:
        g, head, base, _, _ = self._layout(grain, state)
        found = await self.blobs.load(f"read state of {g}", head, base)
        if found is None:
            return None
        stream, etag = found
        self._reads += 1
        self._bytes_read += stream.nbytes
        return parse_stream(stream, etag)

    async def write_stream(
        self, grain: GrainId, parts: list[memoryview], etag: str | None, token: int, *, state: str = DEFAULT_STATE
    ) -> str:
        """Commit a stream as the grain's state; ``etag="*"`` with token 0 overwrites whatever is there."""
        g, head, base, index, types = self._layout(grain, state)
        what = f"write state of {g}"
        staged = await self.blobs.stage(what, base, parts)
        expected, tok = etag or "", str(token)

        def argv(old: str, m: int) -> list[Any]:
            return [expected, staged.version, tok, staged.nchunks, staged.size, staged.inline, old, m]

        # A StorageError leaves the staged chunks alone: the commit's fate is unknown (a lost
        # reply, a connection closed under us), and if it landed the head names them now.
        # Uncommitted ones expire (orphan_ttl_s).
        res = await self.blobs.commit(
            what, self._write, [head, self._keys.directory_entry(str(grain))], base, staged, argv, etag
        )
        if int(res[0]) != 1:
            await self.blobs.discard(base, staged)
            why = _text(res[1])
            if why == "missing":
                raise errors.StorageError(
                    f"{what}: staged chunks expired before the commit (orphan_ttl_s too short?)"
                )
            self._conflicts += 1
            raise errors.StateConflictError(g, _CONFLICTS.get(why, why))
        self._writes += 1
        self._bytes_written += staged.size
        await self._index(grain, index, types)
        return staged.version

    async def _index(self, grain: GrainId, index: str, types: str) -> None:
        """List the grain in its type's state index (the dashboard's), once per process.

        Outside the commit script: the index sets live in the control slot, the state in the
        grain's. Written after the commit, so the index may lag a state whose writer died right
        after committing (until that grain's next write); it never lists a state that was not
        written, except one cleared since (readers find no head). Best effort.
        """
        mark = (index, grain.key)
        if mark in self._indexed:
            self._indexed.move_to_end(mark)
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.sadd(index, grain.key)
                pipe.sadd(types, grain.type_name)
                await pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            log.debug("state index of %s not updated: %s", grain, exc)
            return
        self._indexed[mark] = None
        if len(self._indexed) > _INDEXED_LIMIT:
            self._indexed.popitem(last=False)

    async def clear(self, grain: GrainId, etag: str | None, token: int, *, state: str = DEFAULT_STATE) -> None:
        g, head, base, index, _ = self._layout(grain, state)
        what = f"clear state of {g}"
        expected, tok = etag or "", str(token)

        def argv(old: str, m: int) -> list[Any]:
            return [expected, tok, old, m]

        res = await self.blobs.commit(
            what, self._clear, [head, self._keys.directory_entry(str(grain))], base, None, argv, etag
        )
        if int(res[0]) != 1:
            self._conflicts += 1
            why = _text(res[1])
            raise errors.StateConflictError(g, _CONFLICTS.get(why, why))
        self._indexed.pop((index, grain.key), None)
        try:
            await self._redis.srem(index, grain.key)
        except (redis.exceptions.RedisError, OSError) as exc:
            log.debug("state index of %s keeps it: %s", grain, exc)

    def statistics(self) -> StorageStatistics:
        return StorageStatistics(
            reads=self._reads,
            writes=self._writes,
            conflicts=self._conflicts,
            errors=self.blobs.errors,
            bytes_written=self._bytes_written,
            bytes_read=self._bytes_read,
            chunks_written=self.blobs.chunks_written,
        )
