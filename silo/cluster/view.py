"""MembershipView: a silo's (or a client's) cached picture of the membership table.

Whoever asks "is that silo alive, which silos host this grain type" (the
router, placement, the failure detector, the rebalancer) reads this view,
never the table, so the answer is in memory. The view reads the whole table
once, at start (and when asked: ``refresh``); after that it follows the
table's change feed (``MembershipTable.watch``: the rows changed since the
version it has, oldest first), so a status change costs each reader the
changed rows, never the table:

- the table's channel announces a new version (every status change publishes
  one), so a join or a death is seen within about 50 ms: the subscription is
  polled rather than blocked on, since cancelling a blocked redis-py read can
  hang a stopping silo;
- every ``refresh_s`` it polls the version (the fallback for a lost message or
  a dropped subscription, which is re-made after ``refresh_s``), and re-reads
  the published loads of ``load_sample`` silos in turn, for placement;
- a reader so far behind that the capped feed no longer reaches back to its
  version (or with a gap) reads the whole table once instead.

A read that changed a status calls the ``on_change`` listeners with the old
and the new rows. ``hint_unreachable`` is the callers' fast path to the
failure detector: a call that could not reach a silo says so at once, rather
than waiting for its heartbeats to go stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from grains.ids import SiloAddress
from silo import errors
from silo.cluster.membership import MembershipTable
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.shutdown import raise_if_cancelled

log = logging.getLogger("redgrain.membership")


@dataclass(frozen=True, slots=True)
class MembershipStatistics:
    version: int
    """Membership version this view last read."""
    active: int
    """Silos Active in the view."""
    dead: int
    """Silos Dead in the view."""
    refreshes: int
    """Times the whole table was read (at start, or behind the feed's reach)."""
    catch_ups: int = 0
    """Reads of the change feed (and of the sampled loads)."""
    # No member list: every silo publishes these figures each second, and a list
    # would make each record O(n) and the dashboard's read of all of them O(n²).
    # The dashboard reads the membership table itself.


class MembershipView:
    """A silo's or client's picture of the table, kept fresh by pub/sub and polling."""

    def __init__(
        self,
        table: MembershipTable,
        *,
        redis: aioredis.Redis | None = None,
        keys: Keys | None = None,
        refresh_s: float = 2.0,
        load_sample: int = 8,
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
        self._closing: set[asyncio.Future[None]] = set()
        """Subscriptions being closed in the background (stop() waits a moment for them)."""
        self._refreshes = 0
        self._catch_ups = 0
        self._load_sample = load_sample
        self._load_turn = 0
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
        # lands inside a command (silo/shutdown.py), and then a loop never ends.
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._closing:
            # Bounded: a close that hangs on a dead Redis must not hold up a stop.
            await asyncio.wait(list(self._closing), timeout=1.0)

    async def refresh(self) -> None:
        """Read the whole table now (O(n): at start, or when asked)."""
        async with self._lock:
            version, rows = await self._table.read_all()
            self._refreshes += 1
            old = self._install(version, rows)
        await self._notify(old, rows)

    async def catch_up(self, *, loads: bool = False) -> None:
        """Apply the changes since our version from the feed (a whole read when it no longer
        reaches back); with ``loads``, re-read the next ``load_sample`` silos' loads too."""
        async with self._lock:
            sample = self._next_sample() if loads else []
            watch = await self._table.watch(self.version, loads=sample)
            self._catch_ups += 1
            if watch.changes is None:
                version, rows = await self._table.read_all()
                self._refreshes += 1
            else:
                rows = dict(self.rows)
                for addr, row in watch.changes:
                    if row is None:
                        rows.pop(addr, None)
                        continue
                    known = rows.get(addr)
                    # The feed carries the row as changed, not its load: keep the load we know.
                    rows[addr] = row if known is None else row.model_copy(update={"load": known.load})
                version = watch.version
            for addr, load in watch.loads.items():
                if addr in rows:
                    rows[addr] = rows[addr].model_copy(update={"load": load})
            old = self._install(version, rows)
        await self._notify(old, rows)

    async def refresh_loads(self) -> None:
        """Re-read every live silo's published load (the rebalancer's leader: O(n), one silo)."""
        async with self._lock:
            live = [a for a, r in self.rows.items() if r.status is not SiloStatus.DEAD]
            watch = await self._table.watch(-1, loads=live)
            for addr, load in watch.loads.items():
                if addr in self.rows:
                    self.rows[addr] = self.rows[addr].model_copy(update={"load": load})
            self._silos = {r.silo: r for r in self.rows.values()}

    def _next_sample(self) -> list[str]:
        live = sorted(a for a, r in self.rows.items() if r.status is not SiloStatus.DEAD)
        if len(live) <= self._load_sample:
            return live
        start = self._load_turn % len(live)
        self._load_turn = start + self._load_sample
        return [live[(start + i) % len(live)] for i in range(self._load_sample)]

    def _install(self, version: int, rows: dict[str, MemberRow]) -> dict[str, MemberRow] | None:
        """Make ``rows`` the view; the old rows when a status changed (listeners are due), else None."""
        old = self.rows
        changed = version != self.version or {a: r.status for a, r in rows.items()} != {
            a: r.status for a, r in old.items()
        }
        self.version = version
        self.rows = rows
        self._silos = {r.silo: r for r in rows.values()}
        return old if changed else None

    async def _notify(self, old: dict[str, MemberRow] | None, rows: dict[str, MemberRow]) -> None:
        if old is None:
            return
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
                await self.catch_up(loads=True)
            except errors.StorageError as exc:
                log.warning("membership refresh failed: %s", exc)
            raise_if_cancelled()

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
                    raise_if_cancelled()  # get_message(timeout=0) can swallow a cancel
                    if msg is not None:
                        # Many changes at once (a fleet starting) need one read, not one each.
                        while msg is not None:
                            msg = await pubsub.get_message(timeout=0)
                            raise_if_cancelled()
                        await self.catch_up()
                    else:
                        await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever broke it, subscribe again
                log.debug("membership subscription dropped: %s", exc)
                raise_if_cancelled()
                await asyncio.sleep(self._refresh_s)
            finally:
                # Closing must not hold up a stopping silo: in the background, awaited
                # (briefly) by stop().
                close = asyncio.ensure_future(pubsub.aclose())
                self._closing.add(close)
                close.add_done_callback(self._closed)

    def _closed(self, fut: asyncio.Future[None]) -> None:
        self._closing.discard(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved: a failed close of a dropped subscription is no news

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
            catch_ups=self._catch_ups,
        )
