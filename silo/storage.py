"""Grain state in Redis: etag + fencing checked in one Lua script, chunked bulk.

Layout per grain (keys from ``silo/keys.py``)::

    state:{grain}            hash: etag, version, nchunks, size, [d: inline bytes]
    state:{grain}:v{N}:{i}   chunk i of version N (only for states over chunk_bytes)

A small state is written inline in the head with one script call. A large
one is streamed in chunks under a *new* version number, with a TTL, while the
old version stays visible; a commit script then checks the etag and the
writer's fencing token against the directory, flips the head to the new
version, persists its chunks and returns the old version, whose chunks are
deleted after. A crash mid-write leaves the old version intact and the
orphan chunks expire.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
import redis.exceptions

from grains.ids import GrainId
from silo import errors
from silo.codec import Encoded
from silo.keys import Keys
from silo.settings import StorageSettings

log = logging.getLogger("redgrain.storage")

T = TypeVar("T")

# Stream layout of an encoded value: <u32 meta_len> <u32 nbuf> <u64 len>*nbuf meta buffers...
_HEAD = struct.Struct("<II")
_LEN = struct.Struct("<Q")
_ORPHAN_TTL_S = 3600


@dataclass(frozen=True, slots=True)
class StoredState:
    meta: memoryview
    buffers: list[memoryview]
    etag: str


class StateStore(Protocol):
    async def read(self, grain: GrainId) -> StoredState | None: ...

    async def write(self, grain: GrainId, value: Encoded, etag: str | None, token: int) -> str: ...

    async def clear(self, grain: GrainId, etag: str | None, token: int) -> None: ...


@dataclass(frozen=True, slots=True)
class StorageStatistics:
    reads: int
    """State reads served."""
    writes: int
    """State writes committed."""
    conflicts: int
    """Writes refused by the etag or fencing check."""
    errors: int
    """Operations that failed after their retries."""
    bytes_written: int
    bytes_read: int


def _stream_parts(value: Encoded) -> list[memoryview]:
    head = bytearray(_HEAD.pack(len(value.meta), len(value.buffers)))
    for b in value.buffers:
        head += _LEN.pack(b.nbytes)
    return [memoryview(bytes(head)), memoryview(value.meta), *(b.cast("B") for b in value.buffers)]


def _chunks(parts: list[memoryview], size: int) -> Iterator[list[memoryview]]:
    """Split the stream into pieces of at most ``size`` bytes without copying."""
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


def _parse_stream(stream: memoryview, etag: str) -> StoredState:
    if stream.nbytes < _HEAD.size:
        raise errors.StorageError("stored state is truncated")
    meta_len, nbuf = _HEAD.unpack_from(stream, 0)
    pos = _HEAD.size
    lens = []
    for _ in range(nbuf):
        lens.append(_LEN.unpack_from(stream, pos)[0])
        pos += _LEN.size
    meta = stream[pos : pos + meta_len]
    pos += meta_len
    bufs = []
    for n in lens:
        bufs.append(stream[pos : pos + n])
        pos += n
    if pos != stream.nbytes:
        raise errors.StorageError(f"stored state has {stream.nbytes - pos} unexpected trailing bytes")
    return StoredState(meta, bufs, etag)


_WRITE_INLINE = """
local head = KEYS[1]
local cur = redis.call('HGET', head, 'etag') or ''
if cur ~= ARGV[1] then return {0, 'etag'} end
if ARGV[3] ~= '0' then
  local tok = redis.call('HGET', KEYS[2], 'token')
  if tok ~= ARGV[3] then return {0, 'fence'} end
end
local oldv = tonumber(redis.call('HGET', head, 'version') or '0')
local oldn = tonumber(redis.call('HGET', head, 'nchunks') or '0')
redis.call('HSET', head, 'etag', ARGV[2], 'version', oldv + 1, 'nchunks', 0, 'size', string.len(ARGV[4]), 'd', ARGV[4])
redis.call('SADD', KEYS[3], ARGV[5])
redis.call('SADD', KEYS[4], ARGV[6])
return {1, oldv, oldn}
"""

_COMMIT_CHUNKED = """
local head = KEYS[1]
local cur = redis.call('HGET', head, 'etag') or ''
if cur ~= ARGV[1] then return {0, 'etag'} end
if ARGV[3] ~= '0' then
  local tok = redis.call('HGET', KEYS[2], 'token')
  if tok ~= ARGV[3] then return {0, 'fence'} end
