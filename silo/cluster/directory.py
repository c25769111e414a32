"""The grain directory: which activation on which silo owns each grain.

Register is one Lua script: if the entry is absent, or names a silo that is
not alive in the membership table, write ours with a fresh fencing token
and return it; otherwise return the winner, and the caller forwards
there. A registrant that is itself not alive (declared dead) is refused. Unregister is compare-and-delete. A per-silo index set lets survivors
purge a dead silo's entries (Orleans' Redis directory keeps such stale
entries; see dotnet/orleans #7054).

The purge runs in bounded steps, never as one script: Redis runs a script
to its end while every other client waits, and at ~2.7 µs an entry one script
over a silo's whole index blocked Redis 0.3 s for 100k entries and past
``dead_after_s`` (every silo fences itself) for ~1.4M. Each step SPOPs at
most ``PURGE_BATCH`` grains from the dead silo's index and deletes those of
their entries that still name it (~0.7 ms; other clients' commands, the
heartbeats first among them, run between steps). SPOP hands each grain to
one step only, so several survivors purging at once split the work; an
entry a live silo took over meanwhile names that silo and stays. A silo
that is live in the membership table is never purged: that would free its
grains for a second activation. Nothing is lost while a purge is under
way: register already takes over an entry whose silo is not live, so a
grain of the dead silo re-activates on its first call either way.

Fencing tokens must never repeat, also across a Redis failover. A counter
alone (INCR) does: a replica promoted before it received the last
increments hands the same numbers out again, and a zombie activation
holding one of them would pass the state store's fence (Kleppmann's point
against Redlock). So a token is the pair (epoch, counter), written as the
decimal digits of the epoch followed by the counter in 12 digits: one int
that sorts like the pair. The epoch belongs to a *master term*, recognised
by the master's replication id (``INFO replication`` ``master_replid``,
which Redis draws anew when a replica is promoted): the register script
keeps ``{replid, epoch}`` in one hash, and when it runs on a master whose
replid is not the stored one, it starts a new epoch,
``max(stored + 1, 1000 * (sentinel config epoch + 1))`` -- the
configuration epoch the registrant's client last read from the sentinels
(0 without Sentinel), which Sentinel's election raises on every failover.
So a promoted master's tokens sort above every token of the masters
before it even when the stored epoch did not reach it, as long as the
registrant has asked the sentinels since the failover (every new
connection does). An ACL user denied INFO has no replid to compare; its
epoch moves only when a registrant's config epoch is newer than the stored
one. docs/reliability.md says what remains.

A registration that won is followed by ``WAIT`` (see
:func:`silo.redis_util.run_replicated`) so it reaches a replica before the
activation serves, when the URL asks for replicas.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.keys import Keys
from silo.redis_util import fence_epoch_hint, redis_errors, run_replicated

LIVE_STATUSES = ("Joining", "Active", "ShuttingDown")


@dataclass(frozen=True, slots=True)
class DirectoryEntry:
    silo: SiloAddress
    activation_id: str
    token: int
    """Fencing token, ``epoch * 10**12 + counter``: never handed out twice, also across a failover."""


@dataclass(frozen=True, slots=True)
class DirectoryStatistics:
    registrations: int
    """Register calls that won (a new activation owns its grain)."""
    conflicts: int
    """Register calls that lost to a live activation elsewhere."""
    unregistrations: int
    """Entries removed by their owner."""
    purged: int
    """Entries removed because their silo died."""
    cache_size: int
    """Lookups cached on this silo or client."""
    cache_hits: int
    cache_misses: int


@dataclass(frozen=True, slots=True)
class PurgedBatch:
    """One bounded step of purging a dead silo's entries."""

    grains: tuple[GrainId, ...]
    """Grains whose entry this step deleted (it still named the dead silo)."""
    remaining: int
    """Grains left in the dead silo's index: 0 when the purge is complete."""


