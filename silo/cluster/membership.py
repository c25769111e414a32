"""The membership table: the contract every table keeps, and its Redis implementation.

Rows are JSON (so Lua scripts can read a status with cjson) in one hash,
keyed by the silo's address ``host:port@generation``; the live heartbeat and
load are fields of two hashes of their own, so a heartbeat never rewrites a
row and a monitor reads just the heartbeats it watches. Every status change
is one Lua script that bumps a version counter, appends the change to a
capped stream (the change feed, entry id ``<version>-0``) and publishes the
version: readers follow the feed (:meth:`MembershipTable.watch`) and read the
whole table only at start or when the feed no longer reaches back to their
version (each through its :class:`~silo.cluster.view.MembershipView`). A vote
against a suspected silo is one script too: counting the valid votes and
declaring the suspect Dead happen in one step, so no heartbeat or second
declaration slips in between. The in-memory twin with the same rules is
:class:`silo.testing.membership.InMemoryMembershipTable`. The layout and its
costs: docs/internals.md, "Membership at O(1) per silo".
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis

from silo import errors
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloLoad, SiloStatus, merge_row
from silo.redis_util import redis_errors

log = logging.getLogger("redgrain.membership")


class MembershipTable(Protocol):
    async def new_generation(self) -> int: ...

    async def join(self, row: MemberRow) -> int: ...

    async def set_status(self, address: str, status: SiloStatus) -> int: ...

    async def heartbeat(self, address: str, at: float, load: SiloLoad) -> SiloStatus | None: ...

    async def read_all(self) -> tuple[int, dict[str, MemberRow]]: ...

    async def watch(
        self, version: int, heartbeats: Sequence[str] = (), loads: Sequence[str] = ()
    ) -> MembershipWatch: ...

    async def moved(self, watcher: str, version: int, addresses: Sequence[str]) -> MembershipMoves: ...

    async def vote_dead(
        self, suspect: str, voter: str, seen_heartbeat: float | None, needed: int
    ) -> VoteOutcome: ...

    async def vote_unreachable(self, suspect: str, voter: str, needed: int, window_s: float) -> VoteOutcome: ...


@dataclass(frozen=True, slots=True)
class VoteOutcome:
    """What one vote against a suspected silo achieved."""

    result: str
    """``declared`` (this vote made it Dead), ``voted`` (counted, not enough yet), ``alive``
    (its heartbeat moved since the voter looked: vote void), ``dead`` (already Dead), ``gone``,
    or ``refused`` (the voter itself is Dead: a silo the cluster has dropped votes for nobody)."""
    votes: int
    """Valid votes counted, this one included."""


FEED_LENGTH = 1000
"""Changes the feed keeps (about: trimmed with ``MAXLEN ~``); a reader further behind reads the table."""

# Every script that changes a status ends in announce(): bump the version, append
# (address, new row) to the feed under the id <version>-0 and publish the version,
# all in the script that made the change, so a reader that follows the feed
# never misses one. KEYS[1..6] of every such script: rows, heartbeats, loads,
# version, feed, channel. An empty row in the feed means the row was removed.
_ANNOUNCE = """
local function announce(addr, raw)
  local v = redis.call('INCR', KEYS[4])
  redis.pcall('XADD', KEYS[5], 'MAXLEN', '~', FEED_LENGTH, v .. '-0', 'a', addr, 'r', raw)
  redis.call('PUBLISH', KEYS[6], v)
  return v
end
-- The last heartbeat into the row at a status change, so a Dead row keeps it.
local function with_heartbeat(addr, m)
  local hb = redis.call('HGET', KEYS[2], addr)
  if hb then m['heartbeat'] = tonumber(hb) end
