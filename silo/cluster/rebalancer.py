"""The elected rebalancer: fails over dead silos and evens out load.

One silo at a time holds the ``rebalancer`` lease in Redis (SET NX PX,
renewed every third of ``lease_ttl_s``). A follower tries for it when the
holder's lease runs out, or at once when membership says the holder is Dead
(it drops the dead holder's lease: compare-and-delete); so a dead leader is
replaced as soon as it is declared dead, and the lease can be long (15 s)
and cheap: an idle cluster's followers ask Redis about it every ~15 s, not
every second (issue 39). The leader:

* **fails over** every Dead silo that still has directory entries: it purges
  them in bounded steps (``RedisGrainDirectory.purge_batch``: no script holds
  Redis more than a few ms) and re-activates the ``@keep_alive`` grains among
  them on survivors at once (the others re-activate on their next call);
* **balances**: a silo holding more than ``mean * (1 + tolerance)``
  activations (or more than the mean while another holds less than
  ``mean * (1 - tolerance)``) is told (a ``move`` system call) to move the
  surplus to the silos below the mean, at most ``max_moves_per_period`` per
  period *each*, so the cluster's rate grows with its size. A silo that just
  joined has none, so it gets a share from every silo above the mean.

The move itself runs on the source silo (``silo/cluster/migrator.py``);
``@immovable`` and ``@keep_alive`` grains are never moved for balance
(keep-alive grains are long-lived and expensive to move: training); both
move when their silo drains (``silo/cluster/drain.py``). Admin commands such
as a drain reach a silo through its inbox (``silo/cluster/control.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from grains.ids import SiloAddress
from silo import errors
from silo.cluster.events import ClusterEvents
from silo.cluster.failure_detector import wait_event
from silo.cluster.view import MembershipView
from silo.keys import Keys, parse_manifest_field
from silo.records.membership import SiloStatus
from silo.redis_util import redis_errors
from silo.settings import RebalancerSettings

if TYPE_CHECKING:
    from silo.cluster.directory import RedisGrainDirectory
    from silo.cluster.migrator import Migrator
    from silo.messaging.router import Router

log = logging.getLogger("redgrain.rebalancer")

# {1} held; {0, holder, ms left} another silo holds it (the follower sleeps that long).
_RENEW = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1}
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1}
end
return {0, cur, redis.call('PTTL', KEYS[1])}
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaderLease:
    """A cluster-wide role held by one silo, with a TTL so a dead holder loses it."""

    def __init__(self, redis: aioredis.Redis, key: str, holder: str, ttl_s: float) -> None:
        self._redis = redis
        self._key = key
        self._holder = holder
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self.held = False
        self.other: str | None = None
        """Who holds it when we do not (as of the last try)."""
        self.other_left_s = 0.0
        """How long the other holder's lease had left at the last try."""

    async def acquire_or_renew(self) -> bool:
        with redis_errors("leader lease"):
            raw = await self._renew(keys=[self._key], args=[self._holder, self._ttl_ms])
        self.held = int(raw[0]) == 1
        if self.held:
            self.other, self.other_left_s = None, 0.0
        else:
            holder = raw[1]
            self.other = holder.decode() if isinstance(holder, bytes) else str(holder)
            self.other_left_s = max(0.0, int(raw[2]) / 1000.0)
        return self.held

    async def take_over(self, dead: str) -> bool:
        """Drop the lease of ``dead`` (a holder declared Dead: it renews no more) and try for it."""
        with redis_errors("leader lease takeover"):
            await self._release(keys=[self._key], args=[dead])
        return await self.acquire_or_renew()

    async def release(self) -> None:
        if self.held:
            with contextlib.suppress(errors.StorageError), redis_errors("leader lease release"):
                await self._release(keys=[self._key], args=[self._holder])
        self.held = False


@dataclass(frozen=True, slots=True)
class RebalancerStatistics:
    leader: bool
    """This silo holds the rebalancer lease."""
    moves_ordered: int
    """Activations the leader told other silos to move away."""
    moved_out: int
    """Activations this silo moved to another silo."""
    move_failures: int
    """Moves that found no target or whose target refused."""
    failovers: int
    """Dead silos whose directory entries this silo purged (as leader)."""
    keep_alive_restarted: int
    """@keep_alive grains of dead silos this silo re-activated proactively."""


