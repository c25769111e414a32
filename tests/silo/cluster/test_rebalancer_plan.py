"""The rebalancer's plan: who gives how many activations to whom (pure: a membership twin, no Redis)."""

from __future__ import annotations

from typing import Any, cast

import redis.asyncio as aioredis

from grains.ids import SiloAddress
from silo.cluster.events import ClusterEvents
from silo.cluster.rebalancer import Rebalancer
from silo.cluster.view import MembershipView
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloLoad, SiloStatus
from silo.settings import RebalancerSettings
from silo.testing.membership import InMemoryMembershipTable

ME = SiloAddress("127.0.0.1", 6999, 1)


async def planner(counts: list[int], **settings: Any) -> tuple[Rebalancer, list[str]]:
    table = InMemoryMembershipTable()
    addresses = []
    for i, n in enumerate(counts):
        address = f"127.0.0.1:{7000 + i}@1"
        await table.join(MemberRow(address=address, host="127.0.0.1", port=7000 + i, generation=1))
        await table.set_status(address, SiloStatus.ACTIVE)
        await table.heartbeat(address, 1.0, SiloLoad(activations=n))
        addresses.append(address)
    view = MembershipView(table)
    await view.refresh()
    rebalancer = Rebalancer(
        redis=aioredis.Redis(),  # never connected: plan() reads only the view
        keys=Keys("plan"),
        me=ME,
        view=view,
        directory=cast(Any, None),
        router=cast(Any, None),
        settings=RebalancerSettings(**settings),
        events=ClusterEvents(),
        clock=lambda: 0.0,
    )
    return rebalancer, addresses


async def test_a_new_silo_among_a_hundred_draws_from_every_silo_above_the_mean() -> None:
    # No silo is above mean * 1.2 (the mean is 9,901): the old rule moved nothing at all.
    rebalancer, addresses = await planner([10_000] * 100 + [0], max_moves_per_period=20)
    plan = rebalancer.plan()
    assert len(plan) == 100
    assert all(k == 20 and targets == [addresses[-1]] for _, k, targets in plan)
    assert {str(source) for source, _, _ in plan} == set(addresses[:-1])


async def test_the_budget_is_each_sources_and_never_more_than_its_surplus() -> None:
    rebalancer, addresses = await planner([1_000, 30, 0], max_moves_per_period=20)
    assert [(str(s), k) for s, k, _ in rebalancer.plan()] == [(addresses[0], 20)]
    rebalancer, addresses = await planner([130, 100, 70], max_moves_per_period=1_000, tolerance=0.2)
    # 130 > 100 * 1.2: it gives down to the mean, 30, not its whole budget.
    assert [(str(s), k, t) for s, k, t in rebalancer.plan()] == [(addresses[0], 30, [addresses[2]])]


async def test_a_cluster_within_the_tolerance_moves_nothing() -> None:
    rebalancer, _ = await planner([10_500, 9_500, 10_200, 9_800], max_moves_per_period=20, tolerance=0.2)
    assert rebalancer.plan() == []
    rebalancer, _ = await planner([10_000] * 5, max_moves_per_period=20)
    assert rebalancer.plan() == []
    rebalancer, _ = await planner([10_000, 0], max_moves_per_period=0)
    assert rebalancer.plan() == []
