"""Delivery to ``@subscribes`` grains: at least once, in order per stream key, on any silo.

Each silo hosting a grain type marked ``@subscribes(namespace)`` runs one
:class:`StreamAgent` per (namespace, type). The type's name is the consumer
group on every stream of the namespace (so two types subscribed to one
namespace each get every item); the silo's address is its consumer name.

**Which silo delivers which key.** Per-key order needs one reader per key at
a time; a consumer group alone would hand consecutive entries of one stream to
different silos. So each key is held by one silo under a lease
(``keys.stream_lease``, a string with a TTL, renewed every third of
``lease_s``). A silo goes for the keys that rendezvous hashing over the active
silos hosting the type gives it (balanced, and stable as silos come and go),
found in the namespace's key set (``keys.stream_keys``, re-read every
``discover_interval_s``). A key that rendezvous moves away from us is
released once its delivery in progress ends, and only then can its new owner
take it. A lease whose holder the membership table declares Dead is taken at
once; a holder that merely stops renewing loses it after ``lease_s``.

**Taking a key over** (at start, after a move, after a death): ``XAUTOCLAIM``
moves every entry pending in the group, whoever read it, to us (idle time 0:
the lease is the exclusion, and its expiry the idle time), the consumers of
dead silos are deleted from the group, then our pending
list is delivered in entry order before anything new. Entries pending in the
group are older than any never read (``XREADGROUP >`` hands them out in
order), so the grain sees its items in order, resuming after the last one
acknowledged: a turn that ran but whose ``XACK`` was lost runs again.

**Delivering.** One task per held key: read (``XREADGROUP >``, a batch, no
block, in the ``_READ_NEW`` script) while there is a backlog, else go idle;
one shared blocking read per agent (``XREAD``, a wake-up only) waits on every
idle key at once (so a silo holding thousands of quiet keys uses one Redis
connection for them).

**Gaps.** Retention (``maxlen``, ``max_age_s``) may trim items the group has
not read yet; ``XREADGROUP >`` would silently start after them. So every read
first compares what the stream ever had (``entries-added``) less what it keeps
with what the group has read (``entries-read``, which the group is created
with at 0): when the stream's first entry lies beyond the group's position,
the difference is lost. It is counted (``trimmed``, ``gaps``), logged, and
told to the grain as a turn before the next item, ``on_stream_gap(StreamGap)``
with the tokens either side and the count; the group's counter is then set
past the gap, so it is told once. Each item is a call of the internal
``__stream__`` method (``silo/catalog/internal.py``), sent by the silo's router
like any call (activating the grain where placement puts it, retried by the
router's one policy until ``delivery_timeout_s``: a silo not serving, a
mailbox shedding load), then ``XACK``-ed. An attempt that fails (the grain
raised, the attempt outlasted its deadline and its turn was cancelled, no silo
could run it) is made again, with backoff, up to ``max_attempts`` in all; then
the item goes to the namespace's dead-letter stream (``keys.stream_dead_letters``:
the item's blob, its key, token, the error and traceback) and is acknowledged,
so one item holds its key up for at most ``max_attempts`` deadlines and the
backoff between them, and is never dropped unseen. An item this silo cannot
decode goes there at once. The dead letter is written before the ``XACK``: a
silo dying between the two leaves the item pending, so it comes again (a
second dead letter at worst, never none). Attempts are counted by the holder:
a key that moves to another silo starts its count again.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from grains import request_context
from grains.call import Call
from grains.ids import GrainId
from grains.ref import Caller
from silo import errors
from silo.catalog.internal import STREAM_GAP_METHOD, STREAM_METHOD
from silo.codec import Codec
from silo.keys import Keys
from silo.redis_util import redis_errors
from silo.settings import StreamSettings
from silo.shutdown import raise_if_cancelled
from silo.streams.stream import CONTEXT_FIELD, ITEM_FIELD

log = logging.getLogger("redgrain.streams")

RETRIED = (
    errors.SiloError,
    errors.GrainTimeoutError,
    errors.GrainDeactivatedError,
    errors.OverloadedError,
    errors.StorageError,
)
"""Failures of the runtime, not of the grain: on a key being handed over they leave the item
unacknowledged, for the next holder (not counted against its attempts here)."""

# KEYS: leases.  ARGV: holder, ttl ms.  1 per lease still ours (TTL renewed), 0 per lost one.
_RENEW = """
local out = {}
for i, k in ipairs(KEYS) do
  if redis.call('GET', k) == ARGV[1] then
    redis.call('PEXPIRE', k, ARGV[2])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# KEYS: stream.  ARGV: group, consumer, count.  Returns {lost, last, entries}: XREADGROUP '>'