end
""".replace("FEED_LENGTH", str(FEED_LENGTH))


def announcing(body: str) -> str:
    """A status-changing script: ``body`` may call ``announce(addr, raw_row)`` (KEYS[1..6] as
    :attr:`RedisMembershipTable.status_keys`)."""
    return _ANNOUNCE + body


_SET_STATUS = announcing("""
local row = redis.call('HGET', KEYS[1], ARGV[1])
if not row then return -1 end
local m = cjson.decode(row)
if m['status'] == 'Dead' then return -2 end
m['status'] = ARGV[2]
with_heartbeat(ARGV[1], m)
local raw = cjson.encode(m)
redis.call('HSET', KEYS[1], ARGV[1], raw)
return announce(ARGV[1], raw)
""")

_JOIN = announcing("""
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HDEL', KEYS[3], ARGV[1])
return announce(ARGV[1], ARGV[2])
""")

_REMOVE = announcing("""
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[7])  -- its detector's seen-hash: nothing reads it once the row is gone
announce(ARGV[1], '')
return 1
""")

# The heartbeat touches two small fields, never the row: monitors read the
# heartbeat field of the silos they watch (HMGET), views sample the loads.
# KEYS: rows, heartbeats, loads.  ARGV: address, heartbeat, load JSON.
_HEARTBEAT = """
local row = redis.call('HGET', KEYS[1], ARGV[1])
if not row then return 'Gone' end
local m = cjson.decode(row)
if m['status'] == 'Dead' then return 'Dead' end
-- No time given (the heartbeat thread): Redis' clock, so a detector reads how old a beat is in one clock.
local at = ARGV[2]
if at == '' then
  local t = redis.call('TIME')
  at = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
