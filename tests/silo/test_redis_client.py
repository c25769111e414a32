"""The Redis client under load and after a failover: a busy pool waits and says so when it runs
out; a master without its replica is not waited on (silo/redis_util.py)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import redis

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.cluster.directory import RedisGrainDirectory
from silo.keys import Keys
from silo.redis_util import close_redis, connect_redis, redis_statistics, replication_statistics
from silo.testing.embedded import RedisServer

ME = SiloAddress("127.0.0.1", 7100, 1)
BURST = 1_000
DEADLINE_S = 5.0
"""A grain call's default deadline: every registration of the burst must finish within it."""


async def _directory(url: str, cluster: str) -> tuple[RedisGrainDirectory, Keys]:
    keys = Keys(cluster)
    directory = RedisGrainDirectory(connect_redis(url), keys)
    await directory._redis.hset(keys.members, str(ME), json.dumps({"status": "Active"}))
    return directory, keys


async def test_a_burst_of_registrations_through_three_connections_waits_for_them_while_redis_sleeps(
    tmp_path: Path, cluster_name: str
) -> None:
    with RedisServer(data_dir=tmp_path, extra_args=("--enable-debug-command", "yes")) as server:
        directory, _ = await _directory(f"{server.url}?max_connections=3", cluster_name)
        client = directory._redis
        slow = redis.asyncio.Redis.from_url(server.url)
        try:
            async def slow_bursts() -> None:
                # Redis answers nobody for 50 ms, five times: the three connections fill up
                # and the burst queues for them.
                for _ in range(5):
                    await slow.execute_command("DEBUG", "SLEEP", "0.05")
                    await asyncio.sleep(0)

            async def register(i: int) -> GrainId:
                g = GrainId("Counter", f"g{i}")
                entry = await asyncio.wait_for(directory.register(g, ME, f"a{i}"), DEADLINE_S)
                assert entry.silo == ME
                return g

            done = await asyncio.gather(slow_bursts(), *(register(i) for i in range(BURST)))
            assert len(done) == BURST + 1
            stats = redis_statistics(client)
            assert stats.pool_size == 3
            assert stats.pool_waits > 0 and stats.pool_exhausted == 0, stats
            assert stats.pool_wait_s > 0
        finally:
            await slow.aclose()
            await close_redis(client)


async def test_an_exhausted_pool_says_so_not_that_redis_is_unreachable(redis_url: str, cluster_name: str) -> None:
    keys = Keys(cluster_name)
    client = connect_redis(f"{redis_url}?max_connections=1", timeout_s=0.3)
    directory = RedisGrainDirectory(client, keys)
    try:
        held = await client.connection_pool.get_connection()  # the pool's only connection, in use
        try:
            with pytest.raises(errors.StorageError, match="pool exhausted") as info:
                await directory.register(GrainId("Counter", "waits"), ME, "a")
            assert "unreachable" not in str(info.value)
        finally:
            await client.connection_pool.release(held)
        assert redis_statistics(client).pool_exhausted == 1
        # Redis was fine all along: with the connection back, the next call goes through.
        assert await client.ping()
    finally:
        await close_redis(client)


async def _replicas_online(master: RedisServer, n: int) -> None:
    """Until ``master`` reports ``n`` replicas online (a replica process starting, syncing)."""
    r = redis.asyncio.Redis.from_url(master.url)
    try:
        deadline = time.monotonic() + 20
        while sum(1 for k, v in (await r.info("replication")).items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online") != n:
            assert time.monotonic() < deadline, f"{n} replica(s) never connected"
            await asyncio.sleep(0.05)
    finally:
        await r.aclose()


async def test_a_master_without_replicas_is_not_waited_on_until_one_connects(tmp_path: Path, cluster_name: str) -> None:
    # After a failover the promoted master has no replica: waiting wait_timeout_ms on every
    # write for one (and pausing a second after each) was a lasting penalty. The policy reads
    # the master's replicas (cached 1 s) and waits again once one is online.
    with RedisServer(data_dir=tmp_path / "m", extra_args=("--repl-diskless-sync-delay", "0")) as master:
        # A long timeout: no write waits while the master has no replica, and once it has one a
        # loaded machine's replica may take more than a fraction of a second to acknowledge
        # (200 ms gave one short wait and four skipped writes in CI).
        directory, _ = await _directory(f"{master.url}?wait_replicas=1&wait_timeout_ms=3000", cluster_name)
        client = directory._redis
        now = [0.0]
        client.replication.clock = lambda: now[0]  # type: ignore[attr-defined]
        try:
            for i in range(10):
                await directory.register(GrainId("Counter", f"alone{i}"), ME, f"a{i}")
                now[0] += 2.0  # past the 1 s pause after a short wait, each time
            rep = replication_statistics(client)
            assert rep is not None
            assert (rep.waits, rep.short_waits, rep.replica_less) == (0, 0, 10), rep
            assert rep.short_replication == 10 and rep.replica_less_masters == 1
            assert redis_statistics(client).short_replication == 10

            extra = ("--replicaof", master.host, str(master.port))
            with RedisServer(data_dir=tmp_path / "r", extra_args=extra):
                await _replicas_online(master, 1)
                now[0] += 2.0  # the cached count expires: read again, one replica now
                for i in range(5):
                    await directory.register(GrainId("Counter", f"replicated{i}"), ME, f"b{i}")
            rep = replication_statistics(client)
            assert rep is not None
            assert (rep.waits, rep.short_waits, rep.replica_less) == (5, 0, 10), rep
            assert rep.replica_less_masters == 0
        finally:
            await close_redis(client)
