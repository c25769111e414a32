"""The grain directory's contract, run on the in-memory twin and on the Redis directory alike.

Each backend comes with a membership table of its kind (the directory asks it who is live):
the twin reads an in-memory table, the Redis directory the rows in Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.cluster.directory import PurgedBatch, RedisGrainDirectory
from silo.cluster.membership import MembershipTable, RedisMembershipTable
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.redis_util import close_redis, connect_redis
from silo.testing.directory import InMemoryGrainDirectory
from silo.testing.membership import InMemoryMembershipTable

A, B, C = (SiloAddress("127.0.0.1", 7000 + i, 1) for i in range(3))
G = GrainId("Counter", "g")
BATCH = 4
"""Purge step bound in these tests: small, so a purge of a few grains takes several steps."""


@dataclass
class World:
    directory: InMemoryGrainDirectory | RedisGrainDirectory
    table: MembershipTable
    step: int = BATCH
    """A purge step's bound: BATCH per master (a Cluster's step spreads over its masters)."""

    async def live(self, *silos: SiloAddress) -> None:
        for s in silos:
            await self.table.join(MemberRow(address=str(s), host=s.host, port=s.port, generation=s.generation))
            await self.table.set_status(str(s), SiloStatus.ACTIVE)

    async def kill(self, silo: SiloAddress) -> None:
        await self.table.set_status(str(silo), SiloStatus.DEAD)


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def world(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    if request.param == "memory":
        table = InMemoryMembershipTable()
        w = World(InMemoryGrainDirectory(table.is_alive, purge_batch=BATCH), table)
        await w.live(A, B)
        yield w
        return
    redis = connect_redis(request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url"))
    keys = Keys("contract")
    masters = 1 if request.param == "redis" else len(request.getfixturevalue("redis_cluster_group").masters())
    w = World(RedisGrainDirectory(redis, keys, purge_batch=BATCH), RedisMembershipTable(redis, keys), BATCH * masters)
    await w.live(A, B)
    try:
        yield w
    finally:
        await close_redis(redis)


async def test_first_register_wins_with_a_token_and_lookup_finds_it(world: World) -> None:
    d = world.directory
    assert await d.lookup(G) is None
    entry = await d.register(G, A, "a1")
    assert (entry.silo, entry.activation_id) == (A, "a1") and entry.token > 0
    assert await d.lookup(G) == entry
    assert d.cached(G) == entry


async def test_a_second_registrant_gets_the_live_winner_back(world: World) -> None:
    d = world.directory
    first = await d.register(G, A, "a1")
    assert await d.register(G, B, "b1") == first
    assert await d.lookup(G) == first
    # The winner's own silo registering again (a stale retry, another activation) gets the same entry.
    assert await d.register(G, A, "a2") == first
    stats = d.statistics()
    assert (stats.registrations, stats.conflicts) == (1, 2)


async def test_a_grains_fencing_tokens_increase_across_registrations_and_takeovers(world: World) -> None:
    # Tokens are compared per grain (the state store's fence), so they rise per grain; the
    # Redis directory keeps one counter per hash slot, not one for the whole cluster.
    d = world.directory
    tokens = []
    for i in range(3):
        tokens.append((await d.register(G, A, f"a{i}")).token)
        assert await d.unregister(G, A, f"a{i}")
    assert tokens == sorted(set(tokens))
    held = await d.register(G, A, "a9")
    await world.kill(A)
    taken = await d.register(G, B, "b0")
    assert taken.silo == B and taken.token > held.token > tokens[-1]


async def test_a_registrant_that_is_not_live_is_refused(world: World) -> None:
    d = world.directory
    with pytest.raises(errors.MembershipError):
        await d.register(G, C, "c1")  # never joined
    await world.kill(B)
    with pytest.raises(errors.MembershipError):
        await d.register(G, B, "b1")
    assert await d.lookup(G) is None


async def test_the_entry_of_a_dead_silo_is_taken_over_and_leaves_its_index(world: World) -> None:
    d = world.directory
    await d.register(G, A, "a1")
    assert await d.entries_of(A) == [G]
    await world.kill(A)
    entry = await d.register(G, B, "b1")
    assert (entry.silo, entry.activation_id) == (B, "b1")
    assert await d.entries_of(A) == []
    assert await d.entries_of(B) == [G]


async def test_unregister_deletes_only_the_named_activation(world: World) -> None:
    d = world.directory
    entry = await d.register(G, A, "a1")
    assert not await d.unregister(G, A, "someone-else")
    assert await d.lookup(G) == entry
    assert await d.unregister(G, A, "a1")
    assert await d.lookup(G) is None
    assert d.cached(G) is None
    assert not await d.unregister(G, A, "a1")
    assert d.statistics().unregistrations == 1


async def test_purge_removes_what_a_dead_silo_still_owns(world: World) -> None:
    d = world.directory
    mine = [GrainId("Counter", f"a{i}") for i in range(3)]
    for g in mine:
        await d.register(g, A, f"act-{g.key}")
    theirs = await d.register(GrainId("Counter", "b"), B, "b1")
    await world.kill(A)
    moved = await d.register(mine[0], B, "b-moved")  # one was taken over before the purge
    assert await d.purge_silo(A) == 2
    for g in mine[1:]:
        assert await d.lookup(g) is None and d.cached(g) is None
    assert await d.lookup(mine[0]) == moved
    assert await d.lookup(GrainId("Counter", "b")) == theirs
    assert await d.entries_of(A) == []
    assert await d.purge_silo(A) == 0
    assert d.statistics().purged == 2


async def test_the_lookup_cache_serves_until_invalidated(world: World) -> None:
    d = world.directory
    g2 = GrainId("Counter", "other")
    entry = await d.register(G, A, "a1")
    other = await d.register(g2, B, "b1")
    assert d.cached(G) == entry
    d.invalidate(G)
    assert d.cached(G) is None
    assert await d.lookup(G) == entry and d.cached(G) == entry
    d.invalidate_silo(A)
    assert d.cached(G) is None and d.cached(g2) == other
    stats = d.statistics()
    assert (stats.cache_size, stats.cache_hits, stats.cache_misses) == (1, 3, 2)


async def test_purge_goes_in_steps_of_at_most_the_batch_and_keeps_what_a_live_silo_took_over(world: World) -> None:
    d = world.directory
    mine = [GrainId("Counter", f"a{i}") for i in range(3 * world.step - 1)]
    for g in mine:
        await d.register(g, A, f"act-{g.key}")
    await world.kill(A)
    left = len(mine)
    purged: list[GrainId] = []
    taken = {}
    while True:
        batch = await d.purge_batch(A)
        # A step takes at most its bound off the index, and removes only what it took.
        assert len(batch.grains) <= world.step and left - batch.remaining <= world.step
        assert batch.remaining == len(await d.entries_of(A))
        purged += batch.grains
        # Between steps a live silo re-activates grains of the dead one (a takeover also
        # takes the grain off the dead silo's index): the purge leaves them be.
        for g in [g for g in mine if g not in purged and g not in taken][: 2 * world.step // BATCH]:
            taken[g] = await d.register(g, B, f"b-{g.key}")
        left = len(await d.entries_of(A))
        if not batch.remaining:
            break
    assert taken and purged and set(purged).isdisjoint(taken) and set(purged) | set(taken) == set(mine)
    for g in mine:
        assert await d.lookup(g) == taken.get(g)
    assert sorted(await d.entries_of(B), key=str) == sorted(taken, key=str)
    assert await d.purge_batch(A) == PurgedBatch((), 0)  # done, and a second purger finds nothing
    assert d.statistics().purged == len(purged)


async def test_two_purgers_at_once_split_the_work_and_remove_everything(world: World) -> None:
    d = world.directory
    mine = [GrainId("Counter", f"a{i}") for i in range(30)]
    for g in mine:
        await d.register(g, A, f"act-{g.key}")
    await world.kill(A)
    counts = await asyncio.gather(d.purge_silo(A), d.purge_silo(A))
    assert sum(counts) == len(mine)
    for g in mine:
        assert await d.lookup(g) is None
    assert await d.entries_of(A) == []


async def test_a_live_silos_entries_are_never_purged(world: World) -> None:
    d = world.directory
    entry = await d.register(G, A, "a1")
    with pytest.raises(errors.MembershipError):
        await d.purge_batch(A)
    with pytest.raises(errors.MembershipError):
        await d.purge_silo(A)
    assert await d.lookup(G) == entry
    assert await d.entries_of(A) == [G]


async def test_lookups_share_one_address_object_per_silo(world: World) -> None:
    # The router caches an entry's silo for up to a million grains: one object per silo, not per grain.
    d = world.directory
    grains = [GrainId("Counter", f"s{i}") for i in range(3)]
    for g in grains:
        await d.register(g, A, f"act-{g.key}")
    found = [await d.lookup(g) for g in grains]
    assert all(e is not None and e.silo == A for e in found)
    assert len({id(e.silo) for e in found if e is not None}) == 1
