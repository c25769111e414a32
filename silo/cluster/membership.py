"""The membership table: the contract every table keeps, and its Redis implementation.

Rows are JSON (so Lua scripts can read a status with cjson) in one hash,
keyed by the silo's address ``host:port@generation``. Every status change is
one Lua script that bumps a version counter and publishes it, so peers and
clients re-read the table as soon as anything changes (each through its
:class:`~silo.cluster.view.MembershipView`). A vote against a suspected silo
is one script too: counting the valid votes and declaring the suspect Dead
happen in one step, so no heartbeat or second declaration slips in between.
The in-memory twin with the same rules is
:class:`silo.testing.membership.InMemoryMembershipTable`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

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
