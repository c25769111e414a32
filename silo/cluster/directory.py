"""The grain directory: which activation on which silo owns each grain.

A grain's directory entry lives in the grain's own hash slot (``silo/keys.py``),
beside its state, so the state store's fenced check-and-set is one script in
one slot, also on Redis Cluster. Membership lives in another slot, so no
script reads both; register is a compare-and-set driven by the caller:

1. The caller reads its own membership row: a registrant that is not live
   (declared dead: a zombie) is refused. In the same round trip it adds the
   grain to its per-silo index (a superset of the entries naming it).
2. The register script (grain slot) writes our entry with a fresh fencing
   token if the entry is absent, or if it still names exactly the owner
   (silo and token) the caller was told it may replace; otherwise it returns
   the entry it found.
3. If it found another silo's entry, the caller reads that silo's row: a
   live owner wins (the caller forwards there); a silo that is not live
   (Dead, or its row removed by housekeeping) never becomes live again --
   a restart is a new address generation -- so the caller runs the script
   again naming that owner and token as replaceable.

Why single activation and fencing hold without one atomic read of both
(docs/decisions.md): the script only ever replaces an entry whose owner was
seen not live, and "not live" is terminal for an address+generation, so no
live owner's entry is replaced. The one race left is the registrant being
declared dead between step 1 and the script: its entry then names a dead
silo, which the next registrant takes over with a new token, and the state
store's fence (entry token == writer token, checked in the grain's slot)
refuses the zombie's writes from then on; the zombie also stops serving when
its own heartbeat reads Dead. Unregister is compare-and-delete on the entry.

The per-silo index lets survivors purge a dead silo's entries (Orleans'
Redis directory keeps such stale entries; see dotnet/orleans #7054). It
lives in the control slot, outside every script: written before the register
script, it lists every grain whose entry may name the silo; the purge
deletes only entries that still name the dead silo, so an extra member is
harmless.

The purge runs in bounded steps, never as one script: Redis runs a script
to its end while every other client waits. Each step SPOPs at most
``PURGE_BATCH`` grains per master from the dead silo's index and runs,
pipelined, one compare-and-delete per grain in the grain's slot; other
clients' commands, the heartbeats first among them, run between them. (On a
Redis Cluster the grains of a step spread over the masters, so a step takes
``PURGE_BATCH`` per master: each master's share of a step stays what one
Redis does in a step.) SPOP hands each grain to one step only, so several
survivors purging at once split the work; an entry a live silo took over
meanwhile names that silo and stays. A silo that is live in the membership
table is never purged (read before each step until it reads not live: a
dead silo never comes back). Nothing is lost while a purge is under way:
register already takes over an entry whose silo is not live.

Fencing tokens must never repeat for a grain, also across a Redis failover.
A counter alone (INCR) does: a replica promoted before it received the last
increments hands the same numbers out again, and a zombie activation
holding one of them would pass the state store's fence (Kleppmann's point
against Redlock). So a token is the pair (epoch, counter), written as the
decimal digits of the epoch followed by the counter in 12 digits: one int
that sorts like the pair. On a Redis Cluster, counter and epoch are kept
per hash slot (the grain's: ``Keys.fencing_counter``), on the master that
serves the grain (tokens then rise per slot, which is all the per-grain fence
needs); on one Redis there is one pair for the whole cluster.
The epoch belongs to a *master term*, recognised by the master's
replication id (``INFO replication`` ``master_replid``, which Redis draws
anew when a replica is promoted, by Sentinel or by Redis Cluster): the
register script keeps ``{replid, epoch}`` in one hash, and when it runs on a
master whose replid is not the stored one, it starts a new epoch,
``max(stored + 1, 1000 * (sentinel config epoch + 1))`` -- the
configuration epoch the registrant's client last read from the sentinels (0
without Sentinel), which Sentinel's election raises on every failover, or on
Redis Cluster the master's own config epoch (``cluster_my_epoch``), which a
promotion raises above every other master's. So a
promoted master's tokens sort above every token of the masters before it
even when the stored epoch did not reach it, as long as the registrant has
asked the sentinels since the failover (every new connection does). An ACL
user denied INFO has no replid to compare; its epoch moves only when a
registrant's config epoch is newer than the stored one.
docs/reliability.md says what remains.

A registration that won is followed by ``WAIT`` (see
:func:`silo.redis_util.run_replicated`) so it reaches a replica before the
activation serves, when the URL asks for replicas.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
import redis.exceptions

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.keys import Keys
from silo.redis_util import (
    CLOSED_UNDER_US,
    closed_under_us,
    fence_epoch_hint,
    is_cluster,
    redis_errors,
    run_replicated,
    run_script_batch,
)

LIVE_STATUSES = ("Joining", "Active", "ShuttingDown")

log = logging.getLogger("redgrain.directory")


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
  -- The floor of a new term: the sentinels' epoch the registrant saw, or on Redis Cluster this
  -- master's config epoch (a promoted replica's is above every master's before it).
  local function floor()
    local h = hint
    local okc, ci = pcall(redis.call, 'CLUSTER', 'INFO')
    if okc then h = math.max(h, tonumber(string.match(ci, 'cluster_my_epoch:(%d+)') or '0') or 0) end
    return 1000 * (h + 1)
  end
  -- INFO is in @dangerous: an ACL user without it falls back to the floor alone.
  local ok, info = pcall(redis.call, 'INFO', 'replication')
  local replid = ok and string.match(info, 'master_replid:(%x+)') or nil
  if replid then
    if term[1] ~= replid then
      -- A new master term (a promoted replica, or a restart with a new replication id).
      epoch = math.max(epoch + 1, floor())
      redis.call('HSET', term_key, 'replid', replid, 'epoch', epoch)
    end
  else
    local f = floor()
    if epoch < f then
      -- The registrant has seen a failover this node's epoch does not reflect yet.
      epoch = f
      redis.call('HSET', term_key, 'replid', '', 'epoch', epoch)
    end
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

# KEYS: entry, fencing counter, fencing term (all three in the grain's slot)
# ARGV: silo, activation, replaceable owner ('' none), its token, sentinel epoch hint.
# Returns the entry that stands: ours if we won.
_REGISTER = FENCING_TOKEN_LUA + """
local cur = redis.call('HMGET', KEYS[1], 'silo', 'act', 'token')
if cur[1] == ARGV[1] then return cur end
if cur[1] and not (cur[1] == ARGV[3] and cur[3] == ARGV[4]) then return cur end
local token = fencing_token(KEYS[3], KEYS[2], tonumber(ARGV[5]) or 0)
redis.call('HSET', KEYS[1], 'silo', ARGV[1], 'act', ARGV[2], 'token', token)
return {ARGV[1], ARGV[2], token}
"""

# KEYS: entry.  ARGV: activation
_UNREGISTER = """
if redis.call('HGET', KEYS[1], 'act') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

