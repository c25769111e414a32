"""What every partition scenario does: start a cluster on the lab's hosts, watch it, measure, check.

A :class:`Run` owns one cluster (a fresh cluster name on the module's Redis),
an observer ``ClusterClient`` in the test process (over the observer link,
which no fault touches), a watcher that notes when each silo's membership
row turns Dead, and the scenario's measured figures, printed and appended as
JSON to ``$REDGRAIN_PARTITION_REPORT`` when set.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from grains.call import Call
from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.client import ClusterClient
from silo.keys import Keys
from silo.messaging.transport import Transport
from silo.settings import TransportSettings
from silo.shutdown import raise_if_cancelled
from tests.netns import invariants
from tests.netns.cluster import NetCluster, NetSilo, Workload
from tests.netns.conftest import Lab, cluster_name
from tests.netns.grains import log_key
from tests.netns.net import Host


class Run:
    def __init__(
        self,
        lab: Lab,
        tag: str,
        *,
        env: dict[str, str],
        grains: str = "tests.netns.grains",
        redis_url: str | None = None,
        advertise: dict[str, str] | None = None,
        types: tuple[type, ...] = (),
    ) -> None:
        self.lab = lab
        self._types = types
        self.name = cluster_name(tag)
        self.tag = tag
        env = {**env, "REDGRAIN_NETNS_LOG_REDIS": redis_url or lab.redis_url, "REDGRAIN_NETNS_LOG_KEY": log_key(self.name)}
        workdir = lab.workdir / self.name
        workdir.mkdir()
        self.cluster = NetCluster(
            lab.net,
            workdir,
            self.name,
            grains=grains,
            env=env,
            redis_url=redis_url or lab.redis_url,
            observer_redis_url=lab.redis_url,
            advertise=advertise,
        )
        lab.clusters.append(self.cluster)
        self.workloads: list[Workload] = []
        self.dead_at: dict[str, float] = {}
        """Silo address -> when the observer first saw its row Dead (monotonic)."""
        self.status: dict[str, str] = {}
        self.observer: ClusterClient | None = None
        self._watch: asyncio.Task[None] | None = None
        self._raw: Transport | None = None
        self._stopping = False

    # --- lifecycle ------------------------------------------------------------
    async def start(self, hosts: list[Host], ports: dict[str, int] | None = None) -> list[NetSilo]:
        silos = await asyncio.to_thread(self.cluster.start_silos, hosts, ports)
        if self.observer is None:
            self.observer = await ClusterClient.connect(self.lab.redis_url, cluster=self.name, types=self._types)
            self._watch = asyncio.ensure_future(self._watch_members())
        return silos

    async def restart(self, host: Host, **kw: Any) -> NetSilo:
        return await asyncio.to_thread(self.cluster.start_silo, host, **kw)

    async def workload(self, name: str, *args: str, host: Host | None = None) -> Workload:
        w = await asyncio.to_thread(self.cluster.start_workload, host or self.lab.client, name, *args)
        self.workloads.append(w)
        return w

    async def close(self) -> None:
        for w in self.workloads:
            if w.process.alive():
                await asyncio.to_thread(w.stop)
        if self._watch is not None:
            # A flag as well as cancel(): redis-py can swallow a cancellation that lands inside
            # a command, and this loop, which takes RedisError for an empty table, then polled
            # forever (CI's run of the stop-43 commits hung here for pytest's 120 s).
            self._stopping = True
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self._raw is not None:
            await self._raw.close()
        if self.observer is not None:
            await self.observer.close()

    async def _watch_members(self) -> None:
        r = aioredis.Redis.from_url(self.lab.redis_url, socket_timeout=2)
        key = Keys(self.name).members
        try:
            while not self._stopping:
                try:
                    rows = await r.hgetall(key)
                except aioredis.RedisError:
                    rows = {}
                raise_if_cancelled()
                now = time.monotonic()
                for addr, raw in rows.items():
                    a = addr.decode() if isinstance(addr, bytes) else addr
                    st = json.loads(raw)["status"]
                    self.status[a] = st
                    if st == "Dead" and a not in self.dead_at:
                        self.dead_at[a] = now
                await asyncio.sleep(0.02)  # Redis is another process: poll
        finally:
            await r.aclose()

    # --- waiting and measuring ----------------------------------------------------
    @staticmethod
    async def wait(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
        """Poll ``cond`` (other processes change the world: nothing to await); seconds it took."""
        start = time.monotonic()
        while not cond():
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
            await asyncio.sleep(0.02)
        return time.monotonic() - start

    async def placements(self, w: Workload, keys: list[str], timeout_s: float = 30.0) -> dict[str, str]:
        """Key -> silo that last answered it, once every key has answered."""
        where: dict[str, str] = {}

        def all_seen() -> bool:
            for r in w.ends():
                if r["ok"]:
                    where[r["key"]] = r["res"][0]
            return set(keys) <= set(where)

        await self.wait(all_seen, timeout_s, "every key to answer once")
        return where

    @staticmethod
    def served_elsewhere_at(w: Workload, keys: list[str], since: float, not_by: str) -> float | None:
        """When the last of ``keys`` was first answered after ``since`` by a silo other than ``not_by``."""
        first: dict[str, float] = {}
        for r in w.ends():
            if r["ok"] and r["key"] in keys and r["t1"] > since and r["res"][0] != not_by:
                first.setdefault(r["key"], r["t1"])
        return max(first.values()) if set(first) >= set(keys) else None

    async def raw_call(self, silo: SiloAddress, key: str, method: str = "where", timeout_s: float = 1.0) -> Any:
        """A call sent straight to ``silo`` (no lookup): the silo activates the grain itself if it may."""
        assert self.observer is not None
        if self._raw is None:
            self._raw = Transport(TransportSettings(connect_timeout_s=1.0), self.observer.codec)
        try:
            conn = await asyncio.wait_for(self._raw.connect(silo.endpoint), timeout_s)
            return await self.observer.router.send(conn, Call(GrainId("NetCounter", key), method, (), None, timeout_s))
        except (errors.RedgrainError, TimeoutError) as exc:
            self._raw.drop(silo.endpoint)
            return exc

    # --- the end: invariants ------------------------------------------------------------
    async def final_state(self, keys: set[str], timeout_s: float = 30.0) -> dict[str, dict[str, list[str]]]:
        assert self.observer is not None
        out: dict[str, dict[str, list[str]]] = {}
        deadline = time.monotonic() + timeout_s
        for key in sorted(keys):
            while True:
                try:
                    out[key] = await self.observer.get_grain("NetCounter", key).with_timeout(3.0).snapshot()
                    break
                except errors.RedgrainError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
        return out

    async def check_invariants(self, timeout_s: float) -> dict[str, int]:
        """Stop the workloads and check every promise; returns counts for the report."""
        for w in self.workloads:
            if w.process.alive():
                await asyncio.to_thread(w.stop)
        records = [r for w in self.workloads for r in w.read()]
        problems = invariants.check_calls(records, timeout_s)
        acked = invariants.acked_ops(records)
        final = await self.final_state(set(acked))
        problems += invariants.check_acked(acked, {k: v["ops"] for k, v in final.items()})
        problems += invariants.check_writers({k: v["writers"] for k, v in final.items()})
        r = self.cluster.redis()
        try:
            log = await asyncio.to_thread(invariants.read_log, r, self.name)
        finally:
            r.close()
        problems += invariants.check_single_writer(log)
        assert not problems, "\n".join(problems[:30])
        ends = [r for r in records if r.get("ev") == "end"]
        return {
            "calls": len(ends),
            "ok": sum(1 for r in ends if r["ok"]),
            "errors": sum(1 for r in ends if not r["ok"]),
            "acked_ops": sum(len(v) for v in acked.values()),
            "writes_logged": sum(1 for e in log if e["event"] == "write"),
            "writes_refused": sum(1 for e in log if e["event"] == "refused"),
        }


def report(scenario: str, what: str, **figures: Any) -> None:
    """Print the scenario's measured figures; append them to $REDGRAIN_PARTITION_REPORT (JSON lines)."""
    line = {"scenario": scenario, "what": what, **{k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}}
    print(f"\npartition figures: {json.dumps(line)}")
    out = os.environ.get("REDGRAIN_PARTITION_REPORT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")


async def until(cond: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not await cond():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start
