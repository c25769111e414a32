"""Redis Sentinel failover under load: the master is SIGKILLed while clients transfer and count.

The cluster's state lives in a :class:`~silo.testing.sentinel.SentinelGroup`
(1 master, 1 replica, 3 sentinels, ``down-after-milliseconds`` 1000) reached
through its ``redis+sentinel://`` URL; silos run in this process (the fault
is Redis, not a silo). The workload and the checks are the chaos soak's
(:mod:`tests.chaos.soak`): saga transfers between accounts, counters whose
increments carry an operation id, and every accepted state write logged with
the state's own sequence number -- to a separate plain redis-server, so the
log itself never goes through a failover.

Each round: load, SIGKILL the master, wait for the sentinels to promote the
replica, keep the load going; then (long form) the old master comes back as
a replica and the next round kills the new master. The figures per round:
time until the sentinels agreed on the new master, and until a call started
after the kill succeeded; at the end, acknowledged increments lost, money
created or destroyed, and writes accepted from two activations of one grain.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis

from silo.client import ClusterClient
from silo.redis_util import replication_statistics
from silo.settings import SiloSettings
from silo.silo import Silo
from silo.testing.embedded import RedisServer
from silo.testing.sentinel import SentinelGroup
from tests.chaos import grains as chaos_grains
from tests.chaos.grains import INITIAL_BALANCE, ChaosAccount, OpCounter, activation_log_key
from tests.chaos.soak import Soak, SoakConfig
from tests.conftest import FAST_MEMBERSHIP

T = TypeVar("T")


@dataclass(frozen=True)
class FailoverConfig:
    failovers: int = 1
    load_before_s: float = 2.0
    """Load before the first kill (activations exist, writes flow)."""
    load_after_s: float = 4.0
    """Load after each promotion before the next round (or the end)."""
    silos: int = 2
    url_options: str = ""
    """Appended to the Sentinel URL, e.g. ``?wait_replicas=0`` to measure without WAIT."""
    soak: SoakConfig = field(default_factory=lambda: SoakConfig(silos=2, call_timeout_s=4.0, seed=3))


@dataclass
class Round:
    killed_port: int
    promoted_s: float
    """Kill -> every sentinel names the new master."""
    first_ok_s: float
    """Kill -> the first call started after the kill succeeded."""
    last_error_s: float
    """Kill -> the end of the last failed call of this round (0: none failed)."""
    config_epoch: int


@dataclass
class FailoverReport:
    rounds: list[Round] = field(default_factory=list)
    calls: int = 0
    calls_ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    increments_acked: int = 0
    increments_lost: int = 0
    increments_twice: int = 0
    transfers_done: int = 0
    transfers_rejected: int = 0
    money_delta: int = 0
    """Sum of balances minus what the accounts started with: money created (+) or destroyed (-)."""
    double_writers: int = 0
    """Grains whose accepted writes came from two activations at once (sequence numbers shared or interleaved)."""
    accepted_writes_logged: int = 0
    waits: int = 0
    short_waits: int = 0
    violations: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "violations"}
        out["violations"] = len(self.violations)
        return out


class _LogReader:
    """What Soak._check_activation_log reads (``.redis``), pointed at the log server."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis


class FailoverLoad(Soak):
    """The soak's workload and checks over a Sentinel group, with master kills for faults."""

    def __init__(self, cfg: FailoverConfig, group: SentinelGroup, log: RedisServer, cluster: str, workdir: Path):
        super().__init__(cfg.soak, log, cluster, workdir)
        self.fcfg = cfg
        self.group = group
        self.url = group.url + cfg.url_options
        self.silos: list[Silo] = []
        self.freport = FailoverReport()
        self.outcomes: list[tuple[float, float, bool]] = []

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T | BaseException:
        t0 = time.monotonic()
        out = await super()._call(what, fn)
        self.outcomes.append((t0, time.monotonic(), not isinstance(out, BaseException)))
        return out

    async def run_failovers(self) -> FailoverReport:
        settings = SiloSettings(
            redis_url=self.url,
            cluster=self.cluster,
            grains=("tests.chaos.grains",),
            membership=FAST_MEMBERSHIP,
        )
        with _env(REDGRAIN_CHAOS_REDIS=self.redis_server.url, REDGRAIN_CHAOS_LOG=activation_log_key(self.cluster)):
            try:
                for _ in range(self.fcfg.silos):
                    self.silos.append(await Silo(settings).start())
                for s in self.silos:
                    await s.view.refresh()
                self.client = await ClusterClient.connect(self.url, cluster=self.cluster)
                workers = [asyncio.create_task(self._transfers(w)) for w in range(self.cfg.transfer_workers)]
                workers += [asyncio.create_task(self._increments(w)) for w in range(self.cfg.counter_workers)]
                await asyncio.sleep(self.fcfg.load_before_s)
                for i in range(self.fcfg.failovers):
                    if i:
                        await asyncio.to_thread(self.group.wait_replicas_synced)
                    await self._round()
                self.stop.set()
                await asyncio.gather(*workers)
                await self._finish_transfers()
                await self._check()
            finally:
                if self.client is not None:
                    await self.client.close()
                await self.probe_transport.close()
                for s in reversed(self.silos):
                    await s.stop(graceful=False)
        r = self.freport
        r.calls, r.calls_ok, r.errors = self.report.calls, self.report.calls_ok, dict(self.errors)
        r.increments_acked = self.report.increments_acked
        r.transfers_done, r.transfers_rejected = self.report.transfers_done, self.report.transfers_rejected
        r.accepted_writes_logged = self.report.accepted_writes_logged
        r.violations = self.report.violations
        return r

    async def _round(self) -> None:
        killed = await asyncio.to_thread(self.group.kill_master)
        t_kill = time.monotonic()
        self.note(f"killed master on port {killed}")
        failover = await asyncio.to_thread(self.group.wait_failover, killed, 30.0, since=t_kill)
        deadline = time.monotonic() + 30.0
        while not any(ok and start > t_kill for start, _, ok in self.outcomes):
            if time.monotonic() > deadline:
                self.report.violations.append(f"no call succeeded within 30 s of killing port {killed}")
                break
            await asyncio.sleep(0.02)  # the workers' calls are the event; polled to stay out of their way
        await asyncio.sleep(self.fcfg.load_after_s)
        after = [(s, e, ok) for s, e, ok in self.outcomes if e > t_kill]
        first_ok = min((e for s, e, ok in after if ok and s > t_kill), default=float("nan"))
        last_error = max((e for s, e, ok in after if not ok), default=t_kill)
        self.freport.rounds.append(
            Round(
                killed_port=killed,
                promoted_s=failover.seconds,
                first_ok_s=round(first_ok - t_kill, 2),
                last_error_s=round(last_error - t_kill, 2),
                config_epoch=failover.config_epoch,
            )
        )
        await asyncio.to_thread(self.group.restart, killed)

    async def _check(self) -> None:
        assert self.client is not None
        client, r = self.client, self.freport
        async def balance(i: int) -> int:
            return await client.get_grain(ChaosAccount, f"a{i}").balance()

        async def ops_of(key: str) -> list[str]:
            return await client.get_grain(OpCounter, key).ops()

        balances = [await self._retry("balance", functools.partial(balance, i)) for i in range(self.cfg.accounts)]
        r.money_delta = sum(balances) - self.cfg.accounts * INITIAL_BALANCE
        if r.money_delta:
            self.report.violations.append(f"money {'created' if r.money_delta > 0 else 'destroyed'}: {r.money_delta}")
        for key, acked in self.acked.items():
            ops = await self._retry("ops", functools.partial(ops_of, key))
            lost, twice = acked - set(ops), [op for op, n in Tally(ops).items() if n > 1]
            r.increments_lost += len(lost)
            r.increments_twice += len(twice)
            if lost:
                self.report.violations.append(f"counter {key}: {len(lost)} acknowledged increments lost")
            if twice:
                self.report.violations.append(f"counter {key}: {len(twice)} increments applied twice")
        before = len(self.report.violations)
        log = aioredis.Redis.from_url(self.redis_server.url)
        real, self.client = self.client, _LogReader(log)  # type: ignore[assignment]
        try:
            await self._check_activation_log()
        finally:
            self.client = real
            await log.aclose()
        r.double_writers = len({v.split(":")[0] for v in self.report.violations[before:]})
        for s in self.silos:
            stats = replication_statistics(s.redis)
            if stats is not None:
                r.waits += stats.waits
                r.short_waits += stats.short_waits


@contextmanager
def _env(**values: str) -> Iterator[None]:
    # The chaos grains find their activation log through the environment (in-process silos here).
    # Its client is opened once per process, on the loop of the first append: a second run in
    # this process (another test, another loop, another log server) must open its own.
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    chaos_grains._Log._client = None
    try:
        yield
    finally:
        chaos_grains._Log._client = None
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def run_failover_load(cfg: FailoverConfig, cluster: str, workdir: Path) -> FailoverReport:
    with SentinelGroup(workdir / "sentinel") as group, RedisServer(data_dir=workdir / "log") as log:
        return await FailoverLoad(cfg, group, log, cluster, workdir).run_failovers()