end
redis.call('HSET', KEYS[2], ARGV[1], at)
-- An empty load: unchanged since the last one sent (the heartbeat thread sends it on change or every
-- LOAD_REFRESH_S, not each beat: one command less a beat for an idle silo, issue 39).
if ARGV[3] ~= '' then redis.call('HSET', KEYS[3], ARGV[1], ARGV[3]) end
return m['status']
"""


# A detector's read: the version, one flag a watched silo ('1': its heartbeat moved since this
# detector last looked, '0': not; the values kept in the detector's own seen-hash for its votes)
# and each one's age in ms by Redis' clock (heartbeats are stamped with it), so the reply is a few
# bytes whatever the silos watched, and staleness does not depend on when the detector looked.
# KEYS: rows, heartbeats, version, seen.  ARGV: ttl ms, then the watched addresses.
_MOVED = """
local n = #ARGV - 1
local flags = {}
local ages = {}
if n > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  local addrs = {unpack(ARGV, 2)}
  local cur = redis.call('HMGET', KEYS[2], unpack(addrs))
  local prev = redis.call('HMGET', KEYS[4], unpack(addrs))
  local set = {}
  for i = 1, n do
    local c = cur[i]
    if not c then
      local raw = redis.call('HGET', KEYS[1], addrs[i])
      c = raw and tostring(cjson.decode(raw)['heartbeat']) or ''
    end
    local v = tonumber(c)
    ages[i] = v and tostring(math.max(0, math.floor((now - v) * 1000))) or ''
    if (prev[i] or '') ~= c then
      set[#set + 1] = addrs[i]
      set[#set + 1] = c
      flags[i] = '1'
    else
      flags[i] = '0'
    end
  end
  -- The TTL is renewed with each write only: a seen-hash nothing moved in for its TTL watches only
  -- silos declared dead long since (issue 39: a PEXPIRE a round was a tenth of an idle silo's cost).
  if #set > 0 then
    redis.call('HSET', KEYS[4], unpack(set))
    redis.call('PEXPIRE', KEYS[4], ARGV[1])
  end
end
return {redis.call('GET', KEYS[3]) or '0', table.concat(flags), table.concat(ages, ',')}
"""

# The end of both vote scripts once enough votes are in: mark the row Dead (with
# its last heartbeat), drop the votes (KEYS[7]) and announce the change.
# ARGV[1]: the suspect; m: its decoded row; n: the votes.
_DECLARE_DEAD = """
m['status'] = 'Dead'
with_heartbeat(ARGV[1], m)
local raw = cjson.encode(m)
redis.call('HSET', KEYS[1], ARGV[1], raw)
redis.call('DEL', KEYS[7])
announce(ARGV[1], raw)
return {'declared', n}
"""

# A vote counts only while the suspect's heartbeat is the one the voter saw
# unchanged: comparing heartbeat values instead of clocks keeps the rule
# immune to clock skew between silos. Enough valid votes -> Dead, in one step.
_VOTE_DEAD = announcing("""
local row = redis.call('HGET', KEYS[1], ARGV[1])
if not row then return {'gone', 0} end
local m = cjson.decode(row)
if m['status'] == 'Dead' then return {'dead', 0} end
local hb = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or m['heartbeat']) or 0
-- The value the voter saw: given, or the one its detector's seen-hash (KEYS[8]) keeps.
local seen = tonumber(ARGV[3]) or tonumber(redis.call('HGET', KEYS[8], ARGV[1]) or '')
if not seen then return {'alive', 0} end
if math.abs(hb - seen) > 1e-4 then
  redis.call('DEL', KEYS[7])
  return {'alive', 0}
end
redis.call('HSET', KEYS[7], ARGV[2], tostring(seen))
redis.call('PEXPIRE', KEYS[7], 60000)
local votes = redis.call('HGETALL', KEYS[7])
local n = 0
for i = 2, #votes, 2 do
  if math.abs((tonumber(votes[i]) or -1) - hb) <= 1e-4 then n = n + 1 end
end
if n < tonumber(ARGV[4]) then return {'voted', n} end
""" + _DECLARE_DEAD)

# A silo whose heartbeat moves but that no peer can reach over the network (a
# partition between silos, Redis still reachable) serves nobody but the
# clients on its side. Peers that cannot even complete a TCP handshake with it
# vote here; votes are stamped with Redis' clock (one clock for every voter),
# count for ``window`` ms, and only while their voter is not Dead itself, so
# silos cut from each other cannot vote each other out in turn: the first to
# gather enough votes goes, and its own votes stop counting.
_VOTE_UNREACHABLE = announcing("""
local function live(addr)
  local raw = redis.call('HGET', KEYS[1], addr)
  if not raw then return false end
  local ok, r = pcall(cjson.decode, raw)
  return ok and r['status'] ~= 'Dead'
end
local row = redis.call('HGET', KEYS[1], ARGV[1])
if not row then return {'gone', 0} end
local m = cjson.decode(row)
if m['status'] == 'Dead' then return {'dead', 0} end
if not live(ARGV[2]) then return {'refused', 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[4])
redis.call('HSET', KEYS[7], ARGV[2], now)
redis.call('PEXPIRE', KEYS[7], 2 * window)
local votes = redis.call('HGETALL', KEYS[7])
local n = 0
for i = 1, #votes, 2 do
  if now - (tonumber(votes[i + 1]) or 0) <= window and live(votes[i]) then n = n + 1 end
end
if n < tonumber(ARGV[3]) then return {'voted', n} end
""" + _DECLARE_DEAD)

HEARTBEAT_LUA = _HEARTBEAT
"""The heartbeat script, for the heartbeat thread's own synchronous connection
(KEYS: :attr:`Keys.members`, :attr:`Keys.members_heartbeats`, :attr:`Keys.members_loads`)."""


Change = tuple[str, MemberRow | None]
"""One entry of the change feed: an address and its new row (None: the row was removed)."""


@dataclass(frozen=True, slots=True)
class MembershipWatch:
    """What one :meth:`MembershipTable.watch` read found."""

    version: int
    """The table's version, the changes applied."""
    changes: list[Change] | None
    """Rows changed since the version the reader had, oldest first; None when the feed no
    longer reaches back that far (or the reader had none): read the whole table."""
    heartbeats: dict[str, float]
    """The last heartbeat of each silo asked for that has a row."""
    loads: dict[str, SiloLoad]
    """The last published load of each silo asked for that has one."""


@dataclass(frozen=True, slots=True)
class MembershipMoves:
    """What a failure detector's read found (:meth:`MembershipTable.moved`)."""

    version: int
    """The table's version, the changes applied."""
    changes: list[Change] | None
    """As :attr:`MembershipWatch.changes`: since the version the detector had; None: read the table."""
    moved: dict[str, bool]
    """Each address asked for: True when its heartbeat changed since this watcher's last read
    (or it is new to the watcher)."""
    ages: dict[str, float] = field(default_factory=dict)
    """Seconds since each address's heartbeat was written, by the table's clock (Redis'); an
    address missing: unknown."""


SEEN_TTL_MS = 60_000
"""A detector's seen-hash outlives its last read by this long (a stopped silo's goes by itself)."""


def parse_feed(since: int, current: int, entries: list[Any]) -> tuple[int, list[Change]] | None:
    """Changes from XRANGE entries (id ``<version>-0``) after version ``since``; None when the
    run from ``since + 1`` to ``current`` is not all there (trimmed, or a gap)."""
    changes: list[Change] = []
    expect = since + 1
    for entry_id, fields in entries:
        eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        v = int(eid.split("-", 1)[0])
        if v != expect:
            return None
        expect += 1
        f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        addr = f.get("a", b"")
        addr = addr.decode() if isinstance(addr, bytes) else str(addr)
        raw = f.get("r", b"")
        if not raw:
            changes.append((addr, None))
            continue
        try:
            changes.append((addr, MemberRow.model_validate_json(raw)))
        except ValueError:
            return None
    if expect - 1 < current:
        return None
    return expect - 1, changes


class RedisMembershipTable:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._set_status = redis.register_script(_SET_STATUS)
        self._join = redis.register_script(_JOIN)
        self._remove = redis.register_script(_REMOVE)
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._vote = redis.register_script(_VOTE_DEAD)
        self._moved = redis.register_script(_MOVED)
        self._vote_unreachable = redis.register_script(_VOTE_UNREACHABLE)

    @property
    def status_keys(self) -> list[str]:
        """KEYS[1..6] of every script built with :func:`announcing`."""
        k = self._keys
        return [k.members, k.members_heartbeats, k.members_loads, k.members_version, k.members_feed, k.members_channel]

    async def new_generation(self) -> int:
        with redis_errors("membership generation"):
            return int(await self._redis.incr(self._keys.generation))

    async def join(self, row: MemberRow) -> int:
        with redis_errors("membership join"):
            return int(
                await self._join(keys=self.status_keys, args=[row.address, row.model_dump_json(), repr(row.heartbeat)])
            )

    async def set_status(self, address: str, status: SiloStatus) -> int:
        with redis_errors("membership status"):
            v = int(await self._set_status(keys=self.status_keys, args=[address, status.value]))
        if v == -1:
            raise errors.MembershipError(f"silo {address} is not in the membership table")
        if v == -2:
            raise errors.MembershipError(f"silo {address} was declared dead")
        return v

    async def heartbeat(self, address: str, at: float, load: SiloLoad) -> SiloStatus | None:
        k = self._keys
        with redis_errors("membership heartbeat"):
            raw = await self._heartbeat(
                keys=[k.members, k.members_heartbeats, k.members_loads],
                args=[address, repr(at), load.model_dump_json()],
            )
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return None if text == "Gone" else SiloStatus(text)

    async def read_all(self) -> tuple[int, dict[str, MemberRow]]:
        """The whole table (rows, heartbeats, loads): O(n), for a reader with nothing to go on."""
        k = self._keys
        with redis_errors("membership read"):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.get(k.members_version)
                pipe.hgetall(k.members)
                pipe.hgetall(k.members_heartbeats)
                pipe.hgetall(k.members_loads)
                version, rows, beats, loads = await pipe.execute()
        out: dict[str, MemberRow] = {}
        for addr, raw in rows.items():
            try:
                row = MemberRow.model_validate_json(raw)
            except ValueError:
                log.warning("skipping unreadable membership row %r", addr)
                continue
            out[row.address] = merge_row(row, beats.get(addr), loads.get(addr))
        return int(version or 0), out

    async def watch(self, version: int, heartbeats: Sequence[str] = (), loads: Sequence[str] = ()) -> MembershipWatch:
        """One round trip: the changes since ``version`` (from the feed), and the heartbeats and
        loads of the silos named. O(changes + silos named), never O(table)."""
        k = self._keys
        hb_addrs, load_addrs = list(heartbeats), list(loads)
        with redis_errors("membership watch"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.get(k.members_version)
                if version >= 0:
                    pipe.xrange(k.members_feed, min=f"{version + 1}-0", count=FEED_LENGTH + 200)
                if hb_addrs:
                    pipe.hmget(k.members_heartbeats, hb_addrs)
                if load_addrs:
                    pipe.hmget(k.members_loads, load_addrs)
                replies = list(await pipe.execute())
        current = int(replies.pop(0) or 0)
        changes: list[Change] | None = None
        if version >= 0:
            entries = replies.pop(0)
            if current == version and not entries:
                changes = []
            elif current >= version:
                parsed = parse_feed(version, current, entries)
                if parsed is not None:
                    current, changes = parsed
        beats: dict[str, float] = {}
        if hb_addrs:
            for addr, raw in zip(hb_addrs, replies.pop(0), strict=True):
                if raw is not None:
                    beats[addr] = float(raw)
        found: dict[str, SiloLoad] = {}
        if load_addrs:
            for addr, raw in zip(load_addrs, replies.pop(0), strict=True):
                if raw is not None:
                    with contextlib.suppress(ValueError):
                        found[addr] = SiloLoad.model_validate_json(raw)
        return MembershipWatch(current, changes, beats, found)

    async def moved(self, watcher: str, version: int, addresses: Sequence[str]) -> MembershipMoves:
        """One round trip of a few bytes: the version and whether each watched silo's heartbeat
        moved since ``watcher`` last asked; the feed is read (a second trip) only when the version
        moved, and never beyond the changes."""
        k = self._keys
        addrs = list(addresses)
        with redis_errors("membership read"):
            raw = await self._moved(
                keys=[k.members, k.members_heartbeats, k.members_version, k.members_seen(watcher)],
                args=[SEEN_TTL_MS, *addrs],
            )
        current = int(raw[0])
        flags = raw[1].decode() if isinstance(raw[1], bytes) else str(raw[1])
        moved = {a: f == "1" for a, f in zip(addrs, flags, strict=True)}
        text = raw[2].decode() if isinstance(raw[2], bytes) else str(raw[2])
        ages = {a: int(x) / 1000.0 for a, x in zip(addrs, text.split(",") if addrs else [], strict=True) if x}
        changes: list[Change] | None = [] if current == version else None
        if current != version and 0 <= version < current:
            watch = await self.watch(version)
            current, changes = watch.version, watch.changes
        return MembershipMoves(current, changes, moved, ages)

    async def vote_dead(self, suspect: str, voter: str, seen_heartbeat: float | None, needed: int) -> VoteOutcome:
        """A vote that ``suspect`` is dead, valid while its heartbeat is ``seen_heartbeat`` (None:
        the value ``voter``'s detector last read, :meth:`moved`)."""
        k = self._keys
        with redis_errors("membership vote"):
            raw = await self._vote(
                keys=[*self.status_keys, k.suspicions(suspect), k.members_seen(voter)],
                args=[suspect, voter, "" if seen_heartbeat is None else repr(seen_heartbeat), max(1, needed)],
            )
        result = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
        return VoteOutcome(result, int(raw[1]))

    async def vote_unreachable(self, suspect: str, voter: str, needed: int, window_s: float) -> VoteOutcome:
        k = self._keys
        with redis_errors("membership vote"):
            raw = await self._vote_unreachable(
                keys=[*self.status_keys, k.unreachable_votes(suspect)],
                args=[suspect, voter, max(1, needed), max(1, int(window_s * 1000))],
            )
        result = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
        return VoteOutcome(result, int(raw[1]))

    async def remove(self, address: str) -> None:
        """Forget a row (housekeeping; dead rows are kept a while for the dashboard); the feed says so."""
        with redis_errors("membership remove"):
            await self._remove(keys=[*self.status_keys, self._keys.members_seen(address)], args=[address])
