"""The membership table in Redis: silo rows, status changes, heartbeats, the view.

Rows are JSON (so Lua scripts can read a status with cjson) in one hash,
keyed by the silo's address ``host:port@generation``. Every status change is
one Lua script that bumps a version counter and publishes it, so peers and
clients re-read the table as soon as anything changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis

from grains.ids import SiloAddress
from silo import errors
from silo.keys import Keys
from silo.records import MemberRow, SiloLoad, SiloStatus
from silo.redis_util import redis_errors

log = logging.getLogger("redgrain.membership")


class MembershipTable(Protocol):
    async def new_generation(self) -> int: ...

    async def join(self, row: MemberRow) -> int: ...

    async def set_status(self, address: str, status: SiloStatus) -> int: ...

    async def heartbeat(self, address: str, at: float, load: SiloLoad) -> SiloStatus | None: ...

    async def read_all(self) -> tuple[int, dict[str, MemberRow]]: ...

    async def vote_dead(self, suspect: str, voter: str, seen_heartbeat: float, needed: int) -> VoteOutcome: ...

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


_SET_STATUS = """
local row = redis.call('HGET', KEYS[1], ARGV[1])
if not row then return -1 end
local m = cjson.decode(row)
if m['status'] == 'Dead' then return -2 end
m['status'] = ARGV[2]
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(m))
local v = redis.call('INCR', KEYS[2])
redis.call('PUBLISH', KEYS[3], v)
return v
"""

_JOIN = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local v = redis.call('INCR', KEYS[2])
redis.call('PUBLISH', KEYS[3], v)
return v
"""

_HEARTBEAT = """
local row = redis.call('HGET', KEYS[1], ARGV[1])
if not row then return 'Gone' end
local m = cjson.decode(row)
if m['status'] == 'Dead' then return 'Dead' end
m['heartbeat'] = tonumber(ARGV[2])
m['load'] = cjson.decode(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(m))
return m['status']
"""


# The end of both vote scripts once enough votes are in: mark the row Dead, drop the
# votes, bump the membership version and tell every view (KEYS: table, votes,
# version, channel; ARGV[1]: the suspect; m: its decoded row; n: the votes).
_DECLARE_DEAD = """
m['status'] = 'Dead'
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(m))
redis.call('DEL', KEYS[2])
local v = redis.call('INCR', KEYS[3])
redis.call('PUBLISH', KEYS[4], v)
return {'declared', n}
"""

# A vote counts only while the suspect's heartbeat is the one the voter saw
# unchanged: comparing heartbeat values instead of clocks keeps the rule
# immune to clock skew between silos. Enough valid votes -> Dead, in one step.
_VOTE_DEAD = """
local row = redis.call('HGET', KEYS[1], ARGV[1])
if not row then return {'gone', 0} end
local m = cjson.decode(row)
if m['status'] == 'Dead' then return {'dead', 0} end
local hb = tonumber(m['heartbeat']) or 0
if math.abs(hb - tonumber(ARGV[3])) > 1e-4 then
  redis.call('DEL', KEYS[2])
  return {'alive', 0}
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[2], 60000)
local votes = redis.call('HGETALL', KEYS[2])
local n = 0
for i = 2, #votes, 2 do
  if math.abs((tonumber(votes[i]) or -1) - hb) <= 1e-4 then n = n + 1 end
end
if n < tonumber(ARGV[4]) then return {'voted', n} end
""" + _DECLARE_DEAD

# A silo whose heartbeat moves but that no peer can reach over the network (a
# partition between silos, Redis still reachable) serves nobody but the
# clients on its side. Peers that cannot even complete a TCP handshake with it
# vote here; votes are stamped with Redis' clock (one clock for every voter),
# count for ``window`` ms, and only while their voter is not Dead itself, so
# silos cut from each other cannot vote each other out in turn: the first to
# gather enough votes goes, and its own votes stop counting.
_VOTE_UNREACHABLE = """
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
redis.call('HSET', KEYS[2], ARGV[2], now)
redis.call('PEXPIRE', KEYS[2], 2 * window)
local votes = redis.call('HGETALL', KEYS[2])
local n = 0
for i = 1, #votes, 2 do
  if now - (tonumber(votes[i + 1]) or 0) <= window and live(votes[i]) then n = n + 1 end
end
if n < tonumber(ARGV[3]) then return {'voted', n} end
""" + _DECLARE_DEAD

