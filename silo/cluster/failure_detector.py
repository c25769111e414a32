"""Failure detection: probes between ring monitors, a slow liveness lease, death by vote.

Two signals, so a busy silo is never mistaken for a dead one, and Redis hears from an idle
silo only to renew a lease (issue 39: an idle silo costs Redis < 2 commands a second):

* :class:`FailureDetector` runs on the event loop. It watches its ``monitors`` successors on a
  ring of the live silos (:class:`Ring`, ordered by a hash of the address; all peers when
  fewer) and pings each over the silos' own connections every ``probe_interval_s``; the PING
  names this silo, so the peer knows its monitor still reaches it. Redis is read when it can
  tell something: while a peer is in doubt, on a membership change, else every
  ``idle_read_s`` (one script: the table's version and which watched heartbeats moved,
  ``MembershipTable.moved``). A probe refused votes at once (the process is gone: the fast
  path); a peer that has answered no probe for ``dead_after_s`` while its heartbeat is as old
  gets a vote (hung, or cut off from us and from Redis); one that answers while its lease ran
  out (heartbeat older than ``lease_s + dead_after_s``) gets a vote (it lost Redis and has
  fenced itself). Only a silo's monitors vote on it; death is declared by one Lua script when
  ``min(2, fresh monitors)`` valid votes are in (``RedisMembershipTable.vote_dead``,
  ``_needed``), and a vote counts only while the suspect's heartbeat is the value the voter saw.
* :class:`HeartbeatThread` renews this silo's lease (its heartbeat, stamped with Redis'
  clock) from a dedicated thread with its own *synchronous* Redis connection: every
  ``lease_s / 2`` while all is well, every ``heartbeat_s`` while it is in doubt (a monitor
  has been silent, :class:`Liveness`). A 30 s torch step holding the event loop does not stop
  it: the loop answers no PING, so the thread beats every second and the monitors, seeing a
  young heartbeat, do not vote. It also fences this silo (:meth:`Liveness.fenced`, asked by
  the dispatcher on every call) before its peers may declare it dead: when the lease runs out,
  or when a monitor has been silent ``dead_after_s / 2`` and no beat as young is
  confirmed (it beats every ``heartbeat_s`` by then); that doubt latches until a beat sent after it is confirmed,
  so a resumed SIGSTOPped silo, whose queued PINGs arrive at once, cannot answer a call
  before learning it is dead.
* The reverse partition: a heartbeat that moves while the peer cannot be reached at all. A
  probe that gets no answer tries a bare TCP handshake; a busy or stopped process still
  completes one (its kernel answers), a host cut off from us does not (``UNREACHABLE``). A
  peer unreachable for twice ``dead_after_s`` without a break gets an *unreachable* vote
  (``RedisMembershipTable.vote_unreachable``), declared with ``min(2, fresh monitors)`` votes
  like the others: so a silo cut from all its peers is voted out (it beats every second, as
  its monitors are silent, hears so on its next beat and stops), while a link cut between two
  silos of three removes neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from grains.ids import SiloAddress
from silo import errors
from silo.cluster.events import ClusterEvents
from silo.cluster.membership import HEARTBEAT_LUA, MembershipTable, VoteOutcome
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloLoad, SiloStatus
from silo.redis_util import connect_redis_sync
from silo.settings import MembershipSettings

log = logging.getLogger("redgrain.failure")

LOAD_REFRESH_S = 30.0
"""The heartbeat thread beats (at most every heartbeat_s) when the silo's load changed (its activation
count, or CPU or memory by LOAD_STEP_PERCENT points) and sends the load then, else with a beat at
least this long after the last one sent (one command in five of an idle silo's beats, issue 39)."""
LOAD_STEP_PERCENT = 10.0


def _load_changed(last: SiloLoad | None, now: SiloLoad) -> bool:
    return (
        last is None
        or last.activations != now.activations
        or abs(last.cpu_percent - now.cpu_percent) >= LOAD_STEP_PERCENT
        or abs(last.memory_percent - now.memory_percent) >= LOAD_STEP_PERCENT
    )


async def wait_event(event: asyncio.Event, timeout_s: float) -> None:
    """Wait for ``event`` or ``timeout_s``, whichever first.

    Not ``asyncio.wait_for``: on Python 3.11 it can swallow a cancellation that
    arrives as the event is set, and a stopping silo would then wait forever.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()


# --- heartbeats ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeartbeatStatistics:
    beats: int
    """Heartbeats Redis accepted."""
    failures: int
    """Heartbeats that failed (Redis down or slow)."""
    last_confirmed_age_s: float
    """Seconds since the send time of the last heartbeat Redis confirmed."""
    fenced: bool
    """True while this silo refuses calls because its liveness is unconfirmed."""
    in_doubt: bool = False
    """True while a monitor has been silent too long (or a beat failed to lift an earlier
    doubt): beating every heartbeat_s until one is confirmed."""


class Liveness:
    """When this silo may serve, and when it must beat: the fencing rule, kept by the heartbeat
    thread (and by the simulator's loop heartbeat, silo/testing/sim).

    The heartbeat is a slow *lease* (issue 39): Redis is written every ``lease_s / 2`` while
    all is well, and every ``heartbeat_s`` while this silo is *in doubt*. Two signals fence it
    (it refuses calls), so it stops serving before its peers may declare it dead:

    * **the lease**: its last beat Redis confirmed (``last_confirmed``, sent by ``_monotonic``)
      is older than ``lease_s``. Peers vote on a silo that answers probes only once its
      heartbeat is older than ``lease_s + dead_after_s``;
    * **its monitors' probes**: each ring monitor pings it every ``probe_interval_s`` (the
      PING names the monitor, :meth:`probed`). A monitor votes on a hung or unreachable silo
      only after its probes went unanswered ``dead_after_s`` *and* the heartbeat is
      ``dead_after_s`` old. Once a monitor has been silent ``silence_s`` (``dead_after_s / 2``),
      this silo is in doubt: it is fenced unless its last confirmed beat is younger than
      ``silence_s`` (it beats every ``heartbeat_s`` by then), and the doubt *latches*: only a beat sent after it began, confirmed
      (not Dead), lifts it, so PINGs that queued up during a SIGSTOP or a long pause, or a
      monitor that has not heard of our death yet, cannot unfence it. From ``silence_s / 2``
      of silence on it beats every ``heartbeat_s``, so a monitor that died or a loop that is
      busy (PINGs unanswered, the thread still running) costs a beat a second, not a fence.

    A silo with no monitors (alone) is fenced by the lease only; no peer can vote on it
    sooner. :meth:`fenced` is on every call's path: one clock read and two comparisons.
    """

    _settings: MembershipSettings
    _monotonic: Callable[[], float]
    last_confirmed: float
    dead: bool
    vouched_until: float
    """Our clock: past it, a monitor has been silent ``silence_s`` (inf: no monitors)."""
    doubt_since: float | None
    """Our clock when the doubt began; None while not in doubt."""
    _heard: dict[str, float]
    _last_attempt: float

    def _init_liveness(self, settings: MembershipSettings, monotonic: Callable[[], float]) -> None:
        self._settings = settings
        self._monotonic = monotonic
        self.last_confirmed = monotonic()
        self.dead = False
        self.vouched_until = float("inf")
        self.doubt_since = None
        self._heard = {}
        self._last_attempt = float("-inf")
        self._silence_s = settings.dead_after_s / 2

    def fenced(self) -> bool:
        """True when peers may already have declared us dead: serve nothing."""
        if self.dead:
            return True
        now = self._monotonic()
        age = now - self.last_confirmed
        silent = now > self.vouched_until
        # No vote on an unanswered probe counts while our heartbeat is younger than dead_after_s;
        # while a monitor is silent we beat every heartbeat_s, so half of it leaves a margin.
        if age <= (self._silence_s if silent else self._settings.dead_after_s):
            return False
        if silent or age > self._settings.lease_s:
            self._doubt(now)
            return True
        return self.doubt_since is not None

    def _doubt(self, now: float) -> None:
        if self.doubt_since is None:
            self.doubt_since = now
            self._wake_beat()

    def _wake_beat(self) -> None:
        """Make the beater look now (it beats at once when in doubt)."""

    def probed(self, monitor: str) -> None:
        """A PING from ``monitor`` reached us (the transport calls this; not from a monitor: ignored)."""
        last = self._heard.get(monitor)
        if last is None:
            return
        now = self._monotonic()
        if now > self.vouched_until:
            self._doubt(now)  # a gap: the PINGs that end it do not undo it
        self._heard[monitor] = now
        if last + self._silence_s <= self.vouched_until:
            self.vouched_until = min(self._heard.values()) + self._silence_s

    def watch_monitors(self, monitors: Iterable[str]) -> None:
        """The silos that probe us now (the failure detector's ring). A new one counts as heard
        from now: it is given ``silence_s`` to reach us."""
        now = self._monotonic()
        if now > self.vouched_until:
            self._doubt(now)
        self._heard = {m: self._heard.get(m, now) for m in monitors}
        self.vouched_until = min(self._heard.values()) + self._silence_s if self._heard else float("inf")
        self._wake_beat()

    def next_beat(self, now: float, load_changed: bool = False) -> float:
        """Seconds until the next beat is due (0: now)."""
        s = self._settings
        retry = max(0.0, self._last_attempt + s.heartbeat_s - now)
        if self.doubt_since is not None:
            return 0.0 if self._last_attempt < self.doubt_since else retry
        early = self.vouched_until - self._silence_s / 2
        if now >= early or load_changed:
            return retry
        renew = max(0.0, self.last_confirmed + s.lease_s / 2 - now)
        if self._last_attempt > self.last_confirmed:  # the last one failed: retry, do not wait out the lease
            renew = min(renew, retry)
        return min(renew, early - now)

    def beat_sent(self, sent: float) -> None:
        self._last_attempt = sent

    def beat_confirmed(self, sent: float) -> None:
        """Redis took the beat sent at ``sent`` (our clock) and we are not Dead."""
        self.last_confirmed = max(self.last_confirmed, sent)
        if self.doubt_since is not None and sent >= self.doubt_since:
            self.doubt_since = None

    async def confirm(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) for a heartbeat Redis accepts; False if none or we are dead.

        An overloaded silo's heartbeat thread may be late; a zombie's never
        comes back (Redis answers Dead). Polled: the thread has no loop to signal.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, timeout_s)
        while self.fenced():
            if self.dead or loop.time() >= end:
                return False
            await asyncio.sleep(0.02)
        return True


class HeartbeatThread(Liveness):
    """Writes this silo's heartbeat (its lease) from its own thread and Redis connection."""

    def __init__(
        self,
        *,
        redis_url: str,
        keys: Keys,
        address: str,
        settings: MembershipSettings,
        load: Callable[[], SiloLoad],
        on_dead: Callable[[], Any],
        loop: asyncio.AbstractEventLoop,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = redis_url
        self._keys = keys
        self._address = address
        self._load = load
        self._on_dead = on_dead
        self._loop = loop
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._init_liveness(settings, monotonic)
        self.beats = 0
        self.failures = 0

    def _wake_beat(self) -> None:
        self._wake.set()

    def start(self) -> None:
        # Built with the other components (the dispatcher asks fenced()), started
        # once the row is Active: liveness counts from here, not from construction.
        self.last_confirmed = self._monotonic()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {self._address}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
            self._thread = None

    def _run(self) -> None:
        timeout = max(1.0, self._settings.dead_after_s)
        client = connect_redis_sync(self._url, timeout_s=timeout)
        script = client.register_script(HEARTBEAT_LUA)
        last_load: tuple[float, SiloLoad] | None = None  # when, and what, the last load Redis took
        # Looked at this often at least: a monitor falling silent is noticed well within silence_s.
        tick = min(self._settings.heartbeat_s, self._silence_s / 4)
        try:
            while not self._stop.is_set():
                now = self._monotonic()
                try:
                    load = self._load()
                except Exception:  # noqa: BLE001 - read across threads: a dict may change size under us
                    load = SiloLoad()
                changed = _load_changed(last_load[1] if last_load else None, load)
                wait = self.next_beat(now, changed)
                if wait > 0:
                    self._wake.wait(min(wait, tick))
                    self._wake.clear()
                    continue
                sent = self._monotonic()
                self.beat_sent(sent)
                fresh = last_load is None or changed or sent - last_load[0] >= LOAD_REFRESH_S
                try:
                    raw = script(
                        keys=[self._keys.members, self._keys.members_heartbeats, self._keys.members_loads],
                        # No time: the script stamps the beat with Redis' clock (detectors read its age).
                        args=[self._address, "", load.model_dump_json() if fresh else ""],
                    )
                except (redis.RedisError, OSError) as exc:
                    self.failures += 1
                    log.warning("heartbeat of %s failed: %s", self._address, exc)
                else:
                    status = raw.decode() if isinstance(raw, bytes) else str(raw)
                    if status in ("Dead", "Gone"):
                        self._declare_dead()
                        return
                    self.beats += 1
                    self.beat_confirmed(sent)
                    if fresh:
                        last_load = (sent, load)
        finally:
            client.close()

    def _declare_dead(self) -> None:
        self.dead = True
        log.error("membership says this silo (%s) is dead: stopping at once", self._address)
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(self._on_dead)

    def statistics(self) -> HeartbeatStatistics:
        return HeartbeatStatistics(
            beats=self.beats,
            failures=self.failures,
            last_confirmed_age_s=self._monotonic() - self.last_confirmed,
            fenced=self.fenced(),
            in_doubt=self.doubt_since is not None,
        )


# --- probes and votes ---------------------------------------------------------


class ProbeResult(str, enum.Enum):
    OK = "ok"
    """The peer's event loop answered a PING."""
    REFUSED = "refused"
    """Connection refused or reset: the process is gone."""
    TIMEOUT = "timeout"
    """No answer in time, though its host completes a TCP handshake: hung, or very busy."""
    UNREACHABLE = "unreachable"
    """Not even a TCP handshake (timed out, no route): the network between us is cut."""


Probe = Callable[[SiloAddress, float], Awaitable[ProbeResult]]


async def handshake(endpoint: str, timeout_s: float) -> ProbeResult:
    """A bare TCP handshake with ``endpoint``: TIMEOUT if it completes (the host is there,
    its process may be busy), REFUSED if the port is closed, UNREACHABLE otherwise."""
    host, _, port = endpoint.rpartition(":")
    loop = asyncio.get_running_loop()
    try:
        transport, _ = await asyncio.wait_for(loop.create_connection(asyncio.Protocol, host, int(port)), timeout_s)
    except (ConnectionRefusedError, ConnectionResetError):
        return ProbeResult.REFUSED
    except (OSError, TimeoutError):
        return ProbeResult.UNREACHABLE
    transport.close()
    return ProbeResult.TIMEOUT


Handshake = Callable[[str, float], Awaitable[ProbeResult]]


def transport_probe(
    transport: Any, handshake: Handshake = handshake, sender: Callable[[], str | None] = lambda: None
) -> Probe:
    """A probe over the silo's transport: connect (pooled) and PING; without an answer, a handshake
    (``handshake``: a real TCP one; a simulation gives its network's). The PING names ``sender()``
    (this silo, None while it is fenced): the peer counts it as its monitor's (:meth:`Liveness.probed`)."""

    async def probe(silo: SiloAddress, timeout_s: float) -> ProbeResult:
        for _ in range(2):  # a pooled connection that just broke gets one fresh try
            try:
                conn = await asyncio.wait_for(asyncio.shield(transport.connect(silo.endpoint)), timeout_s)
            except TimeoutError:
                return await handshake(silo.endpoint, timeout_s)
            except errors.SiloUnavailableError as exc:
                if isinstance(exc.__cause__, (ConnectionRefusedError, ConnectionResetError)):
                    return ProbeResult.REFUSED
                return await handshake(silo.endpoint, timeout_s)
            except errors.RedgrainError:
                return ProbeResult.TIMEOUT
            try:
                await conn.ping(timeout_s, sender())
                return ProbeResult.OK
            except errors.GrainTimeoutError:
                return await handshake(silo.endpoint, timeout_s)
            except errors.SiloUnavailableError:
                continue
        return ProbeResult.REFUSED

    return probe


@dataclass(frozen=True, slots=True)
class FailureDetectorStatistics:
    rounds: int
    """Times the table was read and peers checked."""
    probes: int
    """Direct TCP probes sent."""
    probe_failures: int
    """Probes refused or timed out."""
    votes: int
    """Votes this silo cast against suspected peers."""
    declared: int
    """Silos this silo's vote declared Dead."""
    suspected: tuple[str, ...]
    """Peers suspected right now."""
    unreachable: tuple[str, ...] = ()
    """Peers the last probe could not reach over the network (not even a TCP handshake)."""
    monitored: int = 0
    """How many ring successors this silo probes and votes on (a count: stats records name no
    other silo; ``FailureDetector.monitored()`` lists them)."""
    full_reads: int = 0
    """Times the whole table was read (at start, or behind the change feed's reach)."""
    reads: int = 0
    """Rounds that read the watched heartbeats (the others only probed: nothing was in doubt)."""


@dataclass(slots=True)
class _Peer:
    since: float
    """Our clock when we first saw its current heartbeat value (the value itself stays in Redis,
    in our seen-hash, which our votes name: ``MembershipTable.moved``)."""
    suspected: bool = False
    probing: bool = False
    last_probe: float = float("-inf")
    refused_at: float | None = None
    unreachable_since: float | None = None
    """Our clock at the first of an unbroken run of UNREACHABLE probes."""
    answered: bool = True
    """The last probe that ended got an answer (OK)."""
    last_ok: float = float("-inf")
    """Our clock when a probe last got an answer (or when we began tracking it): a hung or
    unreachable peer is voted on only once this is ``dead_after_s`` old."""


def ring_position(address: str) -> int:
    """Where a silo sits on the monitoring ring: a hash of its address, so neighbours are random
    (not the silos of one host) and every silo computes the same ring from the same rows."""
    return int.from_bytes(hashlib.blake2b(address.encode(), digest_size=8).digest(), "big")


class Ring:
    """The monitoring ring: live silos ordered by :func:`ring_position`; each monitors the
    ``k`` silos after it, so each is monitored by the ``k`` before it."""

    def __init__(self, addresses: Iterable[str], k: int) -> None:
        self._order = sorted(set(addresses), key=lambda a: (ring_position(a), a))
        self._index = {a: i for i, a in enumerate(self._order)}
        self._k = k

    def __len__(self) -> int:
        return len(self._order)

    def successors(self, address: str) -> list[str]:
        """The silos ``address`` monitors: its next ``k`` (all others when there are fewer)."""
        return self._walk(address, 1)

    def monitors(self, address: str) -> list[str]:
        """The silos that monitor ``address``: its ``k`` predecessors (all others when fewer)."""
        return self._walk(address, -1)

    def _walk(self, address: str, step: int) -> list[str]:
        i = self._index.get(address)
        if i is None:
            return []
        n = len(self._order)
        return [self._order[(i + step * j) % n] for j in range(1, min(self._k, n - 1) + 1)]


class FailureDetector:
    """Watches this silo's ring successors; votes when one is dead or hung; notices when we are
    declared dead. Reads the changes of the table and its successors' heartbeats, never the
    table: O(``monitors``) a round whatever the cluster's size."""

    def __init__(
        self,
        *,
        table: MembershipTable,
        me: SiloAddress,
        settings: MembershipSettings,
        probe: Probe,
        on_self_dead: Callable[[], Any] = lambda: None,
        events: ClusterEvents | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_monitors: Callable[[list[str]], Any] = lambda monitors: None,
    ) -> None:
        self._table = table
        self._on_monitors = on_monitors
        """Told who monitors us after every read (:meth:`Liveness.watch_monitors`: their probes vouch for us)."""
        self._me = me
        self._addr = str(me)
        self._s = settings
        self._probe = probe
        self._on_self_dead = on_self_dead
        self._events = events or ClusterEvents()
        self._clock = clock
        self._peers: dict[str, _Peer] = {}
        """Peers whose heartbeats we track: our successors, and the other monitors of a suspect."""
        self._rows: dict[str, MemberRow] = {}
        self._version = -1
        self._ring = Ring([self._addr], settings.monitors)
        self._monitored: list[str] = []
        self._probes: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._unreachable_logged: set[str] = set()
        """Peers whose unreachable votes were logged (a lasting partition re-votes every round)."""
        self.rounds = self.probes = self.probe_failures = self.votes = self.declared = 0
        self.full_reads = 0
        self.reads = 0
        self._read_at = float("-inf")
        self._dirty = True
        """Membership may have changed since our last read (told by the view, or a peer is new)."""
        self._round = asyncio.Lock()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopping = True  # see Rebalancer.stop: a cancel may be swallowed by redis-py
        self._wake.set()
        tasks = [t for t in (self._task, *self._probes) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def wait_probes(self) -> None:
        """Wait for the probes in flight (unit tests drive rounds by hand)."""
        while self._probes:
            await asyncio.gather(*list(self._probes), return_exceptions=True)

    def hint_unreachable(self, silo: SiloAddress) -> None:
        """A caller could not connect to ``silo``: probe it now instead of next round (if we monitor it)."""
        peer = self._peers.get(str(silo))
        if peer is not None and not peer.probing and str(silo) in self._monitored:
            peer.last_probe = float("-inf")
            self._wake.set()

    def membership_changed(self) -> None:
        """Membership changed (the view heard it): read it on the next round, now."""
        self._dirty = True
        self._wake.set()

    def _in_doubt(self, now: float) -> bool:
        """A monitored peer's last probe failed or is late, or it is suspected: read every round."""
        late = self._s.probe_interval_s / 2  # a PING is answered in ms; one pending this long is news
        for addr in self._monitored:
            p = self._peers.get(addr)
            if p is None:
                return True  # not tracked yet: its heartbeat is read from the next round on
            if not p.answered or p.suspected or p.refused_at is not None or p.unreachable_since is not None:
                return True
            if p.probing and now - p.last_probe >= late:
                return True
        return False

    def monitored(self) -> list[str]:
        """The ring successors this silo probes and votes on."""
        return list(self._monitored)

    async def _run(self) -> None:
        last = self._clock()
        while not self._stopping:
            now = self._clock()
            if now - last > self._s.probe_interval_s + self._s.probe_timeout_s:
                # Our own loop stalled: probes that timed out meanwhile say nothing about peers.
                for peer in self._peers.values():
                    if peer.unreachable_since is not None:
                        peer.unreachable_since = now
            last = now
            try:
                await self.check_once()
            except errors.StorageError as exc:
                log.warning("failure detector could not read membership: %s", exc)
            await wait_event(self._wake, self._s.probe_interval_s)
            self._wake.clear()

    def _watched(self) -> list[str]:
        """Heartbeats to read: our successors', and those of the other monitors of any successor we
        suspect (how many of them are alive sets the votes needed)."""
        out = set(self._monitored)
        for addr in self._monitored:
            p = self._peers.get(addr)
            if p is not None and (p.suspected or p.refused_at is not None or p.unreachable_since is not None):
                out.update(self._ring.monitors(addr))
        out.discard(self._addr)
        return sorted(out)

    async def _read(self) -> tuple[dict[str, bool], dict[str, float]]:
        """Follow the table's changes and learn which watched heartbeats moved and how old each is:
        one round trip of a few bytes a silo, or a whole read when we have nothing (start) or fell
        behind."""
        watch = await self._table.moved(self._addr, self._version, self._watched())
        if watch.changes is None:
            self._version, self._rows = await self._table.read_all()
            self.full_reads += 1
        else:
            for addr, row in watch.changes:
                if row is None:
                    self._rows.pop(addr, None)
                else:
                    self._rows[addr] = row
            self._version = watch.version
        live = [a for a, r in self._rows.items() if r.status is not SiloStatus.DEAD]
        self._ring = Ring([*live, self._addr], self._s.monitors)
        self._monitored = self._ring.successors(self._addr)
        self._on_monitors(self._ring.monitors(self._addr))
        if watch.changes is None:  # we did not know whom to watch: ask again, for those
            watch = await self._table.moved(self._addr, self._version, self._watched())
        return watch.moved, watch.ages

    async def check_once(self) -> None:
        """One round: follow membership, track heartbeats, probe, vote. Tests call this directly.

        Redis is read only when it can tell something: while a monitored peer is in doubt (a probe
        failed or is late, a suspicion, a vote pending), when membership changed, and every
        ``idle_read_s`` otherwise (issue 39: a read every round was most of an idle silo's cost).
        A heartbeat's age comes from Redis' clock, so a peer is stale from its last beat however
        long ago we looked. Votes and suspicions are judged on rounds that read."""
        async with self._round:  # the loop's round, or a probe's that found our last read old
            await self._check()

    async def _check(self) -> None:
        now = self._clock()
        read = self._dirty or self._version < 0 or self._in_doubt(now) or now - self._read_at >= self._s.idle_read_s
        moved: dict[str, bool] = {}
        ages: dict[str, float] = {}
        prev_read = self._read_at
        if read:
            self._dirty = False
            moved, ages = await self._read()
            self._read_at = now = self._clock()
            self.reads += 1
        self.rounds += 1
        rows = self._rows
        own = rows.get(self._addr)
        if own is not None and own.status is SiloStatus.DEAD:
            self._on_self_dead()
            return
        watched = set(self._watched())
        for addr in [a for a in self._peers if a not in watched]:
            del self._peers[addr]
        monitored = set(self._monitored)
        for addr in sorted(watched):
            row = rows.get(addr)
            if row is None:
                continue
            peer = self._peers.get(addr)
            if read and addr in moved and (peer is None or moved[addr]):
                if peer is not None and peer.suspected:
                    log.info("%s is alive again (heartbeat moved)", addr)
                # Its last beat, by its age; but never before our previous read (the value moved
                # since then) nor before we first tracked it (a Joining silo beats only once Active,
                # and its row's first heartbeat may be long past).
                age = ages.get(addr)
                since = now if age is None or peer is None else max(now - age, prev_read)
                # A refusal after its last beat still stands (we had not read since before that beat).
                refused = peer.refused_at if peer and peer.refused_at is not None and peer.refused_at >= since else None
                peer = self._peers[addr] = _Peer(
                    since,
                    last_probe=peer.last_probe if peer else float("-inf"),
                    refused_at=refused,
                    unreachable_since=peer.unreachable_since if peer else None,
                    answered=peer.answered if peer else True,
                    last_ok=peer.last_ok if peer else now,
                )
            if peer is None:
                self._dirty = True  # newly watched: its heartbeat is read from the next round on
                continue
            if addr not in monitored:
                continue  # a suspect's other monitor: tracked for _needed, not probed or voted on
            if not read:  # nothing new about its heartbeat: only the probe below
                self._launch_probe(addr, peer, row, now)
                continue
            stale = now - peer.since
            silent = now - peer.last_ok
            # The heartbeat is a slow lease: stale alone says nothing until the lease ran out; a silo
            # whose PINGs go unanswered beats every heartbeat_s while it lives (Liveness).
            limit = self._s.suspect_after_s
            if not peer.suspected and ((not peer.answered and silent >= limit and stale >= limit) or stale >= self._s.lease_s):
                peer.suspected = True
                self._events.emit(
                    "suspect",
                    {"silo": addr, "stale_s": round(stale, 3), "silent_s": round(silent, 3), "by": self._addr},
                )
            if peer.refused_at is not None:
                await self._vote(addr, peer, "refused connections")
            elif self._hung(peer, now):
                await self._vote(addr, peer, f"no answer for {silent:.1f}s, heartbeat stale {stale:.1f}s")
            elif stale >= self._s.lease_s + self._s.dead_after_s:
                await self._vote(addr, peer, f"heartbeat stale {stale:.1f}s (lease run out)")
            elif peer.unreachable_since is not None and now - peer.unreachable_since >= self._s.dead_after_s * 2:
                await self._vote_unreachable(addr, now - peer.unreachable_since)
            self._launch_probe(addr, peer, row, now)

    def _hung(self, peer: _Peer, now: float) -> bool:
        """Its probes unanswered ``dead_after_s`` and its heartbeat as old: a silo that is alive beats
        every ``heartbeat_s`` once its monitors' PINGs stop reaching it (:class:`Liveness`), so its
        heartbeat stays young while its loop is busy or the link to us is cut."""
        return (
            not peer.answered
            and now - peer.last_ok >= self._s.dead_after_s
            and now - peer.since >= self._s.dead_after_s
        )

    def _launch_probe(self, addr: str, peer: _Peer, row: MemberRow, now: float) -> None:
        if not peer.probing and now - peer.last_probe >= self._s.probe_interval_s:
            peer.probing = True
            peer.last_probe = now
            task = asyncio.get_running_loop().create_task(self._probe_peer(addr, row.silo))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _probe_peer(self, addr: str, silo: SiloAddress) -> None:
        try:
            self.probes += 1
            result = await self._probe(silo, self._s.probe_timeout_s)
        except Exception:
            log.exception("probe of %s failed unexpectedly", addr)
            result = ProbeResult.TIMEOUT
        peer = self._peers.get(addr)
        if peer is None:
            return
        peer.probing = False
        peer.answered = result is ProbeResult.OK
        if result is ProbeResult.UNREACHABLE:
            if peer.unreachable_since is None:
                peer.unreachable_since = self._clock()
        else:
            peer.unreachable_since = None
            self._unreachable_logged.discard(addr)
        if result is ProbeResult.OK:
            peer.refused_at = None
            peer.last_ok = self._clock()
            if peer.suspected and peer.last_ok - peer.since < self._s.lease_s:
                peer.suspected = False
            return
        self.probe_failures += 1
        stale = self._clock() - peer.since
        # A vote names the heartbeat value our last read saw: one from a round ago at most, else a
        # round now (it reads, as this peer is in doubt, and votes on what it finds).
        fresh = self._clock() - self._read_at <= self._s.probe_interval_s
        if result is ProbeResult.REFUSED:
            # Fast path: the process is gone. The vote still only counts while
            # its heartbeat stays the value we saw.
            peer.refused_at = self._clock()
            if fresh:
                await self._vote(addr, peer, "refused connections")
            else:
                await self._round_now()
        elif self._hung(peer, self._clock()):
            if fresh:
                await self._vote(addr, peer, f"no answer, heartbeat stale {stale:.1f}s")
            else:
                await self._round_now()

    async def _round_now(self) -> None:
        try:
            await self.check_once()
        except errors.StorageError as exc:
            log.warning("failure detector could not read membership: %s", exc)

    def _needed(self, suspect: str) -> int:
        """min(2, the suspect's monitors that look alive to us, ourselves included).

        A monitor we track counts unless it refuses connections; one we probe while it answers or
        its heartbeat moved within ``suspect_after_s`` (a live silo our probes cannot reach misses
        them, is in doubt and beats every ``heartbeat_s``: so a silo cut off alone cannot vote the
        others out by itself); one we do not probe while its lease runs. One we do not track yet
        counts (we learn otherwise within a round or two), so a vote never goes through alone on a
        guess."""
        now = self._clock()
        fresh = 1  # ourselves
        for addr in self._ring.monitors(suspect):
            if addr == self._addr:
                continue
            p = self._peers.get(addr)
            if p is None:
                fresh += 1
            elif p.refused_at is not None:
                continue
            elif addr in self._monitored:
                fresh += p.answered or now - p.last_ok < self._s.suspect_after_s or now - p.since < self._s.suspect_after_s
            else:
                fresh += now - p.since < self._s.lease_s
        return min(2, fresh)

    async def _vote(self, addr: str, peer: _Peer, why: str) -> None:
        outcome = await self._cast(addr, why, self._table.vote_dead(addr, self._addr, None, self._needed(addr)))
        if outcome is None:
            return
        if outcome.result == "alive":
            peer.refused_at = None
        else:
            log.info("voted %s dead (%s): %s, %d vote(s)", addr, why, outcome.result, outcome.votes)

    async def _vote_unreachable(self, addr: str, for_s: float) -> None:
        why = f"unreachable over the network for {for_s:.1f}s"
        vote = self._table.vote_unreachable(addr, self._addr, self._needed(addr), self._s.dead_after_s)
        outcome = await self._cast(addr, why, vote)
        if outcome is not None and addr not in self._unreachable_logged:
            self._unreachable_logged.add(addr)  # once per partition: this vote repeats every round
            log.info("voted %s dead (%s): %s, %d vote(s)", addr, why, outcome.result, outcome.votes)

    async def _cast(self, addr: str, why: str, vote: Awaitable[VoteOutcome]) -> VoteOutcome | None:
        """Count a vote; a declaration emits the event and forgets the peer. None: failed or declared."""
        try:
            outcome = await vote
        except errors.StorageError as exc:
            log.warning("vote against %s failed: %s", addr, exc)
            return None
        self.votes += 1
        if outcome.result != "declared":
            return outcome
        self.declared += 1
        self._events.emit("dead", {"silo": addr, "by": self._addr, "votes": outcome.votes, "why": why})
        self._peers.pop(addr, None)
        return None

    def unreachable(self) -> set[str]:
        """Peers the last probe could not reach over the network (the rebalancer moves nothing there)."""
        return {a for a, p in self._peers.items() if p.unreachable_since is not None}

    def statistics(self) -> FailureDetectorStatistics:
        return FailureDetectorStatistics(
            rounds=self.rounds,
            probes=self.probes,
            probe_failures=self.probe_failures,
            votes=self.votes,
            declared=self.declared,
            suspected=tuple(sorted(a for a, p in self._peers.items() if p.suspected)),
            unreachable=tuple(sorted(self.unreachable())),
            monitored=len(self._monitored),
            full_reads=self.full_reads,
            reads=self.reads,
        )
