"""A dead silo with 200k directory entries is cleaned up without stalling Redis.

A real redis-server of the test's own (its SLOWLOG is ours: every command over
10 ms is logged) and a real silo. The dead silo's entries are written the way
register writes them, with a pipeline (activating 200k grains would take the
test minutes); the silo's failure detector finds the dead silo's port closed,
declares it Dead, and its rebalancer purges the entries. One script over the
whole index held Redis 0.44 s here (SLOWLOG), and the index's SMEMBERS ~30 ms;
at ~1.4M entries such a script outlasts ``dead_after_s`` and every silo fences
itself, which this test's silo must not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from typing import Any

import pytest
import redis

from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.settings import RebalancerSettings, SiloSettings
from silo.silo import Silo
from silo.testing.embedded import RedisServer, free_port
from tests.conftest import FAST_MEMBERSHIP

pytestmark = pytest.mark.slow

ENTRIES = 200_000
SLOW_US = 100_000
"""No command may take this long. The goal is 10 ms (issue 27), measured by ``python -m
benchmarks death``: SLOWLOG times commands by the wall clock, and on a shared 2-core machine a
0.7 ms purge step was logged at up to 80 ms when redis-server lost the CPU mid-script, so a test
cannot hold the goal itself without flaking. What it holds is the algorithm: the one-script purge
this replaces took 435 ms for these 200k entries here, and each bounded step is checked in the
directory contract tests."""


def fill_directory(client: redis.Redis, keys: Keys, silo: str, n: int) -> None:
    """``n`` entries naming ``silo`` and its index, as ``RedisGrainDirectory.register`` leaves them."""
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        grain = f"Counter/user-{i:07d}"
        token = f"1{i + 1:012d}"
        pipe.hset(keys.directory_entry(grain), mapping={"silo": silo, "act": uuid.uuid4().hex, "token": token})
        pipe.sadd(keys.directory_index(silo), grain)
        if i % 5_000 == 4_999:
            pipe.execute()
    pipe.execute()


async def test_a_dead_silo_with_200k_entries_is_purged_without_a_slow_command_or_a_fenced_silo() -> None:
    keys = Keys("purge")
    dead_port = free_port()  # nothing listens there: the dead silo's probes are refused
    dead = MemberRow(address=f"127.0.0.1:{dead_port}@1", host="127.0.0.1", port=dead_port, generation=1,
                     status=SiloStatus.ACTIVE, heartbeat=time.time(), grain_types=["Counter"])  # fmt: skip
    with RedisServer() as server:
        assert server.pid is not None
        # SLOWLOG times commands by the wall clock: on a machine whose cores are shared, a
        # redis-server descheduled for a few ms logs a 1 ms script as slow. Where we may,
        # its priority is raised so the log measures the scripts, not the scheduler.
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, server.pid, -10)
        sync = redis.Redis.from_url(server.url)
        try:
            sync.hset(keys.members, dead.address, dead.model_dump_json())
            fill_directory(sync, keys, dead.address, ENTRIES)
            sync.config_set("slowlog-log-slower-than", SLOW_US)
            sync.config_set("slowlog-max-len", 1024)
            sync.slowlog_reset()

            silo = Silo(SiloSettings(redis_url=server.url, cluster=keys.cluster, grains=("tests.sample_grains",),
                                     membership=FAST_MEMBERSHIP, rebalancer=RebalancerSettings(lease_ttl_s=1.0)))  # fmt: skip
            failover: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

            def on_event(kind: str, data: dict[str, Any]) -> None:
                if kind == "failover" and data["silo"] == dead.address and not failover.done():
                    failover.set_result(data)

            fenced_seen: list[float] = []

            async def watch_fence() -> None:
                while True:
                    if silo.heartbeat.fenced():
                        fenced_seen.append(silo.heartbeat.statistics().last_confirmed_age_s)
                    await asyncio.sleep(0.01)

            await silo.start()
            silo.cluster_events.add_listener(on_event)
            watcher = asyncio.ensure_future(watch_fence())
            try:
                t0 = time.monotonic()
                data = await asyncio.wait_for(failover, 60)
                took = time.monotonic() - t0
                beats = silo.heartbeat.statistics()
            finally:
                watcher.cancel()
                await silo.stop(graceful=False)

            assert data["purged"] == ENTRIES
            assert sync.scard(keys.directory_index(dead.address)) == 0
            assert next(sync.scan_iter(keys.directory_entry("*"), count=10_000), None) is None
            bound = SLOW_US
            slow = [(e["duration"], e["command"][:80]) for e in sync.slowlog_get(1024) if e["duration"] > bound]
            assert not slow, f"commands over {bound} µs: {slow}"
            assert not fenced_seen, f"the live silo fenced itself (last heartbeat {max(fenced_seen):.2f}s old)"
            assert beats.failures == 0
            slowest = max((e["duration"] for e in sync.slowlog_get(1024)), default=0)
            print(f"purged {ENTRIES} entries in {took:.2f}s; slowest command over {SLOW_US} µs: {slowest} µs ("
                  f"load {os.getloadavg()[0]:.1f}); heartbeats {beats.beats}")
        finally:
            sync.close()
