"""Silos on a real 3-master Redis Cluster: grain data spreads over every master, and a redis:// URL
of one node is taken as its whole cluster.

``redis_url`` is overridden here, so the root ``cluster`` and ``client`` fixtures start their
silos and clients on the session's Redis Cluster (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from grains.ids import SiloAddress
from silo.client import ClusterClient
from silo.cluster.directory import RedisGrainDirectory
from silo.keys import Keys, slot_of
from silo.redis_util import close_redis, connect_redis
from silo.settings import SiloSettings
from silo.silo import Silo
from silo.testing.redis_cluster import RedisClusterGroup
from tests.conftest import FAST_MEMBERSHIP
from tests.sample_grains import Counter

GRAINS = 1_000


@pytest.fixture
def redis_url(redis_cluster_url: str) -> str:
    return redis_cluster_url


def _count(group: RedisClusterGroup, pattern: str) -> dict[int, int]:
    """Keys matching ``pattern`` on each master (SCAN per node: each holds only its own slots)."""
    out = {}
    for port in group.masters():
        with group.client(port) as c:
            out[port] = sum(1 for _ in c.scan_iter(match=pattern, count=1000))
    return out


async def test_a_thousand_grains_with_state_spread_over_all_three_masters(
    cluster: Callable[..., Awaitable[list[Silo]]],
    client: ClusterClient,
    cluster_name: str,
    redis_cluster_group: RedisClusterGroup,
) -> None:
    silos = await cluster(3)
    refs = [client.get_grain(Counter, f"c{i}") for i in range(GRAINS)]
    for start in range(0, GRAINS, 100):
        assert await asyncio.gather(*(r.add(i + 1) for i, r in enumerate(refs[start : start + 100], start))) == list(
            range(start + 1, start + 101)
        )
    assert sum(s.catalog.statistics().activated_total for s in silos) >= GRAINS
    keys = Keys(cluster_name)
    heads = _count(redis_cluster_group, keys.grain_prefix("*")[:-2] + "}:state")
    entries = _count(redis_cluster_group, keys.grain_prefix("*")[:-2] + "}:dir")
    assert sum(heads.values()) == GRAINS and sum(entries.values()) == GRAINS
    assert len(heads) == 3
    for port, n in heads.items():
        assert n >= 0.15 * GRAINS, (port, heads)
    # All keys, cluster-wide records included (DBSIZE per master): no master is left out either.
    sizes = redis_cluster_group.keys_per_master()
    assert all(n >= 0.15 * sum(sizes.values()) for n in sizes.values()), sizes
    # Each grain's entry and state sit in one slot (the fenced write is one script there).
    assert slot_of(keys.directory_entry("Counter/c7")) == slot_of(keys.state_head("Counter/c7"))
    # And the state reads back through the cluster, from any silo's client.
    assert [await r.get() for r in refs[:20]] == list(range(1, 21))


async def test_a_redis_url_of_one_node_is_taken_as_its_cluster(
    redis_cluster_url: str, redis_cluster_group: RedisClusterGroup, cluster_name: str
) -> None:
    # A node that does not serve the membership slot: a plain client there would meet MOVED.
    control = redis_cluster_group.master_of(slot_of(Keys(cluster_name).members))
    node = f"redis://127.0.0.1:{next(p for p in redis_cluster_group.masters() if p != control)}/0"
    settings = SiloSettings(redis_url=node, cluster=cluster_name, grains=("tests.sample_grains",), membership=FAST_MEMBERSHIP)
    silo = await Silo(settings).start()
    try:
        async with await ClusterClient.connect(node, cluster=cluster_name) as c:
            assert type(c.redis).__name__ == "RedgrainCluster"
            # Grains on every master answer, and the heartbeat thread's sync client follows the cluster too.
            refs = [c.get_grain(Counter, f"n{i}") for i in range(60)]
            assert await asyncio.gather(*(r.add(1) for r in refs)) == [1] * 60
            assert len({p for p, n in _count(redis_cluster_group, "*:state").items() if n}) == 3
            assert await silo.heartbeat.confirm(5.0) and silo.heartbeat.failures == 0
    finally:
        await silo.stop(graceful=False)


async def test_a_dead_silos_entries_are_purged_one_pipeline_per_master(
    redis_cluster_url: str, redis_cluster_group: RedisClusterGroup, cluster_name: str
) -> None:
    # The compare-and-delete scripts of a purge step go as one pipeline to each master (they
    # went out 32 at a time, each on a connection of its own): 1,000 entries over every master,
    # purged completely, through one connection per master.
    keys = Keys(cluster_name)
    dead = SiloAddress("127.0.0.1", 9, 1)
    setup, client = connect_redis(redis_cluster_url), connect_redis(f"{redis_cluster_url}?client_name=purger")
    try:
        await setup.hset(keys.members, str(dead), json.dumps({"status": "Dead"}))
        names = [f"Counter/p{i}" for i in range(1_000)]
        pipe = setup.pipeline(transaction=False)
        for g in names:
            pipe.hset(keys.directory_entry(g), mapping={"silo": str(dead), "act": "a", "token": 1})
        await pipe.execute()
        await setup.sadd(keys.directory_index(str(dead)), *names)
        assert await RedisGrainDirectory(client, keys).purge_silo(dead) == 1_000
        assert not any(await asyncio.gather(*(setup.exists(keys.directory_entry(g)) for g in names)))
        for port in redis_cluster_group.masters():
            with redis_cluster_group.client(port) as c:
                mine = [x for x in c.client_list() if x.get("name") == "purger"]
            assert 1 <= len(mine) <= 2, (port, len(mine))
    finally:
        await close_redis(setup)
        await close_redis(client)