PURGE_BATCH = 250
_NOT_LIVE_KEPT = 1024
"""Silos a directory remembers reading not live (each skips the row's read in later steps)."""
"""Grains one purge step takes from a dead silo's index at most. The SPOP is one command; the
compare-and-deletes are one tiny script each, so no single command holds Redis for long."""

# KEYS: entry.  ARGV: the dead silo.  Deletes the entry only if it still names that silo.
_PURGE_ENTRY = """
if redis.call('HGET', KEYS[1], 'silo') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

_MAX_TAKEOVERS = 8
"""Register rounds at most: each round meets a dead owner another registrant had just replaced."""


def _live(row: bytes | str | None) -> bool:
    """Is this membership row one of a live silo? (Not live is for good: see the module doc.)"""
    if not row:
        return False
    try:
        status = json.loads(row).get("status")
    except (ValueError, AttributeError):
        return False
    return status in LIVE_STATUSES


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
        self._purge = redis.register_script(_PURGE_ENTRY)
        # One Redis holds every slot: one counter for all, as tokens always were there.
        self._per_slot = is_cluster(redis)
        self._n_masters: int | None = None
        self._not_live: OrderedDict[str, None] = OrderedDict()

    async def register(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> DirectoryEntry:
        k = self._keys
        g, me = str(grain), str(silo)
        with redis_errors("directory register"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hget(k.members, me)
                pipe.sadd(k.directory_index(me), g)
                mine, _ = await pipe.execute()
            if not _live(mine):
                await self._withdraw(g, me, None)
                raise errors.MembershipError(f"silo {silo} is not live in the membership table: it may not register {g}")
            fence = g if self._per_slot else None
            keys = [k.directory_entry(g), k.fencing_counter(fence), k.fencing_term(fence)]
            replaceable = ("", "")
            for _ in range(_MAX_TAKEOVERS):
                raw = await run_replicated(
                    self._redis, self._register, keys, [me, activation_id, *replaceable, fence_epoch_hint(self._redis)]
                )
                entry = _entry(raw, self._silos)
                if entry is None:  # pragma: no cover - the script always returns a full entry
                    raise errors.StorageError(f"directory register for {g} returned {raw!r}")
                owner = str(entry.silo)
                if owner == me or _live(await self._redis.hget(k.members, owner)):
                    break
                replaceable = (owner, str(entry.token))  # not live, for good: that entry may go
            else:
                raise errors.StorageError(f"directory register for {g}: the entry kept changing hands")
        if entry.activation_id == activation_id:
            # The script cannot read membership (another slot): a silo declared dead after our
            # read above, and purged before our write, would leave this entry behind. Read again:
            # a death after this read is purged later and finds the grain in our index.
            with redis_errors("directory register"):
                still = await self._redis.hget(k.members, me)
            if not _live(still):
                self._cache.drop(grain)
                await self._withdraw(g, me, activation_id)
                raise errors.MembershipError(f"silo {silo} was declared dead while it registered {g}")
            self._n.registrations += 1
            if replaceable[0]:
                await self._forget_in_index(replaceable[0], g)
        else:
            self._n.conflicts += 1
            if str(entry.silo) != me:
                await self._forget_in_index(me, g)
        self._cache.put(grain, entry)
        return entry

    async def _withdraw(self, grain: str, me: str, activation_id: str | None) -> None:
        """A registrant found not live takes back what it wrote: its entry (if the script wrote
        one) and the index member added for it. Its purge may be over already, and nothing else
        would ever remove a member added after it; an entry naming us that we did not write now
        (an earlier registration) keeps its member, for the purge to find."""
        k = self._keys
        with redis_errors("directory register"):
            if activation_id is not None:
                await self._unregister(keys=[k.directory_entry(grain)], args=[activation_id])
            owner = await self._redis.hget(k.directory_entry(grain), "silo")
        if owner is None or (owner.decode() if isinstance(owner, bytes) else owner) != me:
            await self._forget_in_index(me, grain)

    async def _forget_in_index(self, silo: str, grain: str) -> None:
        """Best effort: the index may list more than the silo owns (the purge checks each entry)."""
        try:
            await self._redis.srem(self._keys.directory_index(silo), grain)
        except (redis.exceptions.RedisError, OSError, *CLOSED_UNDER_US) as exc:
            if isinstance(exc, CLOSED_UNDER_US) and not closed_under_us(exc):
                raise
            log.debug("directory index of %s keeps %s: %s", silo, grain, exc)

    async def unregister(self, grain: GrainId, silo: SiloAddress, activation_id: str) -> bool:
        g = str(grain)
        self._cache.drop(grain)
        with redis_errors("directory unregister"):
            done = await self._unregister(keys=[self._keys.directory_entry(g)], args=[activation_id])
        if done:
            self._n.unregistrations += 1
            await self._forget_in_index(str(silo), g)
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
        dead = str(silo)
        with redis_errors("directory purge"):
            if dead not in self._not_live:
                if _live(await self._redis.hget(k.members, dead)):
                    raise errors.MembershipError(f"silo {silo} is live: its directory entries are not purged")
                self._not_live[dead] = None  # for good: later steps need not read the row again
                if len(self._not_live) > _NOT_LIVE_KEPT:
                    self._not_live.popitem(last=False)
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.spop(k.directory_index(dead), self._purge_count * await self._masters())
                pipe.scard(k.directory_index(dead))
                popped, left = await pipe.execute()
            names = [g.decode() if isinstance(g, bytes) else str(g) for g in popped or []]
            done = await run_script_batch(self._redis, self._purge, [([k.directory_entry(g)], [dead]) for g in names])
            remaining = int(left)
        grains = tuple(GrainId.parse(g) for g, d in zip(names, done, strict=True) if int(d))
        self._n.purged += len(grains)
        return PurgedBatch(grains, remaining)

    async def _masters(self) -> int:
        """How many masters share the grains' slots (1 on one Redis), read once."""
        if self._n_masters is None:
            if self._per_slot:
                await self._redis.initialize()  # type: ignore[attr-defined]
                self._n_masters = max(1, len(self._redis.get_primaries()))  # type: ignore[attr-defined]
            else:
                self._n_masters = 1
        return self._n_masters

    async def purge_silo(self, silo: SiloAddress) -> int:
        """Delete every entry a dead silo still owns, one bounded step after another."""
        self._cache.drop_silo(silo)
        return await purge_in_steps(self, silo)

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


async def purge_in_steps(directory: GrainDirectory, silo: SiloAddress) -> int:
    """``purge_batch`` until the dead silo's index is empty: how every directory purges a silo,
    so each step stays bounded and other commands run between them. Returns the entries deleted."""
    n = 0
    while True:
        batch = await directory.purge_batch(silo)
        n += len(batch.grains)
        if not batch.remaining:
            return n