# for the group, after measuring what trimming took from under it. Entries the stream ever had,
# less those it keeps, were trimmed ("removed"); the group's entries-read counts those it read.
# When the stream's first entry lies beyond the group's last-delivered id (or it is empty),
# every trimmed entry the group did not read is lost: removed - entries-read (-1: Redis lost
# count, after XDEL or in an old group). The group's counter is then set past the gap, so it
# is counted once. Atomic, so a publish or trim cannot fall between measuring and reading.
_READ_NEW = """
local function map(flat)
  local t = {}
  for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
  return t
end
local function beyond(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end
local s = map(redis.call('XINFO', 'STREAM', KEYS[1]))
local g = nil
for _, row in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local r = map(row)
  if r['name'] == ARGV[1] then g = r end
end
if not g then
  return redis.error_reply('NOGROUP no consumer group ' .. ARGV[1] .. ' on ' .. KEYS[1])
end
local last = g['last-delivered-id']
local removed = s['entries-added'] - s['length']
local lost = 0
if removed > 0 and (s['length'] == 0 or beyond(s['recorded-first-entry-id'], last)) then
  local read = g['entries-read']
  if not read and last == '0-0' then read = 0 end
  if read then lost = math.max(removed - read, 0) else lost = -1 end
  if lost ~= 0 then
    redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], last, 'ENTRIESREAD', removed)
  end
end
local entries = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
return {lost, last, entries}
"""

# KEYS: lease.  ARGV: holder.  Deletes the lease only if it is the holder's.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class StreamAgentStatistics:
    namespace: str
    group: str
    """The subscribing grain type (the consumer group's name)."""
    keys_held: int
    """Stream keys this silo delivers now (holds the lease of)."""
    delivered: int
    """Items whose on_stream_item returned (acknowledged)."""
    failed: int
    """Items acknowledged without a successful turn: every attempt failed, or the item was undecodable."""
    dead_lettered: int
    """Entries written to the namespace's dead-letter stream (``keys.stream_dead_letters``)."""
    retries: int
    """Attempts made again after a failed one (the grain raised, a timeout, no silo could run it)."""
    claimed: int
    """Pending entries taken over from the group (another silo's, or our own earlier read)."""
    trimmed: int
    """Items trimmed before delivery: those lost in gaps (never read) and those read but gone
    before their turn (pending when the key was taken over)."""
    gaps: int
    """Gap notices (``on_stream_gap``): times trimming overtook the subscriber of a key."""


class _Key:
    """One held stream key: its delivery task and what was read ahead."""

    __slots__ = ("fed", "grain", "idle", "key", "last", "lost", "queue", "redis_key", "stopping", "task", "valid_until")

    def __init__(self, key: str, redis_key: str, grain: GrainId, valid_until: float) -> None:
        self.key, self.redis_key, self.grain = key, redis_key, grain
        self.valid_until = valid_until
        """Loop time until which the lease is surely ours: ``lease_s`` after the last take or
        renewal Redis confirmed, counted from when it was sent (Redis' TTL starts later)."""
        self.queue: collections.deque[tuple[bytes, dict[bytes, bytes] | None]] = collections.deque()
        self.idle = False
        """Caught up: the agent's shared blocking read waits on this key."""
        self.fed = asyncio.Event()
        self.stopping = False
        self.lost = False
        """The lease was lost (not released by us): touch nothing of this key any more."""
        self.task: asyncio.Task[None] | None = None
        self.last: bytes | str = "0-0"
        """The group's last-delivered id as of our last read: where the shared wait watches from."""


def _owner(candidates: list[str], namespace: str, key: str) -> str | None:
    """Rendezvous hashing: the candidate with the highest hash of (candidate, stream)."""
    best, best_score = None, b""
    for c in candidates:
        score = hashlib.blake2b(f"{c}\x00{namespace}\x00{key}".encode(), digest_size=8).digest()
        if best is None or score > best_score:
            best, best_score = c, score
    return best


def _describe(exc: Exception) -> tuple[str, str]:
    """One line naming the failure (the grain's own exception type, not the wrapper's), and the
    remote traceback when there is one."""
    if isinstance(exc, errors.RemoteGrainError):
        return f"{exc.type_name}: {exc.message}", exc.traceback_text
    return f"{type(exc).__name__}: {exc}", ""