HEARTBEAT_LUA = _HEARTBEAT
"""The heartbeat script, for the heartbeat thread's own synchronous connection."""


class RedisMembershipTable:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._set_status = redis.register_script(_SET_STATUS)
        self._join = redis.register_script(_JOIN)
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._vote = redis.register_script(_VOTE_DEAD)
        self._vote_unreachable = redis.register_script(_VOTE_UNREACHABLE)

    @property
    def _status_keys(self) -> list[str]:
        k = self._keys
        return [k.members, k.members_version, k.members_channel]

    async def new_generation(self) -> int:
        with redis_errors("membership generation"):
            return int(await self._redis.incr(self._keys.generation))

    async def join(self, row: MemberRow) -> int:
        with redis_errors("membership join"):
            return int(await self._join(keys=self._status_keys, args=[row.address, row.model_dump_json()]))

    async def set_status(self, address: str, status: SiloStatus) -> int:
        with redis_errors("membership status"):
            v = int(await self._set_status(keys=self._status_keys, args=[address, status.value]))
        if v == -1:
            raise errors.MembershipError(f"silo {address} is not in the membership table")
        if v == -2:
            raise errors.MembershipError(f"silo {address} was declared dead")
        return v

    async def heartbeat(self, address: str, at: float, load: SiloLoad) -> SiloStatus | None:
        with redis_errors("membership heartbeat"):
            raw = await self._heartbeat(
                keys=[self._keys.members], args=[address, repr(at), load.model_dump_json()]
            )
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return None if text == "Gone" else SiloStatus(text)

    async def read_all(self) -> tuple[int, dict[str, MemberRow]]:
        with redis_errors("membership read"):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.get(self._keys.members_version)
                pipe.hgetall(self._keys.members)
                version, rows = await pipe.execute()
        out: dict[str, MemberRow] = {}
        for addr, raw in rows.items():
            try:
                row = MemberRow.model_validate_json(raw)
            except ValueError:
                log.warning("skipping unreadable membership row %r", addr)
                continue
            out[row.address] = row
        return int(version or 0), out

    async def vote_dead(self, suspect: str, voter: str, seen_heartbeat: float, needed: int) -> VoteOutcome:
        k = self._keys
        with redis_errors("membership vote"):
            raw = await self._vote(
                keys=[k.members, k.suspicions(suspect), k.members_version, k.members_channel],
                args=[suspect, voter, repr(seen_heartbeat), max(1, needed)],
            )
        result = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
        return VoteOutcome(result, int(raw[1]))

    async def vote_unreachable(self, suspect: str, voter: str, needed: int, window_s: float) -> VoteOutcome:
        k = self._keys
        with redis_errors("membership vote"):
            raw = await self._vote_unreachable(
                keys=[k.members, k.unreachable_votes(suspect), k.members_version, k.members_channel],
                args=[suspect, voter, max(1, needed), max(1, int(window_s * 1000))],
            )
        result = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
        return VoteOutcome(result, int(raw[1]))

    async def remove(self, address: str) -> None:
        """Forget a dead row (housekeeping; dead rows are kept a while for the dashboard)."""
        with redis_errors("membership remove"):
            await self._redis.hdel(self._keys.members, address)


