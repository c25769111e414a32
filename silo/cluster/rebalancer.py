"""Moving activations: the elected rebalancer, moves between silos, failover, drain.

One silo at a time holds the ``rebalancer`` lease in Redis (SET NX PX,
renewed; a dead leader is replaced after ``lease_ttl_s``). The leader:

* **fails over** every Dead silo that still has directory entries: it lists
  the dead silo's index, purges its entries, and re-activates its
  ``@keep_alive`` grains on survivors at once (the others re-activate on
  their next call);
* **balances**: a silo holding more than ``mean * (1 + tolerance)``
  activations is told (a ``move`` system call) to move the surplus to the
  silos below the mean, at most ``max_moves_per_period`` per period. A silo
  that just joined has none, so it gets a share within a period.

A move, on the source silo (:class:`Migrator`): calls for the grain wait
while it moves; the activation is deactivated (``REBALANCE``: its turn
finishes, ``on_deactivate`` runs, write-behind state is flushed, the directory
entry is removed), then the target is told to activate it (it registers in
the directory with check-and-set), and the waiting calls are forwarded there.
Nothing runs twice and nothing is dropped. ``@immovable`` and ``@keep_alive``
grains are never moved for balance (keep-alive grains are long-lived and
expensive to move: training); both move when their silo drains.
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

from grains.base import DeactivationReason
from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.cluster.failure_detector import wait_event
from silo.cluster.membership import ClusterEvents, MembershipView
from silo.keys import Keys
from silo.records import SiloStatus
from silo.redis_util import redis_errors
from silo.settings import RebalancerSettings

if TYPE_CHECKING:
    from silo.catalog.catalog import Activation, Catalog
    from silo.cluster.directory import RedisGrainDirectory
    from silo.cluster.placement import Placer
    from silo.messaging.dispatcher import Dispatcher
    from silo.messaging.router import Manifests, Router

log = logging.getLogger("redgrain.rebalancer")

_RENEW = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
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

    async def acquire_or_renew(self) -> bool:
        with redis_errors("leader lease"):
            self.held = bool(await self._renew(keys=[self._key], args=[self._holder, self._ttl_ms]))
        return self.held

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


class Migrator:
    """The source side of a move, and the keep-alive handoff of a draining silo."""

    def __init__(
        self,
        *,
        me: SiloAddress,
        catalog: Catalog,
        dispatcher: Dispatcher,
        router: Router,
        view: MembershipView,
        manifests: Manifests,
        placer: Placer,
        events: ClusterEvents,
    ) -> None:
        self._me = me
        self._catalog = catalog
        self._dispatcher = dispatcher
        self._router = router
        self._view = view
        self._manifests = manifests
        self._placer = placer
        self._events = events
        self._batch: asyncio.Task[int] | None = None
        self.moved = 0
        self.failures = 0

    def movable(self, *, for_drain: bool = False) -> list[Activation]:
        """Activations that may move, idle and least recently used first."""
        acts = [
            a
            for a in self._catalog.activations()
            if a.status == "active"
            and not a.options.stateless_worker
            and (for_drain or not (a.options.immovable or a.options.keep_alive))
        ]
        return sorted(acts, key=lambda a: (a.busy, a.last_used))

    async def move(self, act: Activation, target: SiloAddress) -> bool:
        """Deactivate here, activate on ``target``; calls that arrive meanwhile follow it."""
        grain = act.grain_id
        moving: asyncio.Future[SiloAddress | None] = asyncio.get_running_loop().create_future()
        self._dispatcher.moving[grain] = moving
        where: SiloAddress | None = None
        try:
            await self._catalog.deactivate(act, DeactivationReason.REBALANCE)
            try:
                where = SiloAddress.parse(await self._router.activate(grain, target))
            except errors.RedgrainError as exc:
                log.warning("move of %s to %s failed: %s", grain, target, exc)
        finally:
            moving.set_result(where)
            self._dispatcher.moving.pop(grain, None)
        if where is None:
            self.failures += 1
            return False
        self.moved += 1
        return True

    def move_out_nowait(self, count: int, targets: list[str]) -> int:
        """Start moving up to ``count`` activations to ``targets`` (round robin); how many will go."""
        if self._batch is not None and not self._batch.done():
            return 0  # one batch at a time: the leader asks again next period
        acts = self.movable()[: max(0, count)]
        silos = [SiloAddress.parse(t) for t in targets if t != str(self._me)]
        if not acts or not silos:
            return 0
        self._batch = asyncio.get_running_loop().create_task(self._move_all(acts, silos))
        return len(acts)

    async def _move_all(self, acts: list[Activation], silos: list[SiloAddress]) -> int:
        moved = 0
        for i, act in enumerate(acts):
            if act.status != "active":
                continue
            moved += await self.move(act, silos[i % len(silos)])
        self._events.emit(
            "rebalance", {"from": str(self._me), "moved": moved, "to": [str(s) for s in silos]}
        )
        return moved

    def _target_for(self, grain: GrainId) -> SiloAddress | None:
        info = self._manifests.get_nowait(grain.type_name)
        if info is None:
            return None
        candidates = [r for r in self._view.hosting(grain.type_name) if r.silo != self._me]
        try:
            return self._placer.place(grain, info.placement, candidates, None)
        except errors.SiloUnavailableError:
            return None

    async def hand_off_keep_alive(self) -> int:
        """Draining: move every @keep_alive activation to another silo now, not on next call."""
        acts = [a for a in self.movable(for_drain=True) if a.options.keep_alive]
        moved = 0
        for act in acts:
            target = self._target_for(act.grain_id)
            if target is not None and act.status == "active":
                moved += await self.move(act, target)
        return moved

    async def stop(self) -> None:
        if self._batch is not None:
            self._batch.cancel()
            await asyncio.gather(self._batch, return_exceptions=True)


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

    async def _run(self) -> None:
        tick = min(self._s.lease_ttl_s / 3, self._s.period_s)
        while not self._stopping:
            try:
                if await self.lease.acquire_or_renew():
                    await self.fail_over_dead()
                    if self._clock() - self._last_balance >= self._s.period_s:
                        self._last_balance = self._clock()
                        await self.balance()
            except errors.RedgrainError as exc:
                log.warning("rebalancer round failed: %s", exc)
            except Exception:
                log.exception("rebalancer round failed")
            await wait_event(self._wake, tick)
            self._wake.clear()

    async def fail_over_dead(self) -> None:
        """Purge the entries of every Dead silo; re-activate its @keep_alive grains elsewhere."""
        for row in list(self._view.rows.values()):
            if row.status is not SiloStatus.DEAD:
                continue
            with redis_errors("directory index size"):
                n = await self._redis.scard(self._keys.directory_index(row.address))
            if n:
                await self.fail_over(row.silo)

    async def fail_over(self, dead: SiloAddress) -> None:
        grains = await self._directory.entries_of(dead)
        keep = await self._keep_alive_types()
        purged = await self._directory.purge_silo(dead)
        restarted = 0
        for grain in grains:
            if grain.type_name not in keep:
                continue
            try:
                await self._router.activate(grain)
                restarted += 1
            except errors.RedgrainError as exc:
                log.warning("could not re-activate keep-alive %s: %s", grain, exc)
        self.failovers += 1
        self.keep_alive_restarted += restarted
        self._events.emit(
            "failover", {"silo": str(dead), "purged": purged, "keep_alive_restarted": restarted}
        )

    async def _keep_alive_types(self) -> set[str]:
        with redis_errors("grain type manifests"):
            raw = await self._redis.hgetall(self._keys.grain_types)
        out = set()
        for name, text in raw.items():
            try:
                if json.loads(text).get("keep_alive"):
                    out.add(name.decode() if isinstance(name, bytes) else name)
            except ValueError:
                continue
        return out

    def plan(self) -> list[tuple[SiloAddress, int, list[str]]]:
        """(source, how many, targets) for each overloaded silo, within the move budget."""
        rows = self._view.active()
        if len(rows) < 2:
            return []
        counts = {r.address: r.load.activations for r in rows}
        mean = sum(counts.values()) / len(rows)
        under = [a for a, c in sorted(counts.items(), key=lambda x: x[1]) if c < mean]
        budget = self._s.max_moves_per_period
        out = []
        now = self._clock()
        for row in sorted(rows, key=lambda r: -counts[r.address]):
            c = counts[row.address]
            if budget <= 0 or not under or c <= mean * (1 + self._s.tolerance) or c - mean < 1:
                continue
            if self._cooldown.get(row.address, 0.0) > now:
                continue  # its published count may not show the last moves yet
            k = min(c - math.ceil(mean), budget)
            if k > 0:
                out.append((row.silo, k, under))
                budget -= k
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


class ControlInbox:
    """Admin commands for this silo from ``keys.control(silo)`` (the dashboard, ``redgrain drain``).

    A command is JSON ``{"command": "drain", ...}``; the list has a TTL set by
    the sender. Polled, since commands are rare and must survive a silo that
    was busy when one was pushed.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        me: SiloAddress,
        handlers: dict[str, Callable[[dict[str, Any]], Any]],
        poll_s: float = 0.25,
    ) -> None:
        self._redis = redis
        self._key = keys.control(str(me))
        self._handlers = handlers
        self._poll_s = poll_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.received = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        while not self._stopping:
            try:
                with redis_errors("control inbox"):
                    raw = await self._redis.lpop(self._key)
            except errors.StorageError as exc:
                log.warning("%s", exc)
                raw = None
            if raw is None:
                await asyncio.sleep(self._poll_s)
                continue
            try:
                cmd = json.loads(raw if isinstance(raw, (bytes, str)) else b"")
                handler = self._handlers[str(cmd["command"])]
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring unknown control command %r", raw)
                continue
            self.received += 1
            try:
                handler(cmd)
            except Exception:
                log.exception("control command %r failed", raw)