end
local n = tonumber(ARGV[5])
for i = 0, n - 1 do
  if redis.call('PERSIST', ARGV[7] .. i) == 0 and redis.call('EXISTS', ARGV[7] .. i) == 0 then
    return {0, 'missing'}
  end
end
local oldv = tonumber(redis.call('HGET', head, 'version') or '0')
local oldn = tonumber(redis.call('HGET', head, 'nchunks') or '0')
redis.call('HDEL', head, 'd')
redis.call('HSET', head, 'etag', ARGV[2], 'version', ARGV[4], 'nchunks', n, 'size', ARGV[6])
redis.call('SADD', KEYS[3], ARGV[8])
redis.call('SADD', KEYS[4], ARGV[9])
return {1, oldv, oldn}
"""

_CLEAR = """
local head = KEYS[1]
local cur = redis.call('HGET', head, 'etag') or ''
if ARGV[1] ~= '*' and cur ~= ARGV[1] then return {0, 'etag'} end
if ARGV[2] ~= '0' then
  local tok = redis.call('HGET', KEYS[2], 'token')
  if tok ~= ARGV[2] then return {0, 'fence'} end
end
local oldv = tonumber(redis.call('HGET', head, 'version') or '0')
local oldn = tonumber(redis.call('HGET', head, 'nchunks') or '0')
redis.call('DEL', head)
redis.call('SREM', KEYS[3], ARGV[3])
return {1, oldv, oldn}
"""


class RedisStateStore:
    """Grain state in Redis, fenced by the directory's token."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: StorageSettings) -> None:
        self._redis = redis
        self._keys = keys
        self._settings = settings
        self._inline = redis.register_script(_WRITE_INLINE)
        self._commit = redis.register_script(_COMMIT_CHUNKED)
        self._clear = redis.register_script(_CLEAR)
        self._reads = self._writes = self._conflicts = self._errors = 0
        self._bytes_written = self._bytes_read = 0

    async def _retry(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        delay = self._settings.retry_backoff_s
        for attempt in range(self._settings.retries + 1):
            try:
                return await op()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
                if attempt == self._settings.retries:
                    self._errors += 1
                    raise errors.StorageError(f"{what}: Redis unreachable after {attempt + 1} tries ({exc})") from exc
                await asyncio.sleep(delay)
                delay *= 2
            except redis.exceptions.RedisError as exc:
                self._errors += 1
                raise errors.StorageError(f"{what}: Redis error ({exc})") from exc
        raise AssertionError("unreachable")

    def _fence_keys(self, grain: GrainId) -> list[str]:
        g = str(grain)
        k = self._keys
        return [k.state_head(g), k.directory_entry(g), k.state_index(grain.type_name), k.state_types()]

    async def read(self, grain: GrainId) -> StoredState | None:
        g = str(grain)
        for _ in range(5):
            head = await self._retry(f"read state of {g}", lambda: self._redis.hgetall(self._keys.state_head(g)))
            if not head:
                return None
            etag = head[b"etag"].decode()
            if b"d" in head:
                self._reads += 1
                self._bytes_read += len(head[b"d"])
                return _parse_stream(memoryview(bytearray(head[b"d"])), etag)
            version, n, size = int(head[b"version"]), int(head[b"nchunks"]), int(head[b"size"])
            stream = bytearray(size)
            pos = 0
            complete = True
            # Fetch a few chunks at a time: bounded memory beyond the result itself.
            for start in range(0, n, 4):
                names = [self._keys.state_chunk(g, version, i) for i in range(start, min(n, start + 4))]
                parts = await self._retry(f"read state of {g}", lambda names=names: self._redis.mget(names))
                for part in parts:
                    if part is None:
                        complete = False
                        break
                    stream[pos : pos + len(part)] = part
                    pos += len(part)
                if not complete:
                    break
            if complete and pos == size:
                self._reads += 1
                self._bytes_read += size
                return _parse_stream(memoryview(stream), etag)
            # A newer version replaced this one while we read it: read the head again.
        raise errors.StorageError(f"state of {g} kept changing while being read")

    async def write(self, grain: GrainId, value: Encoded, etag: str | None, token: int) -> str:
        g = str(grain)
        parts = _stream_parts(value)
        size = sum(p.nbytes for p in parts)
        new_etag = uuid.uuid4().hex
        keys = self._fence_keys(grain)
        if size <= self._settings.chunk_bytes:
            data = b"".join(parts)
            res = await self._retry(
                f"write state of {g}",
                lambda: self._inline(
                    keys=keys, args=[etag or "", new_etag, str(token), data, grain.key, grain.type_name]
                ),
            )
        else:
            version = await self._retry(
                f"write state of {g}", lambda: self._redis.hincrby(self._keys.state_head(g) + ":seq", "v", 1)
            )
            version = int(version) + 1_000_000_000  # never collides with inline versions
            n = 0
            for n, piece in enumerate(_chunks(parts, self._settings.chunk_bytes), start=1):
                key = self._keys.state_chunk(g, version, n - 1)
                body = piece[0] if len(piece) == 1 else b"".join(piece)
                await self._retry(
                    f"write state of {g}", lambda key=key, body=body: self._redis.set(key, body, ex=_ORPHAN_TTL_S)
                )
            prefix = self._keys.state_chunk(g, version, 0)[:-1]
            res = await self._retry(
                f"write state of {g}",
                lambda: self._commit(
                    keys=keys,
                    args=[etag or "", new_etag, str(token), version, n, size, prefix, grain.key, grain.type_name],
                ),
            )
            if int(res[0]) != 1:
                await self._drop_chunks(g, version, n)
        if int(res[0]) != 1:
            self._conflicts += 1
            why = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
            detail = {
                "etag": "the stored state changed since this activation read it (etag mismatch)",
                "fence": "another activation owns the grain now (fencing token mismatch)",
                "missing": "state chunks vanished before commit",
            }.get(why, why)
            raise errors.StateConflictError(g, detail)
        self._writes += 1
        self._bytes_written += size
        await self._drop_chunks(g, int(res[1]), int(res[2]))
        return new_etag

    async def clear(self, grain: GrainId, etag: str | None, token: int) -> None:
        g = str(grain)
        keys = self._fence_keys(grain)[:3]
        res = await self._retry(
            f"clear state of {g}", lambda: self._clear(keys=keys, args=[etag or "", str(token), grain.key])
        )
        if int(res[0]) != 1:
            self._conflicts += 1
            raise errors.StateConflictError(g, "state changed or grain owned elsewhere")
        await self._drop_chunks(g, int(res[1]), int(res[2]))

    async def _drop_chunks(self, g: str, version: int, n: int) -> None:
        if n <= 0:
            return
        try:
            await self._redis.delete(*(self._keys.state_chunk(g, version, i) for i in range(n)))
        except redis.exceptions.RedisError as exc:
            log.warning("could not delete old state chunks of %s (they stay until removed): %s", g, exc)

    def statistics(self) -> StorageStatistics:
        return StorageStatistics(
            reads=self._reads,
            writes=self._writes,
            conflicts=self._conflicts,
            errors=self._errors,
            bytes_written=self._bytes_written,
            bytes_read=self._bytes_read,
        )


class InMemoryStateStore:
    """The same contract in a dict, for unit tests. ``owner`` plays the directory's token."""

    def __init__(self, owner: Callable[[GrainId], int] | None = None) -> None:
        self._data: dict[GrainId, tuple[bytes, str]] = {}
        self._owner = owner

    async def read(self, grain: GrainId) -> StoredState | None:
        found = self._data.get(grain)
        if found is None:
            return None
        return _parse_stream(memoryview(bytearray(found[0])), found[1])

    def _check(self, grain: GrainId, etag: str | None, token: int) -> None:
        cur = self._data.get(grain)
        if (cur[1] if cur else None) != (etag or None):
            raise errors.StateConflictError(str(grain), "etag mismatch")
        if self._owner is not None and token and self._owner(grain) != token:
            raise errors.StateConflictError(str(grain), "fencing token mismatch")

    async def write(self, grain: GrainId, value: Encoded, etag: str | None, token: int) -> str:
        self._check(grain, etag, token)
        new = uuid.uuid4().hex
        self._data[grain] = (b"".join(_stream_parts(value)), new)
        return new

    async def clear(self, grain: GrainId, etag: str | None, token: int) -> None:
        self._check(grain, etag, token)
        self._data.pop(grain, None)