class InMemoryMembershipTable:
    """The same table in a dict, for unit tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.rows: dict[str, MemberRow] = {}
        self.version = 0
        self._gen = 0
        self.votes: dict[str, dict[str, float]] = {}
        self.unreachable: dict[str, dict[str, float]] = {}
        self.clock = clock

    async def new_generation(self) -> int:
        self._gen += 1
        return self._gen

    async def join(self, row: MemberRow) -> int:
        self.rows[row.address] = row
        self.version += 1
        return self.version

    async def set_status(self, address: str, status: SiloStatus) -> int:
        row = self.rows.get(address)
        if row is None:
            raise errors.MembershipError(f"silo {address} is not in the membership table")
        if row.status is SiloStatus.DEAD:
            raise errors.MembershipError(f"silo {address} was declared dead")
        self.rows[address] = row.model_copy(update={"status": status})
        self.version += 1
        return self.version

    async def heartbeat(self, address: str, at: float, load: SiloLoad) -> SiloStatus | None:
        row = self.rows.get(address)
        if row is None:
            return None
        if row.status is not SiloStatus.DEAD:
            self.rows[address] = row.model_copy(update={"heartbeat": at, "load": load})
        return row.status

    async def read_all(self) -> tuple[int, dict[str, MemberRow]]:
        return self.version, dict(self.rows)

    async def vote_dead(self, suspect: str, voter: str, seen_heartbeat: float, needed: int) -> VoteOutcome:
        row = self.rows.get(suspect)
        if row is None:
            return VoteOutcome("gone", 0)
        if row.status is SiloStatus.DEAD:
            return VoteOutcome("dead", 0)
        votes = self.votes.setdefault(suspect, {})
        if abs(row.heartbeat - seen_heartbeat) > 1e-4:
            votes.clear()
            return VoteOutcome("alive", 0)
        votes[voter] = seen_heartbeat
        n = sum(1 for v in votes.values() if abs(v - row.heartbeat) <= 1e-4)
        return self._count(suspect, votes, n, needed)

    async def vote_unreachable(self, suspect: str, voter: str, needed: int, window_s: float) -> VoteOutcome:
        row = self.rows.get(suspect)
        if row is None:
            return VoteOutcome("gone", 0)
        if row.status is SiloStatus.DEAD:
            return VoteOutcome("dead", 0)

        def live(addr: str) -> bool:
            r = self.rows.get(addr)
            return r is not None and r.status is not SiloStatus.DEAD

        if not live(voter):
            return VoteOutcome("refused", 0)
        now = self.clock()
        votes = self.unreachable.setdefault(suspect, {})
        votes[voter] = now
        n = sum(1 for v, at in votes.items() if now - at <= window_s and live(v))
        return self._count(suspect, votes, n, needed)

    def _count(self, suspect: str, votes: dict[str, float], n: int, needed: int) -> VoteOutcome:
        """``n`` valid votes against ``suspect``: declare it dead once they are enough (as the
        Lua scripts' shared ending does)."""
        if n < max(1, needed):
            return VoteOutcome("voted", n)
        self.rows[suspect] = self.rows[suspect].model_copy(update={"status": SiloStatus.DEAD})
        votes.clear()
        self.version += 1
        return VoteOutcome("declared", n)


@dataclass(frozen=True, slots=True)
class MembershipStatistics:
    version: int
    """Membership version this view last read."""
    active: int
    """Silos Active in the view."""
    dead: int
    """Silos Dead in the view."""
    refreshes: int
    """Times the table was re-read."""
    members: dict[str, str] = field(default_factory=dict)
    """Address -> status, as seen here."""


class MembershipView:
    """A silo's or client's picture of the table, kept fresh by pub/sub and polling."""

    def __init__(
        self,
        table: MembershipTable,
        *,
        redis: aioredis.Redis | None = None,
        keys: Keys | None = None,
        refresh_s: float = 2.0,
    ) -> None:
        self._table = table
        self._redis = redis
        self._keys = keys
        self._refresh_s = refresh_s
        self.version = -1
        self.rows: dict[str, MemberRow] = {}
        self._silos: dict[SiloAddress, MemberRow] = {}
        self._listeners: list[Callable[[dict[str, MemberRow], dict[str, MemberRow]], Any]] = []
        self._unreachable_listeners: list[Callable[[SiloAddress], Any]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._refreshes = 0
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()
        self._stopping = False

    def hint_unreachable(self, silo: SiloAddress) -> None:
        """A caller could not reach ``silo``: tell the failure detector (fast path)."""
        if self.is_dead(silo):
            return
        for fn in self._unreachable_listeners:
            try:
                fn(silo)
            except Exception:
                log.exception("unreachable listener failed")

    def on_unreachable(self, fn: Callable[[SiloAddress], Any]) -> None:
        self._unreachable_listeners.append(fn)

    def on_change(self, fn: Callable[[dict[str, MemberRow], dict[str, MemberRow]], Any]) -> None:
        """``fn(old_rows, new_rows)`` after every refresh that changed a status."""
        self._listeners.append(fn)

    async def start(self) -> None:
        await self.refresh()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._poll_forever()))
        if self._redis is not None and self._keys is not None:
            self._tasks.append(loop.create_task(self._listen_forever()))

    async def stop(self) -> None:
        # A flag as well as cancel(): redis-py 8 can swallow a cancellation that
        # lands inside a command, and then a `while True` loop never ends.
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def refresh(self) -> None:
        async with self._lock:
            version, rows = await self._table.read_all()
            self._refreshes += 1
            old = self.rows
            changed = version != self.version or {a: r.status for a, r in rows.items()} != {
                a: r.status for a, r in old.items()
            }
            self.version = version
            self.rows = rows
            self._silos = {r.silo: r for r in rows.values()}
        if changed:
            for fn in self._listeners:
                try:
                    res = fn(old, rows)
                    if asyncio.iscoroutine(res):
                        await res
                except Exception:
                    log.exception("membership listener failed")

    async def _poll_forever(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except errors.StorageError as exc:
                log.warning("membership refresh failed: %s", exc)

    async def _listen_forever(self) -> None:
        assert self._redis is not None and self._keys is not None
        while not self._stopping:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._keys.members_channel)
                while not self._stopping:
                    # Poll without blocking in redis-py: cancelling a blocked
                    # read there can hang a stopping silo.
                    msg = await pubsub.get_message(timeout=0)
                    if msg is not None:
                        await self.refresh()
                    else:
                        await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever broke it, subscribe again
                log.debug("membership subscription dropped: %s", exc)
                await asyncio.sleep(self._refresh_s)
            finally:
                # Closing must not hold up a stopping silo.
                close = asyncio.ensure_future(pubsub.aclose())
                close.add_done_callback(lambda f: f.cancelled() or f.exception())

    # --- queries -----------------------------------------------------------
    def row(self, silo: SiloAddress) -> MemberRow | None:
        return self._silos.get(silo)

    def is_active(self, silo: SiloAddress) -> bool:
        row = self._silos.get(silo)
        return row is not None and row.status is SiloStatus.ACTIVE

    def is_dead(self, silo: SiloAddress) -> bool:
        row = self._silos.get(silo)
        return row is None or row.status is SiloStatus.DEAD

    def active(self) -> list[MemberRow]:
        return sorted(
            (r for r in self.rows.values() if r.status is SiloStatus.ACTIVE), key=lambda r: r.address
        )

    def hosting(self, type_name: str, role: str | None = None) -> list[MemberRow]:
        """Active silos that host a grain type (and have a role, when asked)."""
        return [
            r
            for r in self.active()
            if type_name in r.grain_types and (role is None or role in r.roles)
        ]

    def statistics(self) -> MembershipStatistics:
        statuses = [r.status for r in self.rows.values()]
        return MembershipStatistics(
            version=self.version,
            active=statuses.count(SiloStatus.ACTIVE),
            dead=statuses.count(SiloStatus.DEAD),
            refreshes=self._refreshes,
            members={a: r.status.value for a, r in self.rows.items()},
        )


EventListener = Callable[[str, dict[str, Any]], Any]

EVENT_KINDS = ("join", "suspect", "dead", "rebalance", "failover", "drain")


class ClusterEvents:
    """Cluster events of one silo: a log line each, and listeners (the dashboard's hook).

    ``add_listener(fn)`` gets ``fn(kind, data)`` for every event; kinds are
    join, suspect, dead, rebalance, failover and drain. A failing listener is
    logged and never breaks the component that emitted the event.
    """

    def __init__(self) -> None:
        self._listeners: list[EventListener] = []
        self.counts: dict[str, int] = {}

    def add_listener(self, fn: EventListener) -> None:
        self._listeners.append(fn)

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        log.info("cluster event %s %s", kind, " ".join(f"{k}={v}" for k, v in data.items()))
        for fn in self._listeners:
            try:
                fn(kind, data)
            except Exception:
                log.exception("cluster event listener failed")
