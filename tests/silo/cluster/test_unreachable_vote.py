"""The unreachable vote's Lua script on a real Redis: Redis' clock, a window, live voters only."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from silo.cluster.membership import RedisMembershipTable
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus


async def _table(redis_url: str, cluster: str, n: int) -> tuple[RedisMembershipTable, list[str], aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    table = RedisMembershipTable(r, Keys(cluster))
    names = []
    for i in range(n):
        row = MemberRow(address=f"10.0.0.{i}:7000@{i}", host=f"10.0.0.{i}", port=7000, generation=i,
                        status=SiloStatus.ACTIVE)  # fmt: skip
        await table.join(row)
        names.append(row.address)
    return table, names, r


async def test_votes_count_only_within_the_window(redis_url: str, cluster_name: str) -> None:
    table, (a, b, c), r = await _table(redis_url, cluster_name, 3)
    try:
        assert (await table.vote_unreachable(c, a, 2, 0.3)).result == "voted"
        await asyncio.sleep(0.4)  # Redis' clock decides: there is nothing to await
        outcome = await table.vote_unreachable(c, b, 2, 0.3)
        assert (outcome.result, outcome.votes) == ("voted", 1), "a's stale vote still counted"
        outcome = await table.vote_unreachable(c, a, 2, 0.3)
        assert (outcome.result, outcome.votes) == ("declared", 2)
        _, rows = await table.read_all()
        assert rows[c].status is SiloStatus.DEAD
        assert (await table.vote_unreachable(c, a, 2, 0.3)).result == "dead"
    finally:
        await r.aclose()


async def test_a_dead_voter_is_refused_and_its_earlier_vote_stops_counting(redis_url: str, cluster_name: str) -> None:
    table, (a, b, c), r = await _table(redis_url, cluster_name, 3)
    try:
        assert (await table.vote_unreachable(c, a, 2, 10.0)).result == "voted"
        # c and a voted each other out in turn would leave nobody; a is out first.
        await table.set_status(a, SiloStatus.DEAD)
        assert (await table.vote_unreachable(b, a, 1, 10.0)).result == "refused"
        outcome = await table.vote_unreachable(c, b, 2, 10.0)
        assert (outcome.result, outcome.votes) == ("voted", 1)
        _, rows = await table.read_all()
        assert rows[b].status is rows[c].status is SiloStatus.ACTIVE
    finally:
        await r.aclose()
