"""Durable reminders: a grain asks to be called every ``period_s``, whatever happens to silos.

Reminders live in Redis (``silo/keys.py``): a sorted set of reminder ids
scored by their next due time (ms, Redis server clock) and a hash of rows.
Every silo polls: one Lua script claims the due reminders (up to a batch),
and says when the next score falls due; the silo sleeps until then (at least
``poll_interval_s``, at most ``idle_poll_s``), woken sooner by a reminder
registered through it, a tick it acknowledged or a membership change (the
silo that fired what this one sleeps past may be gone; issue 39: an idle
silo polled every second, 3 of its 41 commands/s). Each claim is under a lease: its score moves to the end of the lease (claim time +
``delivery_timeout_s`` + ``LEASE_SLACK_S``), so no other silo takes it
meanwhile. The silo sends it through its router like any call (an internal
turn, ``silo/catalog/internal.py``), so it reaches the grain wherever it lives,
activates it if needed, and is retried as any call is until
``delivery_timeout_s`` (a silo not serving, a mailbox shedding load); the
grain's ``receive_reminder(name)`` runs as a turn. When the delivery ends (done or
failed: a failed tick is not retried, the next one comes), an *ack* script
moves the reminder to its next due time, one period after the tick's (ticks
missed while no silo ran are skipped), but only if the score is still this
claim's lease: a re-registration or a later claim wins. A silo that dies
between claim and ack never acks, so the lease runs out and another silo
claims the same tick again: a tick is delivered at least once (twice when the
first delivery ran but its ack was lost).

Each delivered tick records when it ran (Redis clock) and on which silo the
grain's turn ran, in a third hash (``keys.reminder_fired``): one script call
per tick, written only while the reminder is registered, so an unregister
racing a tick leaves nothing behind. The dashboard's Reminders page reads
the three keys; nothing else does.

Timers are the in-memory, per-activation kind (``Grain.register_timer``).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from grains.call import Call
from grains.ids import GrainId
from grains.ref import Caller
from silo import errors
from silo.catalog.internal import REMINDER_METHOD
from silo.cluster.failure_detector import wait_event
from silo.keys import Keys
from silo.redis_util import redis_errors
from silo.settings import RemindersSettings
from silo.shutdown import raise_if_cancelled

log = logging.getLogger("redgrain.reminders")

_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: due zset, rows.  ARGV: id, row, due in ms from now
_REGISTER = (
    _NOW
    + """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], now_ms() + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)

# KEYS: rows, fired.  ARGV: id, silo.  Only a registered reminder records its tick.
_FIRED = (
    _NOW
    + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode({at = now_ms() / 1000, silo = ARGV[2]}))
