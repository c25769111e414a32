"""The membership table's contract, run on the in-memory twin and on the Redis table alike (on
redis-server, a Redis Cluster, and the simulator's command-level twin)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from grains.ids import SiloAddress
from silo import errors
from silo.cluster.membership import FEED_LENGTH, RedisMembershipTable, VoteOutcome
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloLoad, SiloStatus
from silo.redis_util import close_redis, connect_redis
from silo.testing.membership import InMemoryMembershipTable

Table = InMemoryMembershipTable | RedisMembershipTable
A, B, C, S = (SiloAddress("127.0.0.1", 7000 + i, 1) for i in range(4))


def _row(s: SiloAddress, **kw: Any) -> MemberRow:
    return MemberRow(address=str(s), host=s.host, port=s.port, generation=s.generation, **kw)


@pytest.fixture(params=["memory", "redis", "redis-cluster", "twin"])
async def table(request: pytest.FixtureRequest) -> AsyncIterator[Table]:
    if request.param == "memory":
        yield InMemoryMembershipTable()
        return
    if request.param == "twin":
        # The simulator's command-level twin (fakeredis): the table's scripts, run on it.
        from silo.testing.sim import redis_twin

        twin = redis_twin.client(redis_twin.new_server(), "contract", linked=False)
        try:
            yield RedisMembershipTable(twin, Keys("contract"))
        finally:
            await close_redis(twin)
        return
    redis = connect_redis(request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url"))
    try:
        yield RedisMembershipTable(redis, Keys("contract"))
    finally:
        await close_redis(redis)


async def _active(table: Table, *silos: SiloAddress, heartbeat: float = 100.0) -> None:
    for s in silos:
        await table.join(_row(s, heartbeat=heartbeat))
        await table.set_status(str(s), SiloStatus.ACTIVE)


async def test_generations_count_up_from_one(table: Table) -> None:
    assert [await table.new_generation() for _ in range(3)] == [1, 2, 3]


async def test_join_and_status_changes_bump_one_version(table: Table) -> None:
    assert await table.read_all() == (0, {})
    assert await table.join(_row(A, roles=["gpu"], grain_types=["Counter"])) == 1
    assert await table.join(_row(B)) == 2
    assert await table.set_status(str(A), SiloStatus.ACTIVE) == 3
    version, rows = await table.read_all()
    assert version == 3 and set(rows) == {str(A), str(B)}
    assert rows[str(A)].status is SiloStatus.ACTIVE and rows[str(B)].status is SiloStatus.JOINING
    # The script rewrote A's row: every field survives, empty lists included.
    assert rows[str(A)].roles == ["gpu"] and rows[str(A)].grain_types == ["Counter"]
    assert rows[str(A)].silo == A
    await table.set_status(str(B), SiloStatus.SHUTTING_DOWN)
    assert (await table.read_all())[1][str(B)].roles == []


async def test_status_of_an_unknown_or_dead_silo_cannot_change(table: Table) -> None:
    with pytest.raises(errors.MembershipError):
        await table.set_status(str(A), SiloStatus.ACTIVE)
    await _active(table, A)
    await table.set_status(str(A), SiloStatus.DEAD)
    with pytest.raises(errors.MembershipError):
        await table.set_status(str(A), SiloStatus.ACTIVE)
    assert (await table.read_all())[1][str(A)].status is SiloStatus.DEAD


async def test_heartbeat_updates_the_row_without_a_new_version(table: Table) -> None:
    assert await table.heartbeat(str(A), 1.0, SiloLoad()) is None  # not in the table
    await _active(table, A)
    version, _ = await table.read_all()
    at = 1_700_000_000.123456
    load = SiloLoad(cpu_percent=12.5, memory_percent=3.0, activations=7)
    assert await table.heartbeat(str(A), at, load) is SiloStatus.ACTIVE
    new_version, rows = await table.read_all()
    assert new_version == version
    # The heartbeat is a field of its own (not the row through Lua's cjson): full precision.
    assert rows[str(A)].heartbeat == at
    assert rows[str(A)].load == load
    watch = await table.watch(version, heartbeats=[str(A), str(B)], loads=[str(A)])
    assert watch.changes == [] and watch.heartbeats == {str(A): at} and watch.loads == {str(A): load}


async def test_a_dead_row_takes_no_heartbeat(table: Table) -> None:
    await _active(table, A, heartbeat=5.0)
    await table.set_status(str(A), SiloStatus.DEAD)
    assert await table.heartbeat(str(A), 99.0, SiloLoad(activations=1)) is SiloStatus.DEAD
    row = (await table.read_all())[1][str(A)]
    assert row.heartbeat == 5.0 and row.load == SiloLoad()


async def test_votes_on_the_seen_heartbeat_declare_the_suspect_dead(table: Table) -> None:
    await _active(table, A, B, C, S, heartbeat=100.0)
    version, _ = await table.read_all()
    assert await table.vote_dead(str(S), str(A), 100.0, 2) == _outcome("voted", 1)
    assert await table.vote_dead(str(S), str(A), 100.0, 2) == _outcome("voted", 1)  # one voter, one vote
    assert await table.vote_dead(str(S), str(B), 100.0, 2) == _outcome("declared", 2)
    new_version, rows = await table.read_all()
    assert rows[str(S)].status is SiloStatus.DEAD and new_version == version + 1
    assert await table.vote_dead(str(S), str(C), 100.0, 2) == _outcome("dead", 0)
    assert await table.vote_dead("127.0.0.1:1@1", str(C), 100.0, 2) == _outcome("gone", 0)


async def test_a_moved_heartbeat_voids_the_votes(table: Table) -> None:
    await _active(table, A, B, S, heartbeat=100.0)
    assert await table.vote_dead(str(S), str(A), 100.0, 2) == _outcome("voted", 1)
    await table.heartbeat(str(S), 101.0, SiloLoad())
    assert await table.vote_dead(str(S), str(B), 100.0, 2) == _outcome("alive", 0)  # B looked too early
    # A's old vote went with it: a vote on the new heartbeat starts the count again.
    assert await table.vote_dead(str(S), str(B), 101.0, 2) == _outcome("voted", 1)
    assert await table.vote_dead(str(S), str(A), 101.0, 1) == _outcome("declared", 2)


async def test_unreachable_votes_count_only_from_voters_not_dead(table: Table) -> None:
    await _active(table, A, B, C, S)
    assert await table.vote_unreachable(str(S), str(A), 2, 30.0) == _outcome("voted", 1)
    await table.set_status(str(A), SiloStatus.DEAD)
    assert await table.vote_unreachable(str(S), str(A), 2, 30.0) == _outcome("refused", 0)
    assert await table.vote_unreachable(str(S), str(B), 2, 30.0) == _outcome("voted", 1)  # A's no longer counts
    assert await table.vote_unreachable(str(S), str(C), 2, 30.0) == _outcome("declared", 2)
    assert (await table.read_all())[1][str(S)].status is SiloStatus.DEAD
    assert await table.vote_unreachable(str(S), str(B), 2, 30.0) == _outcome("dead", 0)
    assert await table.vote_unreachable("127.0.0.1:1@1", str(B), 2, 30.0) == _outcome("gone", 0)


async def test_needed_votes_are_at_least_one(table: Table) -> None:
    await _active(table, A, S)
    assert await table.vote_dead(str(S), str(A), 100.0, 0) == _outcome("declared", 1)


async def test_remove_forgets_a_row_and_tells_the_feed(table: Table) -> None:
    await _active(table, A, B)
    version, _ = await table.read_all()
    await table.moved(str(A), version, [str(B)])  # A's detector keeps the heartbeat of B it saw
    await table.remove(str(A))
    assert await table.read_all() == (version + 1, {str(B): (await table.read_all())[1][str(B)]})
    watch = await table.watch(version)
    assert watch.version == version + 1 and watch.changes == [(str(A), None)]
    # Its detector's seen-hash went with the row: nothing A saw can count as a vote any more.
    assert await table.vote_dead(str(B), str(A), None, 1) == _outcome("alive", 0)


async def test_the_feed_gives_each_change_once_in_order(table: Table) -> None:
    await _active(table, A, heartbeat=5.0)
    version, _ = await table.read_all()
    await table.join(_row(B, heartbeat=6.0))
    await table.set_status(str(B), SiloStatus.ACTIVE)
    await table.set_status(str(A), SiloStatus.SHUTTING_DOWN)
    watch = await table.watch(version)
    assert watch.version == version + 3
    assert watch.changes is not None
    assert [(a, r.status if r else None) for a, r in watch.changes] == [
        (str(B), SiloStatus.JOINING), (str(B), SiloStatus.ACTIVE), (str(A), SiloStatus.SHUTTING_DOWN),
    ]  # fmt: skip
    assert (await table.watch(watch.version)).changes == []
    assert (await table.watch(-1)).changes is None, "a reader with nothing reads the table"


async def test_a_reader_behind_the_feed_is_told_to_read_the_table(table: Table) -> None:
    await _active(table, A)
    version, _ = await table.read_all()
    for _ in range(FEED_LENGTH + 250):  # more changes than the capped feed keeps
        await table.set_status(str(A), SiloStatus.ACTIVE)
    assert (await table.watch(version)).changes is None
    latest, _ = await table.read_all()
    recent = await table.watch(latest - 5)
    assert recent.changes is not None and len(recent.changes) == 5


async def test_a_declared_death_is_in_the_feed_with_the_last_heartbeat(table: Table) -> None:
    await _active(table, A, B, S, heartbeat=5.0)
    await table.heartbeat(str(S), 7.5, SiloLoad())
    version, _ = await table.read_all()
    await table.vote_dead(str(S), str(A), 7.5, 2)
    await table.vote_dead(str(S), str(B), 7.5, 2)
    watch = await table.watch(version)
    assert watch.changes is not None and len(watch.changes) == 1
    addr, row = watch.changes[0]
    assert addr == str(S) and row is not None and row.status is SiloStatus.DEAD and row.heartbeat == 7.5


def _outcome(result: str, votes: int) -> VoteOutcome:
    return VoteOutcome(result, votes)


async def test_moved_flags_each_watched_heartbeat_once_per_change_per_watcher(table: Table) -> None:
    await _active(table, A, B, S, heartbeat=5.0)
    version, _ = await table.read_all()
    first = await table.moved(str(A), version, [str(B), str(S), str(C)])
    assert first.version == version and first.changes == []
    assert first.moved == {str(B): True, str(S): True, str(C): False}  # new to A; C has no row
    assert (await table.moved(str(A), version, [str(B), str(S)])).moved == {str(B): False, str(S): False}
    await table.heartbeat(str(S), 6.0, SiloLoad())
    assert (await table.moved(str(A), version, [str(B), str(S)])).moved == {str(B): False, str(S): True}
    assert (await table.moved(str(B), version, [str(S)])).moved == {str(S): True}, "each watcher its own"
    await table.set_status(str(B), SiloStatus.SHUTTING_DOWN)
    later = await table.moved(str(A), version, [str(S)])
    assert later.version == version + 1 and later.changes is not None and [a for a, _ in later.changes] == [str(B)]


async def test_a_vote_without_a_value_names_what_the_voters_last_read_saw(table: Table) -> None:
    await _active(table, A, B, S, heartbeat=5.0)
    version, _ = await table.read_all()
    assert (await table.vote_dead(str(S), str(A), None, 2)).result == "alive", "A never read S"
    await table.moved(str(A), version, [str(S)])
    await table.moved(str(B), version, [str(S)])
    assert await table.vote_dead(str(S), str(A), None, 2) == VoteOutcome("voted", 1)
    await table.heartbeat(str(S), 9.0, SiloLoad())  # S beats before B votes: B's read is stale
    assert (await table.vote_dead(str(S), str(B), None, 2)).result == "alive"
    await table.moved(str(A), version, [str(S)])
    await table.moved(str(B), version, [str(S)])
    assert await table.vote_dead(str(S), str(A), None, 2) == VoteOutcome("voted", 1)
    assert await table.vote_dead(str(S), str(B), None, 2) == VoteOutcome("declared", 2)