class Rebalancer:
    """Takes part in the leader election; as leader, fails over dead silos and balances load."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: Keys,
        me: SiloAddress,
        view: MembershipView,
        directory: RedisGrainDirectory,
        router: Router,
        settings: RebalancerSettings,
        events: ClusterEvents,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._me = me
        self._view = view
        self._directory = directory
        self._router = router
        self._s = settings
        self._events = events
        self._clock = clock
        self.lease = LeaderLease(redis, keys.leader("rebalancer"), str(me), settings.lease_ttl_s)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._cooldown: dict[str, float] = {}
        self._last_balance = clock()
        self.moves_ordered = self.failovers = self.keep_alive_restarted = 0
        view.on_change(self._on_membership_change)

    def _on_membership_change(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        # A flag as well as cancel(): redis-py may swallow a cancellation that
        # lands inside a command, and the loop must end anyway.
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.lease.release()

    def _holder_dead(self) -> bool:
        """The silo holding the lease is Dead in our view (declared so: it renews no more)."""
        other = self.lease.other
        row = self._view.rows.get(other) if other is not None else None
        return row is not None and row.status is SiloStatus.DEAD

    async def acquire(self) -> bool:
        """Renew or take the lease; from a holder membership says is Dead too, without waiting
        for its lease to run out. True: this silo leads."""
        if self.lease.other is not None and self._holder_dead():
            return await self.lease.take_over(self.lease.other)
        return await self.lease.acquire_or_renew()

    async def _run(self) -> None:
        renew = min(self._s.lease_ttl_s / 3, self._s.period_s)
        while not self._stopping:
            tick = renew
            try:
                if await self.acquire():
                    await self.fail_over_dead()
                    if self._clock() - self._last_balance >= self._s.period_s:
                        self._last_balance = self._clock()
                        # Views sample loads slowly (O(1) a silo); the leader reads them all.
                        await self._view.refresh_loads()
                        await self.balance()
                else:
                    # A follower tries again when the holder's lease runs out or membership
                    # changes (the holder may have been declared dead), not every renewal period:
                    # an idle cluster's followers cost Redis next to nothing (issue 39).
                    tick = max(renew, self.lease.other_left_s + 0.05)
            except errors.RedgrainError as exc:
                log.warning("rebalancer round failed: %s", exc)
            except Exception:
                log.exception("rebalancer round failed")
            await wait_event(self._wake, tick)
            self._wake.clear()

    async def fail_over_dead(self) -> None:
        """Purge the entries of every Dead silo; re-activate its @keep_alive grains elsewhere."""
        for row in list(self._view.rows.values()):
            # Never our own row: a silo that reads itself Dead is a zombie and writes
            # nothing (the survivors' leader fails it over).
            if row.status is not SiloStatus.DEAD or row.address == str(self._me):
                continue
            with redis_errors("directory index size"):
                n = await self._redis.scard(self._keys.directory_index(row.address))
            if n:
                await self.fail_over(row.silo)

    async def fail_over(self, dead: SiloAddress) -> None:
        """Purge a dead silo's entries step by step, re-activating its @keep_alive grains as they come.

        Each step is one bounded script (``RedisGrainDirectory.purge_batch``); the
        lease is renewed between steps when due, so a long purge (a million
        entries take seconds) never lets it lapse. Lost to another silo: that
        leader's next round goes on where this one stopped.
        """
        keep = await self._keep_alive_types()
        renew_every = min(self._s.lease_ttl_s / 3, self._s.period_s)
        renewed = self._clock()
        purged = restarted = 0
        while True:
            if self._stopping:
                return
            if self._clock() - renewed >= renew_every:
                if not await self.lease.acquire_or_renew():
                    return
                renewed = self._clock()
            batch = await self._directory.purge_batch(dead)
            purged += len(batch.grains)
            for grain in batch.grains:
                if grain.type_name not in keep:
                    continue
                try:
                    await self._router.activate(grain)
                    restarted += 1
                except errors.RedgrainError as exc:
                    log.warning("could not re-activate keep-alive %s: %s", grain, exc)
            if not batch.remaining:
                break
        self.failovers += 1
        self.keep_alive_restarted += restarted
        self._events.emit(
            "failover", {"silo": str(dead), "purged": purged, "keep_alive_restarted": restarted}
        )

    async def _keep_alive_types(self) -> set[str]:
        with redis_errors("grain type manifests"):
            raw = await self._redis.hgetall(self._keys.grain_manifests)
        out = set()
        for field, text in raw.items():
            try:
                if json.loads(text).get("keep_alive"):
                    out.add(parse_manifest_field(field)[0])
            except ValueError:
                continue
        return out

    def plan(self) -> list[tuple[SiloAddress, int, list[str]]]:
        """(source, how many, targets) for each silo that gives, each within its move budget.

        A silo gives when it holds more than ``mean * (1 + tolerance)``, or more
        than the mean while some silo holds less than ``mean * (1 - tolerance)``
        (one that just joined: among a hundred silos no single one rises far
        above the mean when a new one starts empty). The budget,
        ``max_moves_per_period``, is each source's: the cluster's rate grows
        with the silos that give, while no silo moves more per period than
        before (docs/decisions.md).
        """
        rows = self._view.active()
        if len(rows) < 2:
            return []
        counts = {r.address: r.load.activations for r in rows}
        mean = sum(counts.values()) / len(rows)
        under = [a for a, c in sorted(counts.items(), key=lambda x: x[1]) if c < mean]
        starved = any(c < mean * (1 - self._s.tolerance) for c in counts.values())
        budget = self._s.max_moves_per_period
        out = []
        now = self._clock()
        for row in sorted(rows, key=lambda r: -counts[r.address]):
            c = counts[row.address]
            if budget <= 0 or not under or c - mean < 1:
                continue
            if c <= mean * (1 + self._s.tolerance) and not starved:
                continue
            if self._cooldown.get(row.address, 0.0) > now:
                continue  # its published count may not show the last moves yet
            k = min(c - math.ceil(mean), budget)
            if k > 0:
                out.append((row.silo, k, under))
        return out

    async def balance(self) -> int:
        ordered = 0
        for source, k, targets in self.plan():
            try:
                n = int(await self._router.system_call(source, "move", (k, targets), 5.0))
            except errors.RedgrainError as exc:
                log.warning("could not order %s to move %d activations: %s", source, k, exc)
                continue
            self._cooldown[str(source)] = self._clock() + 2 * self._s.period_s
            ordered += n
        self.moves_ordered += ordered
        return ordered

    def statistics(self, migrator: Migrator | None = None) -> RebalancerStatistics:
        return RebalancerStatistics(
            leader=self.lease.held,
            moves_ordered=self.moves_ordered,
            moved_out=migrator.moved if migrator else 0,
            move_failures=migrator.failures if migrator else 0,
            failovers=self.failovers,
            keep_alive_restarted=self.keep_alive_restarted,
        )