class GrainDirectory(Protocol):
    async def register(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> DirectoryEntry: ...

    async def unregister(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> bool: ...

    async def lookup(self, grain: GrainId) -> DirectoryEntry | None: ...

    async def purge_batch(self, silo: SiloAddress) -> PurgedBatch: ...

    async def purge_silo(self, silo: SiloAddress) -> int: ...

    def cached(self, grain: GrainId) -> DirectoryEntry | None: ...

    def invalidate(self, grain: GrainId) -> None: ...

    def invalidate_silo(self, silo: SiloAddress) -> None: ...

    def statistics(self) -> DirectoryStatistics: ...


COUNTER_DIGITS = 12
"""Decimal digits of a token's counter part: token = epoch * 10**12 + counter."""

# fencing_token(term, counter, hint): the next token of this master term, as a string
# (Lua numbers are doubles: the digits are joined, never multiplied out).
FENCING_TOKEN_LUA = """
local function fencing_token(term_key, counter_key, hint)
  local term = redis.call('HMGET', term_key, 'replid', 'epoch')
  local epoch = tonumber(term[2] or '') or 0
  local floor = 1000 * (hint + 1)
  -- INFO is in @dangerous: an ACL user without it falls back to the sentinels' epoch alone.
  local ok, info = pcall(redis.call, 'INFO', 'replication')
  local replid = ok and string.match(info, 'master_replid:(%x+)') or nil
  if replid then
    if term[1] ~= replid then
      -- A new master term (a promoted replica, or a restart with a new replication id).
      epoch = math.max(epoch + 1, floor)
      redis.call('HSET', term_key, 'replid', replid, 'epoch', epoch)
    end
  elseif epoch < floor then
    -- The registrant has seen a failover this node's epoch does not reflect yet.
    epoch = floor
    redis.call('HSET', term_key, 'replid', '', 'epoch', epoch)
  end
  local n = redis.call('INCR', counter_key)
  if n >= 1e12 then  -- the counter would spill into the epoch's digits: next epoch
    epoch = epoch + 1
    redis.call('HSET', term_key, 'epoch', epoch)
    redis.call('SET', counter_key, 1)
    n = 1
  end
  return string.format('%d%012d', epoch, n)
end
"""

_REGISTER = FENCING_TOKEN_LUA + """
local cur = redis.call('HMGET', KEYS[1], 'silo', 'act', 'token')
if cur[1] == ARGV[1] then return cur end
-- A registrant that is not live (declared dead: a zombie) claims nothing.
local mine = redis.call('HGET', KEYS[2], ARGV[1])
if not mine then return {'!dead', '', '0'} end
local okm, me = pcall(cjson.decode, mine)
if not okm or not (me['status'] == 'Joining' or me['status'] == 'Active' or me['status'] == 'ShuttingDown') then
  return {'!dead', '', '0'}
end
if cur[1] then
  local row = redis.call('HGET', KEYS[2], cur[1])
  if row then
    local ok, m = pcall(cjson.decode, row)
    if ok and (m['status'] == 'Joining' or m['status'] == 'Active' or m['status'] == 'ShuttingDown') then
      return cur
    end
  end
  redis.call('SREM', ARGV[4] .. cur[1], ARGV[3])
end
local token = fencing_token(KEYS[5], KEYS[3], tonumber(ARGV[5]) or 0)
redis.call('HSET', KEYS[1], 'silo', ARGV[1], 'act', ARGV[2], 'token', token)
redis.call('SADD', KEYS[4], ARGV[3])
return {ARGV[1], ARGV[2], token}
"""

_UNREGISTER = """
local act = redis.call('HGET', KEYS[1], 'act')
if act == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

PURGE_BATCH = 250
"""Grains one purge step takes from a dead silo's index at most: ~0.7 ms of Redis at 2.7 µs an
entry (measured here). The first steps after the index grew can take ~3x that: SPOP's random
picks finish the set's incremental rehash, up to 15 bucket moves a pick. Both stay inside the
5 ms a script may hold Redis."""

# KEYS: the dead silo's index, members.  ARGV: silo, entry key prefix, batch.
# Returns {grains left in the index, removed grain ids...}, or {-1} if the silo is live.
_PURGE_BATCH = """
local row = redis.call('HGET', KEYS[2], ARGV[1])
if row then
  local ok, m = pcall(cjson.decode, row)
  if ok and (m['status'] == 'Joining' or m['status'] == 'Active' or m['status'] == 'ShuttingDown') then
    return {-1}
  end
end
local out = {0}
for _, g in ipairs(redis.call('SPOP', KEYS[1], tonumber(ARGV[3]))) do
  local key = ARGV[2] .. g
  if redis.call('HGET', key, 'silo') == ARGV[1] then
    redis.call('DEL', key)
    out[#out + 1] = g
  end
end
out[1] = redis.call('SCARD', KEYS[1])
return out
"""


class _Cache:
    """Bounded LRU of lookups; a misdirected call drops its entry."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._entries: OrderedDict[GrainId, DirectoryEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, grain: GrainId) -> DirectoryEntry | None:
        entry = self._entries.get(grain)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(grain)
        return entry

    def put(self, grain: GrainId, entry: DirectoryEntry) -> None:
        self._entries[grain] = entry
        self._entries.move_to_end(grain)
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def drop(self, grain: GrainId) -> None:
        self._entries.pop(grain, None)

    def drop_silo(self, silo: SiloAddress) -> None:
        for grain in [g for g, e in self._entries.items() if e.silo == silo]:
            del self._entries[grain]

    def __len__(self) -> int:
        return len(self._entries)


class _Silos:
    """One ``SiloAddress`` object per address read from Redis.

    A parsed address costs ~250 B (its strings and ints); the router caches an
    entry's silo for each of up to a million grains, so they share one.
    """

    LIMIT = 4096
    """Addresses kept; past it the map starts again (restarts add generations)."""

    def __init__(self) -> None:
        self._known: dict[str, SiloAddress] = {}

    def __call__(self, text: str) -> SiloAddress:
        silo = self._known.get(text)
        if silo is None:
            if len(self._known) >= self.LIMIT:
                self._known.clear()
            silo = self._known[text] = SiloAddress.parse(text)
        return silo


def _entry(raw: Iterable[bytes | str | None], silos: Callable[[str], SiloAddress] = SiloAddress.parse) -> DirectoryEntry | None:
    silo, act, token = (x.decode() if isinstance(x, bytes) else x for x in raw)
    if not silo or not act:
        return None
    return DirectoryEntry(silos(silo), act, int(token or 0))


class _Counters:
    def __init__(self) -> None:
        self.registrations = 0
        self.conflicts = 0
        self.unregistrations = 0
        self.purged = 0


class RedisGrainDirectory:
    """The directory in Redis (Lua, fenced) with a local lookup cache."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        cache_size: int = 100_000,
        purge_batch: int = PURGE_BATCH,
    ) -> None:
        if purge_batch < 1:
            raise errors.ConfigError(f"purge_batch must be at least 1, not {purge_batch}")
        self._redis = redis
        self._keys = keys
        self._cache = _Cache(cache_size)
        self._silos = _Silos()
        self._n = _Counters()
        self._purge_count = purge_batch
        self._register = redis.register_script(_REGISTER)
        self._unregister = redis.register_script(_UNREGISTER)
        self._purge = redis.register_script(_PURGE_BATCH)

    async def register(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> DirectoryEntry:
        k = self._keys
        g = str(grain)
        with redis_errors("directory register"):
            raw = await run_replicated(
                self._redis,
                self._register,
                [k.directory_entry(g), k.members, k.fencing_counter, k.directory_index(str(silo)), k.fencing_term],
                [str(silo), activation_id, g, k.directory_index(""), fence_epoch_hint(self._redis)],
            )
        first = raw[0].decode() if isinstance(raw[0], bytes) else raw[0]
        if first == "!dead":
            raise errors.MembershipError(f"silo {silo} is not live in the membership table: it may not register {g}")
        entry = _entry(raw, self._silos)
        if entry is None:  # pragma: no cover - the script always returns a full entry
            raise errors.StorageError(f"directory register for {g} returned {raw!r}")
        if entry.activation_id == activation_id:
            self._n.registrations += 1
        else:
            self._n.conflicts += 1
        self._cache.put(grain, entry)
        return entry

    async def unregister(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> bool:
        g = str(grain)
        self._cache.drop(grain)
        with redis_errors("directory unregister"):
            done = await self._unregister(
                keys=[self._keys.directory_entry(g), self._keys.directory_index(str(silo))],
                args=[activation_id, g],
            )
        if done:
            self._n.unregistrations += 1
        return bool(done)

    async def lookup(self, grain: GrainId) -> DirectoryEntry | None:
        with redis_errors("directory lookup"):
            raw = await self._redis.hmget(self._keys.directory_entry(str(grain)), ["silo", "act", "token"])
        entry = _entry(raw, self._silos)
        if entry is not None:
            self._cache.put(grain, entry)
        else:
            self._cache.drop(grain)
        return entry

    async def purge_batch(self, silo: SiloAddress) -> PurgedBatch:
        """One bounded step: delete up to ``purge_batch`` of a dead silo's entries."""
        k = self._keys
        with redis_errors("directory purge"):
            raw = await self._purge(
                keys=[k.directory_index(str(silo)), k.members],
                args=[str(silo), k.directory_entry(""), self._purge_count],
            )
        remaining = int(raw[0])
        if remaining < 0:
            raise errors.MembershipError(f"silo {silo} is live: its directory entries are not purged")
        grains = tuple(GrainId.parse(g.decode() if isinstance(g, bytes) else g) for g in raw[1:])
        self._n.purged += len(grains)
        return PurgedBatch(grains, remaining)

    async def purge_silo(self, silo: SiloAddress) -> int:
        """Delete every entry a dead silo still owns, one bounded step after another."""
        self._cache.drop_silo(silo)
        n = 0
        while True:
            batch = await self.purge_batch(silo)
            n += len(batch.grains)
            if not batch.remaining:
                return n

    async def entries_of(self, silo: SiloAddress) -> list[GrainId]:
        """The grains a silo's index lists (read with SSCAN: no one command reads it whole)."""
        with redis_errors("directory index"):
            members = [m async for m in self._redis.sscan_iter(self._keys.directory_index(str(silo)), count=self._purge_count)]
        return [GrainId.parse(m.decode() if isinstance(m, bytes) else m) for m in set(members)]

    def cached(self, grain: GrainId) -> DirectoryEntry | None:
        return self._cache.get(grain)

    def invalidate(self, grain: GrainId) -> None:
        self._cache.drop(grain)

    def invalidate_silo(self, silo: SiloAddress) -> None:
        self._cache.drop_silo(silo)

    def statistics(self) -> DirectoryStatistics:
        return DirectoryStatistics(
            registrations=self._n.registrations,
            conflicts=self._n.conflicts,
            unregistrations=self._n.unregistrations,
            purged=self._n.purged,
            cache_size=len(self._cache),
            cache_hits=self._cache.hits,
            cache_misses=self._cache.misses,
        )
