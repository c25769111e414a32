"""Housekeeping: what dead silos leave in Redis goes once they have been dead a while.

Every restart of a silo process joins with a new generation, so a new
membership row; the Dead rows stay so peers, the dashboard and a zombie that
wakes up can read that they are dead. Without a bound, a cluster that has
restarted silos ten thousand times carries ten thousand rows, and every
whole-table read (a reader starting, or one behind the change feed) reads them all.

Each silo sweeps every ``retention.period_s`` (candidates from its membership
view, which follows the change feed: no table read a period): a row that is Dead and whose last
heartbeat is older than ``retention.dead_silo_s`` is deleted together with the
keys named for that silo (suspicion and unreachable votes, control inbox, stats
record, stats history, its place in the stats index). The check and the
deletes are one script, so a row that came back (it cannot: a Dead row never
changes status) or was already removed by another silo's sweep is left alone;
sweeps on several silos at once are harmless. Directory entries the silo still
owned are purged first (the rebalancer's leader normally did that at its death,
re-activating its keep-alive grains elsewhere; a cluster without one relies on
this). A zombie whose row is gone reads ``Gone`` on its next heartbeat and stops,
as it would on reading ``Dead``.

Jobs of the training workload have their own retention (``TrainingJob.
ttl_after_finished_s`` and ``redgrain jobs forget``); events, logs and job
histories are capped streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from grains.ids import SiloAddress
from silo import errors
from silo.cluster.directory import GrainDirectory
from silo.cluster.membership import MembershipTable, announcing
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.redis_util import redis_errors
from silo.settings import RetentionSettings

log = logging.getLogger("redgrain.housekeeping")

# KEYS: the membership status keys (1-6), stats index, then the silo's own keys (deleted).
# ARGV: address, cutoff (unix s). The removal goes into the change feed like any change.
_REMOVE_DEAD = announcing("""
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local m = cjson.decode(raw)
if m['status'] ~= 'Dead' or tonumber(m['heartbeat']) >= tonumber(ARGV[2]) then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[7], ARGV[1])
for i = 8, #KEYS do redis.call('DEL', KEYS[i]) end
announce(ARGV[1], '')
return 1
""")


@dataclass(frozen=True, slots=True)
class HousekeepingStatistics:
    sweeps: int
    """Sweeps run by this silo."""
    removed_silos: int
    """Dead silos' rows (and their keys) this silo deleted."""
    failures: int
    """Sweeps that failed (Redis unreachable); the next period tries again."""


class Housekeeper:
    """Deletes long-dead silos' rows and keys (see the module docstring)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        membership: MembershipTable,
        directory: GrainDirectory,
        settings: RetentionSettings,
        *,
        me: SiloAddress | None = None,
        clock: Callable[[], float] = time.time,
        rows: Callable[[], Mapping[str, MemberRow]] | None = None,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._membership = membership
        self._directory = directory
        self._s = settings
        self._me = None if me is None else str(me)
        self._clock = clock
        self._rows = rows
        """The silo's membership view (no table read a period); None: read the table."""
        self._remove = redis.register_script(_REMOVE_DEAD)
        self._task: asyncio.Task[None] | None = None
        self._sweeps = self._removed = self._failures = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="housekeeping")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._s.period_s)
            try:
                await self.sweep()
            except errors.StorageError as exc:
                self._failures += 1
                log.warning("housekeeping sweep failed: %s", exc)

    async def sweep(self) -> int:
        """Delete every row Dead for longer than ``dead_silo_s``; returns how many went."""
        self._sweeps += 1
        cutoff = self._clock() - self._s.dead_silo_s
        if self._rows is not None:
            rows: Mapping[str, MemberRow] = dict(self._rows())
        else:
            _, rows = await self._membership.read_all()
        removed = 0
        for row in rows.values():
            if row.status is not SiloStatus.DEAD or row.heartbeat >= cutoff or row.address == self._me:
                continue
            await self._directory.purge_silo(SiloAddress.parse(row.address))
            k, a = self._keys, row.address
            own = [
                k.suspicions(a), k.unreachable_votes(a), k.control(a), k.silo_stats(a),
                k.silo_stats_history(a), k.directory_index(a), k.members_seen(a),
            ]  # fmt: skip
            with redis_errors("housekeeping: remove a dead silo"):
                status_keys = [
                    k.members, k.members_heartbeats, k.members_loads, k.members_version, k.members_feed,
                    k.members_channel,
                ]  # fmt: skip
                n = int(await self._remove(keys=[*status_keys, k.silo_stats_index, *own], args=[a, repr(cutoff)]))
            removed += n
        if removed:
            log.info("housekeeping: deleted %d long-dead silo row(s)", removed)
        self._removed += removed
        return removed

    def statistics(self) -> HousekeepingStatistics:
        return HousekeepingStatistics(self._sweeps, self._removed, self._failures)
