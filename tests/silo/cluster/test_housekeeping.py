"""Housekeeping deletes long-dead silos' rows and keys, and nothing else (real Redis, fake clock)."""

from __future__ import annotations

import pytest

from grains.ids import GrainId, SiloAddress
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.housekeeping import Housekeeper
from silo.cluster.membership import RedisMembershipTable
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.redis_util import connect_redis
from silo.settings import RetentionSettings


def row(port: int, status: SiloStatus, heartbeat: float) -> MemberRow:
    return MemberRow(address=f"127.0.0.1:{port}@1", host="127.0.0.1", port=port, generation=1,
                     status=status, heartbeat=heartbeat)  # fmt: skip


async def test_sweep_deletes_only_rows_dead_longer_than_the_retention(redis_url: str, cluster_name: str) -> None:
    redis = connect_redis(redis_url)
    keys = Keys(cluster_name)
    table = RedisMembershipTable(redis, keys)
    directory = RedisGrainDirectory(redis, keys)
    now = 10_000.0
    old_dead, new_dead, old_live = row(1, SiloStatus.DEAD, now - 700), row(2, SiloStatus.DEAD, now - 10), row(3, SiloStatus.ACTIVE, now - 700)
    for r in (old_dead, new_dead, old_live):
        await table.join(r)
    a = old_dead.address
    # What a dead silo leaves behind: votes against it, an unread control request, its stats
    # and history, its place in the stats index, and a directory entry it still owned.
    await redis.sadd(keys.suspicions(a), "voter")
    await redis.rpush(keys.control(a), "{}")
    await redis.set(keys.silo_stats(a), "{}")
    await redis.lpush(keys.silo_stats_history(a), "{}")
    await redis.zadd(keys.silo_stats_index, {a: now - 700, new_dead.address: now - 10})
    await directory.register(GrainId("Echo", "e1"), SiloAddress.parse(old_live.address), "act-1")
    await redis.hset(keys.directory_entry("Echo/e2"), mapping={"silo": a, "activation": "x", "token": "7"})
    await redis.sadd(keys.directory_index(a), "Echo/e2")

    keeper = Housekeeper(redis, keys, table, directory, RetentionSettings(dead_silo_s=600), clock=lambda: now)
    try:
        assert await keeper.sweep() == 1
        _, rows = await table.read_all()
        assert set(rows) == {new_dead.address, old_live.address}
        for key in (keys.suspicions(a), keys.control(a), keys.silo_stats(a), keys.silo_stats_history(a),
                    keys.directory_index(a), keys.directory_entry("Echo/e2")):  # fmt: skip
            assert not await redis.exists(key), key
        assert await redis.zrange(keys.silo_stats_index, 0, -1) == [new_dead.address.encode()]
        assert await directory.lookup(GrainId("Echo", "e1")) is not None  # a live silo's entry stays
        assert await keeper.sweep() == 0  # nothing more; a second sweep (or another silo's) is harmless
        assert keeper.statistics().removed_silos == 1
    finally:
        await redis.aclose()


@pytest.mark.parametrize("status", [SiloStatus.ACTIVE, SiloStatus.SHUTTING_DOWN])
async def test_a_silo_that_is_not_dead_is_never_removed_however_old_its_heartbeat(
    redis_url: str, cluster_name: str, status: SiloStatus
) -> None:
    redis = connect_redis(redis_url)
    keys = Keys(cluster_name)
    table = RedisMembershipTable(redis, keys)
    await table.join(row(4, status, 0.0))
    keeper = Housekeeper(redis, keys, table, RedisGrainDirectory(redis, keys), RetentionSettings(dead_silo_s=0))
    try:
        assert await keeper.sweep() == 0
        assert len((await table.read_all())[1]) == 1
    finally:
        await redis.aclose()
