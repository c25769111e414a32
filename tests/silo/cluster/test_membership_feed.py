"""Views follow the membership change feed: a change costs the changed rows, never the table."""

from __future__ import annotations

import asyncio
from typing import Any

from grains.ids import SiloAddress
from silo.client import ClusterClient
from silo.cluster.membership import FEED_LENGTH, RedisMembershipTable
from silo.cluster.view import MembershipView
from silo.records.membership import MemberRow, SiloLoad, SiloStatus
from silo.testing.membership import InMemoryMembershipTable

A, B, C = (SiloAddress("127.0.0.1", 7100 + i, 1) for i in range(3))


def _row(s: SiloAddress) -> MemberRow:
    return MemberRow(address=str(s), host=s.host, port=s.port, generation=1, heartbeat=50.0)


async def _active(table: Any, *silos: SiloAddress) -> None:
    for s in silos:
        await table.join(_row(s))
        await table.set_status(str(s), SiloStatus.ACTIVE)


async def test_a_view_applies_changes_from_the_feed_without_reading_the_table() -> None:
    table = InMemoryMembershipTable()
    await _active(table, A, B)
    view = MembershipView(table)
    seen: list[tuple[dict[str, MemberRow], dict[str, MemberRow]]] = []
    view.on_change(lambda old, new: seen.append((old, new)))
    await view.refresh()
    assert table.full_reads == 1
    await _active(table, C)
    await table.set_status(str(B), SiloStatus.DEAD)
    await table.remove(str(A))
    await view.catch_up()
    assert table.full_reads == 1, "the changes came from the feed"
    assert view.version == table.version
    assert set(view.rows) == {str(B), str(C)}
    assert view.is_dead(B) and view.is_active(C) and view.is_dead(A)
    assert seen and seen[-1][1][str(B)].status is SiloStatus.DEAD
    await view.catch_up()  # nothing new: no listener call, still no table read
    assert len(seen) == 2 and table.full_reads == 1


async def test_a_view_behind_the_feeds_reach_reads_the_table_once() -> None:
    table = InMemoryMembershipTable()
    await _active(table, A, B)
    view = MembershipView(table)
    await view.refresh()
    for _ in range(FEED_LENGTH):  # the feed keeps FEED_LENGTH changes: the view's next one is gone
        await table.set_status(str(A), SiloStatus.ACTIVE)
    await table.set_status(str(B), SiloStatus.DEAD)
    await view.catch_up()
    assert table.full_reads == 2
    assert view.version == table.version and view.is_dead(B)
    await table.set_status(str(A), SiloStatus.SHUTTING_DOWN)
    await view.catch_up()
    assert table.full_reads == 2, "back within reach: the feed again"
    assert view.rows[str(A)].status is SiloStatus.SHUTTING_DOWN


async def test_a_view_samples_loads_in_turn_and_keeps_them_across_changes() -> None:
    table = InMemoryMembershipTable()
    await _active(table, A, B, C)
    view = MembershipView(table, load_sample=1)
    await view.refresh()
    for i, s in enumerate((A, B, C)):
        await table.heartbeat(str(s), 60.0, SiloLoad(activations=10 + i))
    for _ in range(3):  # one silo's load a poll, each in turn
        await view.catch_up(loads=True)
    assert [view.rows[str(s)].load.activations for s in (A, B, C)] == [10, 11, 12]
    await table.set_status(str(B), SiloStatus.SHUTTING_DOWN)
    await view.catch_up()
    assert view.rows[str(B)].load.activations == 11, "a status change does not forget the load"


async def test_a_client_learns_a_death_from_the_feed_without_a_full_read(redis_url: str, cluster_name: str) -> None:
    client = await ClusterClient.connect(redis_url, cluster=cluster_name)
    try:
        table = RedisMembershipTable(client.redis, client.keys)
        await _active(table, A, B, C)
        await client.view.catch_up()  # (pub/sub would tell it too; the test must not race it)
        assert client.view.is_active(C)
        full_reads = client.view.statistics().refreshes
        dead = asyncio.Event()
        client.view.on_change(lambda old, new: dead.set() if new[str(C)].status is SiloStatus.DEAD else None)
        await table.heartbeat(str(C), 77.0, SiloLoad())
        assert (await table.vote_dead(str(C), str(A), 77.0, 2)).result == "voted"
        assert (await table.vote_dead(str(C), str(B), 77.0, 2)).result == "declared"
        await asyncio.wait_for(dead.wait(), 5.0)  # told by the channel, read from the feed
        assert client.view.is_dead(C) and client.view.is_active(A)
        assert client.view.statistics().refreshes == full_reads, "no whole-table read"
        assert client.view.rows[str(C)].heartbeat == 77.0
    finally:
        await client.close()
