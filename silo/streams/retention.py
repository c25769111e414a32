"""Retention by age on a timer, and pruning what streams leave behind.

A publish trims its own stream (``maxlen``, ``max_age_s``), but a stream
nobody publishes to any more would keep its items for good, however old, and
the namespace sets (``keys.stream_namespaces``, ``keys.stream_keys``) would
keep naming it. So every ``retention_interval_s`` one silo of the cluster
(whoever takes ``keys.stream_retention_lock`` for the interval) sweeps every
stream of every namespace:

- trims it to ``max_age_s`` (when set; with ``approximate_trim`` a stream
  whose every item is too old is trimmed exactly, or a node's worth would stay);
- deletes it when it is empty and no subscriber is owed anything (each
  consumer group has nothing pending and has read every item the stream ever
  had: a group behind keeps the stream, so its gap is still told to it);
- removes from the key set a key whose stream is gone, and from the namespace
  set a namespace with no key left.

The sets and the streams are never changed in one script (they may live in
different Redis Cluster slots one day: keys.py), so a removal races a publish:
the publish adds the key (and namespace) before its ``XADD`` and again after
it, and the sweep, having removed an entry, looks again and puts it back when
the stream (or a key) has appeared meanwhile. Whichever order the commands
take, a key with a stream ends up in its set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from silo import errors
from silo.keys import Keys
from silo.redis_util import redis_errors
from silo.settings import StreamSettings

log = logging.getLogger("redgrain.streams")

# KEYS: stream.  ARGV: cutoff id ('' for no max age), '1' to trim approximately.
# Returns {items trimmed, 0: kept | 1: was gone already | 2: deleted now}.
_SWEEP = """
local function map(flat)
  local t = {}
  for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
  return t
end
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 1} end
local trimmed = 0
if ARGV[1] ~= '' then
  if ARGV[2] == '1' then
    trimmed = redis.call('XTRIM', KEYS[1], 'MINID', '~', ARGV[1])
    local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
    if #newest > 0 and older(newest[1][1], ARGV[1]) then
      trimmed = trimmed + redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1])
    end
  else
    trimmed = redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1])
  end
end
if redis.call('XLEN', KEYS[1]) > 0 then return {trimmed, 0} end
local added = map(redis.call('XINFO', 'STREAM', KEYS[1]))['entries-added']
for _, row in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local g = map(row)
  if g['pending'] > 0 or not g['entries-read'] or g['entries-read'] < added then return {trimmed, 0} end
end
redis.call('DEL', KEYS[1])
return {trimmed, 2}
"""

SCAN_BATCH = 200
"""Stream keys swept per pipeline."""


@dataclass(frozen=True, slots=True)
class StreamRetentionStatistics:
    sweeps: int
    """Sweeps this silo ran (it held the cluster's retention lock for the interval)."""
    trimmed: int
    """Items trimmed by age in those sweeps."""
    streams_deleted: int
    """Empty streams deleted (no item kept, no subscriber owed one)."""
    keys_pruned: int
    """Stream keys removed from their namespace's set (their stream was gone)."""
    namespaces_pruned: int
    """Namespaces removed from the namespace set (no key left)."""


class StreamRetention:
    """One silo's share of stream retention: a sweep every interval, when it wins the lock."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: Keys,
        settings: StreamSettings,
        me: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis, self._keys, self._settings, self._me = redis, keys, settings, me
        self._clock = clock
        """Wall clock: the cutoff is compared with token times (unix ms)."""
        self._sweep_script = redis.register_script(_SWEEP)
        self._task: asyncio.Task[None] | None = None
        self._sweeps = self._trimmed = self._deleted = self._keys_pruned = self._namespaces_pruned = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="streams: retention")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = self._settings.retention_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep_if_due()
            except errors.StorageError as exc:
                log.warning("streams: retention sweep: %s", exc)
            except Exception:  # the timer must outlive one bad sweep
                log.exception("streams: retention sweep failed")

    async def sweep_if_due(self) -> bool:
        """Sweep if no other silo has this interval (the lock lives a little less than it)."""
        ttl_ms = max(1, round(self._settings.retention_interval_s * 900))
        with redis_errors("take the stream retention lock"):
            if not await self._redis.set(self._keys.stream_retention_lock, self._me, nx=True, px=ttl_ms):
                return False
        await self.sweep()
        return True

    async def sweep(self) -> None:
        """Trim by age, delete empty streams nobody is owed, prune the sets (see the module doc)."""
        s = self._settings
        cutoff = "" if s.max_age_s is None else f"{max(int((self._clock() - s.max_age_s) * 1000), 0)}-0"
        approx = "1" if s.approximate_trim else "0"
        with redis_errors("sweep streams"):
            namespaces = [_text(n) for n in await self._redis.smembers(self._keys.stream_namespaces)]
            for ns in namespaces:
                keyset = self._keys.stream_keys(ns)
                cursor: Any = 0
                while True:
                    cursor, found = await self._redis.sscan(keyset, cursor, count=SCAN_BATCH)
                    names = [_text(k) for k in found]
                    if names:
                        await self._sweep_keys(ns, names, cutoff, approx)
                    if int(cursor) == 0:
                        break
                if not await self._redis.scard(keyset):
                    await self._redis.srem(self._keys.stream_namespaces, ns)
                    if await self._redis.scard(keyset):  # a publish came meanwhile
                        await self._redis.sadd(self._keys.stream_namespaces, ns)
                    else:
                        self._namespaces_pruned += 1
        self._sweeps += 1

    async def _sweep_keys(self, ns: str, names: list[str], cutoff: str, approx: str) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in names:
                await self._sweep_script(keys=[self._keys.stream(ns, name)], args=[cutoff, approx], client=pipe)
            replies = await pipe.execute()
        gone, deleted = [], set()
        for name, (trimmed, state) in zip(names, replies, strict=True):
            self._trimmed += int(trimmed)
            if int(state):
                gone.append(name)
            if int(state) == 2:
                deleted.add(name)
        if not gone:
            return
        keyset = self._keys.stream_keys(ns)
        await self._redis.srem(keyset, *gone)
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in gone:
                pipe.exists(self._keys.stream(ns, name))
            back = {name for name, n in zip(gone, await pipe.execute(), strict=True) if n}
        if back:  # published to between the sweep and the removal: its set entry stays
            await self._redis.sadd(keyset, *back)
        self._keys_pruned += len(gone) - len(back)
        self._deleted += len(deleted)

    def statistics(self) -> StreamRetentionStatistics:
        return StreamRetentionStatistics(
            sweeps=self._sweeps,
            trimmed=self._trimmed,
            streams_deleted=self._deleted,
            keys_pruned=self._keys_pruned,
            namespaces_pruned=self._namespaces_pruned,
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
