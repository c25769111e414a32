"""The state store's contract: every storage provider passes it.

Run on the in-memory twin, on the Redis store, and on the providers a silo builds from its
settings by name (``StorageProviders.build``): the in-memory one (``memory_provider``) and
the SQLite one (``silo.storage.sqlite``), both fenced through the Redis directory as in a
silo. The twin is fenced by the directory twin's tokens, the others by the directory
entries in Redis. The Redis store here puts anything over 1 kB into 1 kB chunks, so the
big-value case runs its chunked path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.membership import RedisMembershipTable
from silo.codec import Codec
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.redis_util import close_redis, connect_redis
from silo.settings import StorageSettings
from silo.storage.provider import StorageProviders, directory_owner
from silo.storage.store import StateStore, stream_parts
from silo.testing.directory import InMemoryGrainDirectory
from silo.testing.store import InMemoryStateStore

SILO = SiloAddress("127.0.0.1", 7000, 1)
G = GrainId("Counter", "g")
codec = Codec()


@dataclass
class World:
    store: StateStore
    directory: InMemoryGrainDirectory | RedisGrainDirectory

    async def write(self, value: Any, etag: str | None, token: int = 0, grain: GrainId = G, state: str = "") -> str:
        return await self.store.write(grain, codec.encode(value), etag, token, state=state)

    async def read(self, grain: GrainId = G, state: str = "") -> tuple[Any, str] | None:
        stored = await self.store.read(grain, state=state)
        return None if stored is None else (codec.decode(stored.meta, stored.buffers), stored.etag)


@pytest.fixture(params=["memory", "redis", "redis-cluster", "memory-provider", "sqlite"])
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[World]:
    if request.param == "memory":
        directory = InMemoryGrainDirectory()
        yield World(InMemoryStateStore(owner=directory.token_of), directory)
        return
    on_cluster = request.param == "redis-cluster"
    redis = connect_redis(request.getfixturevalue("redis_cluster_url" if on_cluster else "redis_url"))
    keys = Keys("contract")
    table = RedisMembershipTable(redis, keys)
    await table.join(MemberRow(address=str(SILO), host=SILO.host, port=SILO.port, generation=1))
    await table.set_status(str(SILO), SiloStatus.ACTIVE)
    directory = RedisGrainDirectory(redis, keys)
    # Built by name from settings, as a silo builds them.
    settings = StorageSettings(
        inline_bytes=1024,
        chunk_bytes=1024,
        providers={
            "memory-provider": "silo.testing.store:memory_provider",  # type: ignore[dict-item]
            "sqlite": {"factory": "silo.storage.sqlite:provider", "options": {"path": str(tmp_path / "s.db")}},  # type: ignore[dict-item]
        },
    )
    providers = StorageProviders.build(settings, redis, keys, directory_owner(directory))
    try:
        yield World(providers.get("redis" if on_cluster else request.param), directory)
    finally:
        await providers.close()
        await close_redis(redis)


async def test_nothing_stored_reads_as_none(world: World) -> None:
    assert await world.read() is None


async def test_a_write_reads_back_with_its_etag(world: World) -> None:
    etag = await world.write({"value": 1, "name": "x"}, None)
    assert await world.read() == ({"value": 1, "name": "x"}, etag)
    etag2 = await world.write({"value": 2}, etag)
    assert etag2 != etag
    assert await world.read() == ({"value": 2}, etag2)


async def test_a_write_over_another_etag_is_refused_and_changes_nothing(world: World) -> None:
    with pytest.raises(errors.StateConflictError):
        await world.write({"value": 1}, "no-such-etag")  # expects state where there is none
    etag = await world.write({"value": 1}, None)
    with pytest.raises(errors.StateConflictError) as info:
        await world.write({"value": 2}, None)  # expects none where there is state
    assert "etag" in str(info.value) and str(G) in str(info.value)
    with pytest.raises(errors.StateConflictError):
        await world.write({"value": 3}, "stale")
    assert await world.read() == ({"value": 1}, etag)
    assert world.store.statistics().conflicts == 3


async def test_any_etag_overwrites(world: World) -> None:
    await world.write({"value": 1}, None)
    etag = await world.write({"value": 9}, "*")
    assert await world.read() == ({"value": 9}, etag)


async def test_a_write_is_fenced_by_the_directory_token(world: World) -> None:
    entry = await world.directory.register(G, SILO, "a1")
    etag = await world.write({"value": 1}, None, entry.token)
    with pytest.raises(errors.StateConflictError) as info:
        await world.write({"value": 2}, etag, entry.token + 1)
    assert "fencing" in str(info.value)
    # Token 0 (a stateless worker) may not write over the grain's owner...
    with pytest.raises(errors.StateConflictError) as info:
        await world.write({"value": 3}, etag, 0)
    assert "fencing" in str(info.value)
    # ...but token 0 with etag "*" is an admin overwrite (restore_group), unfenced.
    etag = await world.write({"value": 3}, "*", 0)
    # A grain without a directory entry: any token but 0 is stale.
    with pytest.raises(errors.StateConflictError):
        await world.write({"value": 1}, None, 5, grain=GrainId("Counter", "unowned"))
    # The etag is checked first.
    with pytest.raises(errors.StateConflictError) as info:
        await world.write({"value": 4}, "stale", entry.token + 1)
    assert "etag" in str(info.value)
    assert await world.read() == ({"value": 3}, etag)


async def test_clear_is_checked_like_a_write(world: World) -> None:
    await world.store.clear(G, None, 0)  # nothing there, nothing expected: fine
    entry = await world.directory.register(G, SILO, "a1")
    etag = await world.write({"value": 1}, None, entry.token)
    with pytest.raises(errors.StateConflictError):
        await world.store.clear(G, "stale", entry.token)
    with pytest.raises(errors.StateConflictError):
        await world.store.clear(G, etag, entry.token + 1)
    assert await world.read() == ({"value": 1}, etag)
    await world.store.clear(G, etag, entry.token)
    assert await world.read() is None
    await world.write({"value": 2}, None, entry.token)
    await world.store.clear(G, "*", 0)
    assert await world.read() is None


async def test_a_big_value_round_trips_bit_exact(world: World) -> None:
    big = np.arange(100_000, dtype=np.int32).reshape(100, 1000)  # 400 kB: ~400 chunks in Redis
    etag = await world.write({"arr": big, "n": 7}, None)
    found = await world.read()
    assert found is not None
    value, read_etag = found
    assert read_etag == etag and value["n"] == 7
    assert value["arr"].dtype == big.dtype and np.array_equal(value["arr"], big)
    small = await world.write({"n": 8}, etag)
    assert await world.read() == ({"n": 8}, small)


async def test_a_raw_stream_write_reads_back(world: World) -> None:
    parts = stream_parts(codec.encode({"restored": True}))
    etag = await world.store.write_stream(G, parts, "*", 0)
    assert await world.read() == ({"restored": True}, etag)


async def test_statistics_count_the_same_on_both(world: World) -> None:
    etag = await world.write({"value": 1}, None)
    await world.read()
    await world.read(GrainId("Counter", "absent"))
    with pytest.raises(errors.StateConflictError):
        await world.write({"value": 2}, "stale")
    await world.write({"value": 2}, etag)
    stats = world.store.statistics()
    assert (stats.reads, stats.writes, stats.conflicts, stats.errors) == (1, 2, 1, 0)
    assert stats.bytes_written > 0 and stats.bytes_read > 0


async def test_named_states_of_one_grain_are_separate_values_checked_alike(world: World) -> None:
    default = await world.write({"value": 1}, None)
    profile = await world.write({"name": "ada"}, None, state="profile")
    assert await world.read() == ({"value": 1}, default)
    assert await world.read(state="profile") == ({"name": "ada"}, profile)
    assert await world.read(state="prefs") is None
    # Each has its own etag...
    with pytest.raises(errors.StateConflictError) as info:
        await world.write({"name": "bob"}, default, state="profile")
    assert "profile" in str(info.value)
    # ...and its own fencing check against the grain's one directory entry.
    entry = await world.directory.register(G, SILO, "a1")
    with pytest.raises(errors.StateConflictError, match="fencing"):
        await world.write({"name": "bob"}, profile, entry.token + 1, state="profile")
    profile = await world.write({"name": "bob"}, profile, entry.token, state="profile")
    await world.store.clear(G, profile, entry.token, state="profile")
    assert await world.read(state="profile") is None
    assert await world.read() == ({"value": 1}, default)  # clearing one leaves the other
