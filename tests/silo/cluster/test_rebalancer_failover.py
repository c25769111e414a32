"""The leader's failover of a dead silo: purged step by step, its lease kept or given up (real Redis)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import pytest

from grains.ids import GrainId, SiloAddress
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.events import ClusterEvents
from silo.cluster.membership import RedisMembershipTable
from silo.cluster.rebalancer import Rebalancer
from silo.cluster.view import MembershipView
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.redis_util import connect_redis
from silo.settings import RebalancerSettings

LEADER, DEAD = SiloAddress("127.0.0.1", 7001, 1), SiloAddress("127.0.0.1", 7002, 1)
GRAINS = [GrainId("Counter", f"g{i}") for i in range(12)]


@dataclass
class Setup:
    rebalancer: Rebalancer
    directory: RedisGrainDirectory
    events: list[tuple[str, dict[str, Any]]]
    steps: list[float]
    """The clock's reading at each purge step."""
    redis: Any
    keys: Keys
    view: MembershipView


@pytest.fixture
async def setup(redis_url: str, cluster_name: str) -> AsyncIterator[Setup]:
    redis = connect_redis(redis_url)
    keys = Keys(cluster_name)
    table = RedisMembershipTable(redis, keys)
    for s in (LEADER, DEAD):
        await table.join(MemberRow(address=str(s), host=s.host, port=s.port, generation=s.generation))
        await table.set_status(str(s), SiloStatus.ACTIVE)
    directory = RedisGrainDirectory(redis, keys, purge_batch=2)
    for g in GRAINS:
        await directory.register(g, DEAD, f"act-{g.key}")
    await table.set_status(str(DEAD), SiloStatus.DEAD)
    view = MembershipView(table)
    await view.refresh()
    now = [0.0]
    steps: list[float] = []
    purge_batch = directory.purge_batch

    async def timed_step(silo: SiloAddress) -> Any:
        now[0] += 0.5  # each step takes half a second of the fake clock: the purge outlasts the lease
        steps.append(now[0])
        return await purge_batch(silo)

    directory.purge_batch = timed_step  # type: ignore[method-assign]
    events = ClusterEvents()
    seen: list[tuple[str, dict[str, Any]]] = []
    events.add_listener(lambda kind, data: seen.append((kind, data)))
    rebalancer = Rebalancer(
        redis=redis, keys=keys, me=LEADER, view=view, directory=directory, router=cast(Any, None),
        settings=RebalancerSettings(lease_ttl_s=1.5, period_s=5.0), events=events, clock=lambda: now[0],
    )  # fmt: skip
    try:
        yield Setup(rebalancer, directory, seen, steps, redis, keys, view)
    finally:
        await redis.aclose()


async def test_the_leader_purges_in_steps_and_keeps_its_lease_through_a_long_purge(setup: Setup) -> None:
    r = setup.rebalancer
    assert await r.lease.acquire_or_renew()
    renewals: list[int] = []
    renew = r.lease.acquire_or_renew

    async def counted() -> bool:
        renewals.append(len(setup.steps))
        return await renew()

    r.lease.acquire_or_renew = counted  # type: ignore[method-assign]
    await r.fail_over_dead()
    assert len(setup.steps) == len(GRAINS) // 2  # two grains a step
    # Six steps of 0.5 s: 3 s, twice the lease's TTL; renewed before each step after the first
    # (a third of the TTL apart), so it never lapsed.
    assert renewals == [1, 2, 3, 4, 5]
    assert [kind for kind, _ in setup.events] == ["failover"]
    assert setup.events[0][1]["purged"] == len(GRAINS)
    for g in GRAINS:
        assert await setup.directory.lookup(g) is None
    assert r.lease.held and await setup.redis.get(setup.keys.leader("rebalancer")) == str(LEADER).encode()


async def test_a_leader_that_loses_its_lease_mid_purge_stops_and_the_next_goes_on(setup: Setup) -> None:
    r = setup.rebalancer
    assert await r.lease.acquire_or_renew()
    await setup.redis.set(setup.keys.leader("rebalancer"), "someone-else")  # the lease lapsed and was taken
    await r.fail_over_dead()
    assert 0 < len(setup.steps) < len(GRAINS) // 2 and not r.lease.held
    assert setup.events == []  # not done: no failover event yet
    left = await setup.directory.entries_of(DEAD)
    assert left and len(left) < len(GRAINS)
    # The next leader (here: this one, again) finds the index not empty and finishes it.
    await setup.redis.delete(setup.keys.leader("rebalancer"))
    assert await r.lease.acquire_or_renew()
    await r.fail_over_dead()
    assert await setup.directory.entries_of(DEAD) == []
    assert [kind for kind, _ in setup.events] == ["failover"]


async def test_a_follower_takes_the_lease_of_a_leader_declared_dead_at_once_and_of_a_live_one_never(
    setup: Setup,
) -> None:
    key = setup.keys.leader("rebalancer")
    third = SiloAddress("127.0.0.1", 7003, 1)
    r = Rebalancer(
        redis=setup.redis, keys=setup.keys, me=third, view=setup.view, directory=setup.directory,
        router=cast(Any, None), settings=RebalancerSettings(), events=ClusterEvents(),
    )  # fmt: skip
    await setup.redis.set(key, str(LEADER), px=60_000)  # a live holder
    assert not await r.acquire()
    assert r.lease.other == str(LEADER) and 50.0 < r.lease.other_left_s <= 60.0  # it sleeps that long
    assert not await r.acquire()  # LEADER is Active: its lease stands
    await setup.redis.set(key, str(DEAD), px=60_000)  # the lease of a silo declared Dead
    assert not await r.acquire()  # learns who holds it
    assert await r.acquire()  # and takes it without waiting the minute out
    assert await setup.redis.get(key) == b"127.0.0.1:7003@1"
