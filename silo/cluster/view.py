"""MembershipView: a silo's (or a client's) cached picture of the membership table.

Whoever asks "is that silo alive, which silos host this grain type" (the
router, placement, the failure detector, the rebalancer) reads this view,
never the table, so the answer is in memory. The view re-reads the whole table
(version and rows in one transaction) when:

- the table's channel announces a new version (every status change publishes
  one), so a join or a death is seen within about 50 ms: the subscription is
  polled rather than blocked on, since cancelling a blocked redis-py read can
  hang a stopping silo;
- ``refresh_s`` has passed: the fallback for a lost message or a dropped
  subscription (which is re-made after ``refresh_s``).

A refresh that changed a status calls the ``on_change`` listeners with the
old and the new rows. ``hint_unreachable`` is the callers' fast path to the
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
from silo.records import MemberRow, SiloStatus
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
    """Times the table was re-read."""
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
                        await self.refresh()
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
        )