return 1
"""
)

# KEYS: due zset, rows.  ARGV: batch, lease ms.  Leases what is due: {next in ms, then row, due, lease each}.
_CLAIM = (
    _NOW
    + """
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))
local lease = now + tonumber(ARGV[2])
local out = {}
for i = 1, #due, 2 do
  local id = due[i]
  local row = redis.call('HGET', KEYS[2], id)
  if row then
    redis.call('ZADD', KEYS[1], lease, id)
    table.insert(out, row)
    table.insert(out, due[i + 1])
    table.insert(out, tostring(lease))
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
-- First: ms until the next score (a due tick or a lease's end), -1 if none: the poller sleeps that long.
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
table.insert(out, 1, first[2] and tostring(tonumber(first[2]) - now) or '-1')
return out
"""
)

# KEYS: due zset, rows.  ARGV: id, lease, due.  The tick of this claim ended: schedule the next,
# unless the reminder was unregistered, registered again or claimed again since (score moved).
_ACK = (
    _NOW
    + """
local row = redis.call('HGET', KEYS[2], ARGV[1])
if not row then return 0 end
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
local now = now_ms()
local period = tonumber(cjson.decode(row)['period_ms'])
local nxt = tonumber(ARGV[3]) + period
if nxt <= now then nxt = now + period end  -- fell behind (no silo for a while): skip missed ticks
redis.call('ZADD', KEYS[1], nxt, ARGV[1])
return 1
"""
)

LEASE_SLACK_S = 2.0
"""A claim's lease outlasts its delivery's deadline by this much before another silo may retake it."""


@dataclass(frozen=True, slots=True)
class Reminder:
    grain: GrainId
    name: str
    period_s: float


@dataclass(frozen=True, slots=True)
class Claim:
    """A due tick this silo leased: deliver it, then :meth:`ReminderTable.ack` it."""

    reminder: Reminder
    due_ms: int
    """When the tick was due (Redis clock, ms): the next one is a period after it."""
    lease_ms: int
    """The end of this claim's lease (its score meanwhile); the ack checks it is still ours."""


@dataclass(frozen=True, slots=True)
class ReminderStatistics:
    registered: int
    """Reminders registered through this silo."""
    claimed: int
    """Due ticks this silo claimed."""
    delivered: int
    """Ticks whose receive_reminder ran to completion."""
    failed: int
    """Ticks whose delivery or receive_reminder failed (the next tick comes anyway)."""
    polls_failed: int
    """Polls that could not reach Redis."""
    polls: int = 0
    """Claims this silo ran (one script call each): when a tick falls due, or woken, not by the second."""


def _id(grain: GrainId, name: str) -> str:
    return json.dumps([grain.type_name, grain.key, name], separators=(",", ":"))


class ReminderTable:
    """Reminder rows in Redis: register, unregister, list, claim."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._register = redis.register_script(_REGISTER)
        self._claim = redis.register_script(_CLAIM)
        self._ack = redis.register_script(_ACK)
        self._fired = redis.register_script(_FIRED)

    async def register(
        self, grain: GrainId, name: str, period_s: float, due_s: float | None = None
    ) -> None:
        if not period_s > 0:
            raise errors.ConfigError(f"a reminder period must be > 0 s, got {period_s}")
        if due_s is not None and due_s < 0:
            raise errors.ConfigError(f"a reminder's due_s must be >= 0, got {due_s}")
        period_ms = max(1, round(period_s * 1000))
        row = json.dumps(
            {"type": grain.type_name, "key": grain.key, "name": name, "period_ms": period_ms}
        )
        due_ms = period_ms if due_s is None else round(due_s * 1000)
        k = self._keys
        with redis_errors(f"register reminder {name!r} of {grain}"):
            await self._register(
                keys=[k.reminders, k.reminder_rows], args=[_id(grain, name), row, due_ms]
            )

    async def unregister(self, grain: GrainId, name: str) -> bool:
        rid = _id(grain, name)
        with redis_errors(f"unregister reminder {name!r} of {grain}"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.zrem(self._keys.reminders, rid)
            pipe.hdel(self._keys.reminder_rows, rid)
            pipe.hdel(self._keys.reminder_fired, rid)
            removed = await pipe.execute()
        return bool(removed[1])

    async def list(self, grain: GrainId | None = None) -> list[Reminder]:
        """Every reminder of the cluster, or of one grain."""
        with redis_errors("list reminders"):
            rows = await self._redis.hvals(self._keys.reminder_rows)
        found = [_row(r) for r in rows]
        return sorted(
            (r for r in found if grain is None or r.grain == grain),
            key=lambda r: (str(r.grain), r.name),
        )

    async def claim(self, batch: int, lease_s: float) -> builtins.list[Claim]:
        """Lease the due ticks for ``lease_s``; each must be :meth:`ack`-ed, or it is claimed again."""
        return (await self.claim_due(batch, lease_s))[0]

    async def claim_due(self, batch: int, lease_s: float) -> tuple[builtins.list[Claim], float | None]:
        """:meth:`claim`, and the seconds until the next score falls due after it (None: no reminders)."""
        k = self._keys
        with redis_errors("claim due reminders"):
            raw = await self._claim(keys=[k.reminders, k.reminder_rows], args=[batch, max(1, round(lease_s * 1000))])
        next_ms = float(raw[0])
        claims = [
            Claim(_row(raw[i]), int(float(raw[i + 1])), int(float(raw[i + 2]))) for i in range(1, len(raw), 3)
        ]
        return claims, None if next_ms < 0 else next_ms / 1000.0

    async def ack(self, claim: Claim) -> bool:
        """The claimed tick ended: schedule the next one (False: no longer ours to schedule)."""
        k = self._keys
        r = claim.reminder
        with redis_errors(f"acknowledge tick of reminder {r.name!r}"):
            done = await self._ack(
                keys=[k.reminders, k.reminder_rows], args=[_id(r.grain, r.name), claim.lease_ms, claim.due_ms]
            )
        return bool(done)

    async def fired(self, reminder: Reminder, silo: str) -> None:
        """Record that a tick of ``reminder`` ran now on ``silo`` (for the dashboard)."""
        k = self._keys
        with redis_errors(f"record tick of reminder {reminder.name!r}"):
            await self._fired(
                keys=[k.reminder_rows, k.reminder_fired],
                args=[_id(reminder.grain, reminder.name), silo],
            )


def _row(raw: bytes | str) -> Reminder:
    m = json.loads(raw)
    return Reminder(GrainId(m["type"], m["key"]), m["name"], m["period_ms"] / 1000.0)


Deliver = Callable[[GrainId, str], Awaitable[str | None]]
"""Runs one tick; returns the address of the silo the grain's turn ran on, when known."""


class ReminderService:
    """One silo's share of reminders: registration for its grains and the poll-and-fire loop."""

    def __init__(self, table: ReminderTable, settings: RemindersSettings) -> None:
        self.table = table
        self._settings = settings
        self._deliver: Deliver | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._closed = False
        self._wake = asyncio.Event()
        self._next_s: float | None = None
        """Seconds from the last poll until the next score falls due (None: no reminders)."""
        self._registered = self._claimed = self._delivered = self._failed = self._polls_failed = 0
        self._polls = 0

    async def register(
        self, grain: GrainId, name: str, period_s: float, due_s: float | None = None
    ) -> None:
        await self.table.register(grain, name, period_s, due_s)
        self._registered += 1
        self._wake.set()  # it may fall due before the poller's next look

    async def unregister(self, grain: GrainId, name: str) -> bool:
        return await self.table.unregister(grain, name)

    def wake(self) -> None:
        """Claim now (within ``poll_interval_s``), not at the next due time last seen: membership
        changed, and the silo that was firing the reminders we sleep past may be gone."""
        self._wake.set()

    async def list(self, grain: GrainId | None = None) -> builtins.list[Reminder]:
        return await self.table.list(grain)

    def start(self, deliver: Deliver) -> None:
        """Claim and fire due ticks through ``deliver`` until stopped.

        The delivery is given here, not to the constructor: it needs the
        silo's dispatcher, which is built from the catalog, which is built
        from the runtime that hands grains this service to register with.
        Registering works from construction on; firing from here on.
        """
        self._deliver = deliver
        self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        # A flag as well as cancel(): redis-py may turn a cancel that lands mid-command
        # into a ConnectionError, which the loop would otherwise survive.
        self._closed = True
        tasks = [t for t in (self._task, *self._inflight) if t is not None]
        self._task = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _poll_forever(self) -> None:
        while not self._closed:
            try:
                await self.poll()
            except errors.StorageError as exc:
                if self._closed:
                    return
                self._polls_failed += 1
                log.warning("reminder poll failed: %s", exc)
            raise_if_cancelled()  # a cancel redis-py swallowed (silo/shutdown.py)
            s = self._settings
            wait = s.idle_poll_s if self._next_s is None else min(self._next_s, s.idle_poll_s)
            await asyncio.sleep(s.poll_interval_s)  # the floor: a wake-up polls no sooner than this
            if not self._wake.is_set() and wait > s.poll_interval_s:
                await wait_event(self._wake, wait - s.poll_interval_s)
            self._wake.clear()

    async def poll(self) -> int:
        """Claim what is due and start delivering it; returns how many ticks were claimed."""
        deliver = self._deliver
        room = self._settings.batch - len(self._inflight)
        if deliver is None or room <= 0:
            return 0  # not started, or deliveries are backed up: leave the rest to other silos
        self._polls += 1
        due, self._next_s = await self.table.claim_due(room, self._settings.delivery_timeout_s + LEASE_SLACK_S)
        self._claimed += len(due)
        loop = asyncio.get_running_loop()
        for c in due:
            task = loop.create_task(self._fire(deliver, c))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        return len(due)

    async def _fire(self, deliver: Deliver, claim: Claim) -> None:
        r = claim.reminder
        try:
            where = await deliver(r.grain, r.name)
        except asyncio.CancelledError:
            raise  # stopping: no ack, so the lease runs out and another silo delivers it
        except Exception as exc:  # noqa: BLE001 - one failed tick must not stop the others
            self._failed += 1
            log.warning("reminder %r of %s failed: %r", r.name, r.grain, exc)
            await self._ack(claim)
            return
        self._delivered += 1
        await self._ack(claim)
        if where is not None:
            try:
                await self.table.fired(r, where)
            except errors.StorageError as exc:  # the tick ran; only the dashboard's note of it is lost
                log.debug("last tick of reminder %r not recorded: %s", r.name, exc)

    async def _ack(self, claim: Claim) -> None:
        try:
            await self.table.ack(claim)
        except errors.StorageError as exc:  # the lease runs out and the tick comes again
            log.warning("tick of reminder %r not acknowledged: %s", claim.reminder.name, exc)
        self._wake.set()  # its next tick may fall due before the lease the poller is waiting for

    def statistics(self) -> ReminderStatistics:
        return ReminderStatistics(
            registered=self._registered,
            claimed=self._claimed,
            delivered=self._delivered,
            failed=self._failed,
            polls_failed=self._polls_failed,
            polls=self._polls,
        )


def ticks_through(caller: Caller, timeout_s: float) -> Deliver:
    """Deliver each tick as a call of the internal ``__reminder__`` turn through ``caller`` (the
    silo's router: the path, retries and errors of every call), within ``timeout_s``."""

    async def deliver(grain: GrainId, name: str) -> str | None:
        where = await caller.invoke(Call(grain, REMINDER_METHOD, (name,), None, timeout_s))
        return where if isinstance(where, str) else None  # the silo the turn ran on

    return deliver