def _fields(flat: list[bytes] | dict[bytes, bytes] | None) -> dict[bytes, bytes] | None:
    """An entry's fields as a dict (a script returns them flat)."""
    if flat is None or isinstance(flat, dict):
        return flat
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class StreamAgent:
    """Delivers one namespace's streams to one ``@subscribes`` grain type, for one silo."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: Keys,
        namespace: str,
        group: str,
        me: str,
        candidates: Callable[[], Iterable[str]],
        is_dead: Callable[[str], bool],
        caller: Caller,
        codec: Codec,
        settings: StreamSettings,
    ) -> None:
        self._redis, self._keys, self._codec, self._settings = redis, keys, codec, settings
        self.namespace, self.group, self.me = namespace, group, me
        self._candidates = candidates
        self._is_dead = is_dead
        self._caller = caller
        """Sends each item as a call (the silo's router: the path every call takes)."""
        self._held: dict[str, _Key] = {}
        self._owners: dict[str, str | None] = {}
        self._owners_for: tuple[str, ...] = ()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._renew_script = redis.register_script(_RENEW)
        self._release_script = redis.register_script(_RELEASE)
        self._read_script = redis.register_script(_READ_NEW)
        self._delivered = self._failed = self._retries = self._claimed = self._trimmed = 0
        self._dead_lettered = self._gaps = 0

    # --- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._maintain_forever(), name=f"streams {self.namespace}/{self.group}: leases"),
            loop.create_task(self._read_idle_forever(), name=f"streams {self.namespace}/{self.group}: reader"),
        ]

    async def stop(self, *, release: bool = True) -> None:
        """Stop delivering; a delivery in progress is cancelled unacknowledged (it comes again).

        ``release``: hand our leases back at once, so another silo takes the keys now
        (False for a silo declared dead: it touches nothing in Redis).
        """
        self._closed = True
        pumps = [k.task for k in self._held.values() if k.task is not None]
        for t in (*self._tasks, *pumps):
            t.cancel()
        await asyncio.gather(*self._tasks, *pumps, return_exceptions=True)
        held, self._held = list(self._held.values()), {}
        if release:
            for k in held:
                if not k.lost:
                    await self._release(k)

    # --- leases and ownership --------------------------------------------------------
    async def _maintain_forever(self) -> None:
        s = self._settings
        period = min(s.discover_interval_s, s.lease_s / 3)
        loop = asyncio.get_running_loop()
        renew_at = 0.0
        while not self._closed:
            try:
                if loop.time() >= renew_at:
                    renew_at = loop.time() + s.lease_s / 3
                    await self._renew()
                await self.balance()
            except errors.StorageError as exc:
                if self._closed:
                    return
                log.warning("streams %s/%s: %s", self.namespace, self.group, exc)
            except Exception:  # the loop must outlive one bad pass
                log.exception("streams %s/%s: lease pass failed", self.namespace, self.group)
            raise_if_cancelled()
            await asyncio.sleep(period)

    async def balance(self) -> None:
        """Take the keys rendezvous gives us (when free), hand back those it gives another silo."""
        with redis_errors(f"read the keys of stream namespace {self.namespace!r}"):
            found = {_text(k) for k in await self._redis.smembers(self._keys.stream_keys(self.namespace))}
        candidates = tuple(sorted(set(self._candidates())))
        if candidates != self._owners_for:
            self._owners, self._owners_for = {}, candidates
        mine = set()
        for key in found:
            owner = self._owners.get(key, "")
            if owner == "":
                owner = self._owners[key] = _owner(list(candidates), self.namespace, key)
            if owner == self.me:
                mine.add(key)
        for key, k in list(self._held.items()):
            if key not in mine and not k.stopping:
                k.stopping = True  # the pump ends after its delivery in progress, then releases
                k.fed.set()
        loop = asyncio.get_running_loop()
        for key in sorted(mine - self._held.keys()):
            if self._closed:
                return
            sent = loop.time()
            if await self._acquire(key):
                self._take(key, sent + self._settings.lease_s)

    async def _acquire(self, key: str) -> bool:
        lease = self._keys.stream_lease(self.namespace, key, self.group)
        ttl_ms = max(1, round(self._settings.lease_s * 1000))
        with redis_errors(f"take stream {self.namespace}/{key}"):
            if await self._redis.set(lease, self.me, nx=True, px=ttl_ms):
                return True
            holder = await self._redis.get(lease)
            if holder is None or _text(holder) == self.me or not self._is_dead(_text(holder)):
                return False
            # Declared dead: it serves nothing any more, so its lease need not run out first.
            await self._release_script(keys=[lease], args=[holder])
            return bool(await self._redis.set(lease, self.me, nx=True, px=ttl_ms))

    async def _renew(self) -> None:
        held = [k for k in self._held.values() if not k.lost]
        if not held:
            return
        ttl_ms = max(1, round(self._settings.lease_s * 1000))
        leases = [self._keys.stream_lease(self.namespace, k.key, self.group) for k in held]
        sent = asyncio.get_running_loop().time()
        with redis_errors(f"renew stream leases of {self.namespace!r}"):
            kept = await self._renew_script(keys=leases, args=[self.me, ttl_ms])
        for k, ok in zip(held, kept, strict=True):
            if ok:
                k.valid_until = sent + self._settings.lease_s
            else:
                log.warning("streams: lost the lease of %s/%s to another silo", self.namespace, k.key)
                k.lost = k.stopping = True
                k.fed.set()

    async def _release(self, k: _Key) -> None:
        try:
            with redis_errors(f"release stream {self.namespace}/{k.key}"):
                await self._release_script(keys=[self._keys.stream_lease(self.namespace, k.key, self.group)], args=[self.me])
        except errors.StorageError as exc:  # it runs out by itself
            log.warning("streams: %s", exc)

    def _leased(self, k: _Key) -> bool:
        """Whether the lease is surely still ours; if not, the pump stops (and releases, if it still can).

        A holder that could not renew (Redis unreachable from here, a long pause) may have lost
        the key to another silo meanwhile, which reads on from the group: reading or delivering
        past that moment would hand the grain two silos' items interleaved, out of order (found
        by the simulator's ``services`` scenario, a Redis cut outlasting the lease). So an item
        is read and each delivery begins only while the last confirmed renewal stands. A
        delivery already running when the lease ends may still outlast it (up to
        ``delivery_timeout_s``): nothing fences the grain's turn itself.
        """
        if asyncio.get_running_loop().time() < k.valid_until:
            return True
        if not k.stopping:
            log.warning("streams: the lease of %s/%s ran out unrenewed; delivery stops", self.namespace, k.key)
            k.stopping = True
            k.fed.set()
        return False

    def _take(self, key: str, valid_until: float) -> None:
        k = _Key(key, self._keys.stream(self.namespace, key), GrainId(self.group, key), valid_until)
        self._held[key] = k
        k.task = asyncio.get_running_loop().create_task(self._pump(k), name=f"stream {self.namespace}/{key}")

    # --- one key ---------------------------------------------------------------------
    async def _pump(self, k: _Key) -> None:
        try:
            await self._ensure_group(k)
            await self._recover(k)
            while not k.stopping:
                if not self._leased(k):
                    break
                if not k.queue:
                    try:
                        read = await self._read_new(k)
                    except errors.StorageError as exc:
                        if "NOGROUP" not in str(exc):
                            raise
                        # Deleted by a retention sweep (empty, nothing owed) and published to again.
                        await self._ensure_group(k)
                        continue
                    # A stop's cancel that redis-py swallowed mid-read would leave this pump
                    # waiting below for ever, and stop() waiting on it (silo/shutdown.py).
                    raise_if_cancelled()
                    if not read:
                        k.idle = True
                        self._wake.set()
                        await k.fed.wait()
                        k.fed.clear()
                        continue
                    k.queue.extend(read)
                entry_id, fields = k.queue.popleft()
                await self._deliver_entry(k, entry_id, fields)
        except errors.StorageError as exc:
            log.warning("streams: delivery of %s/%s stopped: %s", self.namespace, k.key, exc)
        except Exception:
            log.exception("streams: delivery of %s/%s failed", self.namespace, k.key)
        finally:
            k.idle = False
            if self._held.get(k.key) is k and not self._closed:
                del self._held[k.key]
                if not k.lost:
                    await self._release(k)  # another silo takes it from what we acknowledged

    async def _ensure_group(self, k: _Key) -> None:
        with redis_errors(f"create consumer group {self.group} on stream {self.namespace}/{k.key}"):
            try:
                # From the stream's start: an implicit subscriber gets every item the stream keeps.
                # Having read none of them: items trimmed before the group existed count as
                # lost to it too (delivery may start after a burst has overrun maxlen).
                await self._redis.xgroup_create(k.redis_key, self.group, id="0", mkstream=True, entries_read=0)
            except redis.exceptions.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _recover(self, k: _Key) -> None:
        """Take every entry pending in the group, then deliver ours in order (see the module doc)."""
        start: bytes | str = "0-0"
        with redis_errors(f"claim pending entries of stream {self.namespace}/{k.key}"):
            while True:
                reply = await self._redis.xautoclaim(
                    k.redis_key, self.group, self.me, min_idle_time=0, start_id=start, count=self._settings.batch
                )
                self._claimed += len(reply[1])
                self._trimmed += len(reply[2]) if len(reply) > 2 else 0
                start = reply[0]
                if _text(start) == "0-0":
                    break
            # Consumers of dead silos hold nothing now: drop them, so the group lists the living.
            consumers: Any = await self._redis.xinfo_consumers(k.redis_key, self.group)
            for c in consumers:
                name = _text(c["name"])
                if name != self.me and not c["pending"] and self._is_dead(name):
                    await self._redis.xgroup_delconsumer(k.redis_key, self.group, name)
        last: bytes | str = "0-0"
        while not k.stopping and self._leased(k):
            pending = await self._read(k, last)
            if not pending:
                return
            for entry_id, fields in pending:
                if k.stopping or not self._leased(k):
                    return
                await self._deliver_entry(k, entry_id, fields)
                last = entry_id

    async def _read(self, k: _Key, position: bytes | str) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
        with redis_errors(f"read stream {self.namespace}/{k.key}"):
            reply: Any = await self._redis.xreadgroup(
                self.group, self.me, {k.redis_key: position}, count=self._settings.batch
            )
        return [(e, f) for _, entries in reply or () for e, f in entries]

    async def _read_new(self, k: _Key) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
        """The next batch never read by the group; a gap trimming left before it is told first."""
        with redis_errors(f"read stream {self.namespace}/{k.key}"):
            lost, last, reply = await self._read_script(
                keys=[k.redis_key], args=[self.group, self.me, self._settings.batch]
            )
        entries = [(e, _fields(f)) for _, es in reply or () for e, f in es]
        k.last = entries[-1][0] if entries else last
        if lost:
            await self._deliver_gap(k, _text(last), _text(entries[0][0]) if entries else None, int(lost))
        return entries

    async def _deliver_gap(self, k: _Key, after: str, before: str | None, lost: int) -> None:
        self._gaps += 1
        self._trimmed += max(lost, 0)
        log.warning(
            "streams: %s items of %s/%s after %s were trimmed before %s could have them",
            "some" if lost < 0 else lost, self.namespace, k.key, after, self.group,
        )  # fmt: skip
        args = (self.namespace, after, before, None if lost < 0 else lost)
        call = Call(k.grain, STREAM_GAP_METHOD, args, None, self._settings.delivery_timeout_s)
        what = f"gap after {after}"
        if not await self._attempt(k, call, what, None):
            # The group's counter is past the gap already: the next holder would not see it.
            await self._dead_letter(k, what, None, "the key moved before its gap notice ran", 0)

    async def _deliver_entry(self, k: _Key, entry_id: bytes, fields: dict[bytes, bytes] | None) -> None:
        token = _text(entry_id)
        blob = (fields or {}).get(ITEM_FIELD)
        if blob is None:  # trimmed while pending: nothing left to deliver
            self._trimmed += 1
            await self._ack(k, entry_id)
            return
        try:
            item = self._codec.loads(blob)
        except errors.CodecError as exc:
            self._failed += 1
            log.warning("streams: item %s of %s/%s cannot be decoded here: %s", token, self.namespace, k.key, exc)
            await self._dead_letter(k, token, blob, f"cannot be decoded on {self.me}: {exc}", 0)
            await self._ack(k, entry_id)
            return
        call = Call(k.grain, STREAM_METHOD, (self.namespace, item, token), None, self._settings.delivery_timeout_s)
        entries = None
        if (context := (fields or {}).get(CONTEXT_FIELD)) is not None:
            try:
                entries = request_context.incoming(context.decode() if isinstance(context, bytes) else context)
            except (ValueError, UnicodeDecodeError) as exc:  # written by another version, say: deliver the item
                log.warning("streams: item %s of %s/%s carries a request context that is not one: %s", token, self.namespace, k.key, exc)
        # The publisher's entries for this delivery (the call carries them, as any call would).
        entered = request_context.enter(entries)
        try:
            delivered = await self._attempt(k, call, token, blob)
        finally:
            request_context.leave(entered)
        if delivered:
            await self._ack(k, entry_id)

    async def _attempt(self, k: _Key, call: Call, token: str, blob: bytes | None) -> bool:
        """Run one internal call up to ``max_attempts`` times; after the last failure it goes to
        the dead-letter stream. True: acknowledge it; False: the key is no longer ours (the next
        holder delivers it again)."""
        delay = 0.05
        for attempt in range(1, self._settings.max_attempts + 1):
            try:
                await self._caller.invoke(call)
                self._delivered += call.method == STREAM_METHOD
                return True
            except Exception as exc:  # noqa: BLE001 - the grain's own error counts as a runtime one does
                error, trace = _describe(exc)
                if isinstance(exc, RETRIED) and (k.stopping or self._closed):
                    return False  # not the item's fault: whoever holds the key next delivers it
                if attempt == self._settings.max_attempts:
                    self._failed += 1
                    log.warning(
                        "streams: %s of %s/%s failed %d times, the last: %s; moved to the dead letters",
                        token, self.namespace, k.key, attempt, error,
                    )  # fmt: skip
                    await self._dead_letter(k, token, blob, error, attempt, trace)
                    return True
                if k.stopping or self._closed:
                    return False
                self._retries += 1
                log.info("streams: attempt %d at %s of %s failed (%s), retrying", attempt, token, k.grain, error)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable: max_attempts >= 1")

    async def _dead_letter(
        self, k: _Key, token: str, blob: bytes | None, error: str, attempts: int, trace: str = ""
    ) -> None:
        """Keep what no turn took, before its acknowledgement: a silo dying between the two leaves
        the item pending, delivered again (a dead letter twice at worst, never none)."""
        entry: dict[Any, Any] = {
            "key": k.key, "group": self.group, "token": token, "error": error[:2000],
            "attempts": attempts, "silo": self.me,
        }  # fmt: skip
        if blob is not None:
            entry[ITEM_FIELD] = blob
        if trace:
            entry["traceback"] = trace[-8000:]
        delay = 0.05
        while not k.lost:
            try:
                with redis_errors(f"write a dead letter of stream {self.namespace}/{k.key}"):
                    await self._redis.xadd(
                        self._keys.stream_dead_letters(self.namespace), entry,
                        maxlen=self._settings.dead_letter_maxlen, approximate=True,
                    )  # fmt: skip
                self._dead_lettered += 1
                return
            except errors.StorageError as exc:
                if self._closed:
                    return
                log.warning("streams: %s (retrying)", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _ack(self, k: _Key, entry_id: bytes) -> None:
        # Until it lands (or the key is no longer ours): a later item acknowledged before an
        # earlier one would let a new holder deliver them out of order.
        delay = 0.05
        while not k.lost:
            try:
                with redis_errors(f"acknowledge item of stream {self.namespace}/{k.key}"):
                    await self._redis.xack(k.redis_key, self.group, entry_id)
                return
            except errors.StorageError as exc:
                if self._closed:
                    return
                log.warning("streams: %s (retrying)", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # --- the shared wait on idle keys ------------------------------------------------------
    async def _read_idle_forever(self) -> None:
        s = self._settings
        while not self._closed:
            idle = {k.redis_key: k for k in self._held.values() if k.idle and not k.stopping}
            self._wake.clear()
            if not idle:
                try:
                    await asyncio.wait_for(self._wake.wait(), s.block_ms / 1000)
                except TimeoutError:
                    pass
                continue
            try:
                # A wake-up only: XREAD (no group) from where the group is; the pump reads the
                # items itself, through the script that measures what trimming took first.
                with redis_errors(f"wait on streams of {self.namespace!r}"):
                    reply: Any = await self._redis.xread(
                        {name: k.last for name, k in idle.items()}, count=1, block=s.block_ms
                    )
            except errors.StorageError as exc:
                if self._closed:
                    return
                log.warning("streams: %s", exc)
                await asyncio.sleep(s.block_ms / 1000)
                continue
            raise_if_cancelled()
            for name, entries in reply or ():
                fed = idle.get(_text(name))
                if fed is None or not entries:
                    continue
                fed.idle = False
                fed.fed.set()

    def statistics(self) -> StreamAgentStatistics:
        return StreamAgentStatistics(
            namespace=self.namespace,
            group=self.group,
            keys_held=len(self._held),
            delivered=self._delivered,
            failed=self._failed,
            dead_lettered=self._dead_lettered,
            retries=self._retries,
            claimed=self._claimed,
            trimmed=self._trimmed,
            gaps=self._gaps,
        )
