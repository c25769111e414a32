"""Gaps found in review: a background task's call chain, unfenced token-0 writes.

Each test here failed before its fix (or, for a case shown safe, says why).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from grains import Grain
from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.redis_util import connect_redis
from silo.settings import StorageSettings
from silo.storage.checkpoint import Checkpoints
from silo.storage.store import RedisStateStore
from silo.testing.harness import InProcessSilo

# --- start_task runs outside the call chain of the turn that started it ---------------------------


class Starter(Grain):
    """Starts a task that calls a peer, which calls back into this grain."""

    def __init__(self) -> None:
        self.done: asyncio.Future[int] | None = None

    async def kick(self, peer: str) -> None:
        self.done = asyncio.get_running_loop().create_future()

        async def later() -> None:
            try:
                assert self.done is not None
                self.done.set_result(await self.get_grain(Peer, peer).call_back(self.key))
            except Exception as exc:  # noqa: BLE001 - handed to the test as the outcome
                assert self.done is not None
                self.done.set_exception(exc)

        self.start_task(later())

    async def value(self) -> int:
        return 42

    async def outcome(self) -> int:
        assert self.done is not None
        return await asyncio.shield(self.done)


class Peer(Grain):
    async def call_back(self, starter: str) -> int:
        return await self.get_grain(Starter, starter).value()


async def test_a_background_task_calling_back_into_its_grain_is_no_deadlock() -> None:
    # The turn that started the task is over when the task calls back: the call
    # back is an ordinary call, not a cycle. Before the fix the task inherited the
    # turn's chain (Starter/s) and the call back failed with DeadlockError.
    async with InProcessSilo([Starter, Peer]) as silo:
        starter = silo.get_grain(Starter, "s")
        await starter.kick("p")
        task_done = silo.instance(starter).done
        assert await asyncio.wait_for(task_done, 10) == 42


# --- token 0 writes ---------------------------------------------------------------------------------


@pytest.fixture
async def store(redis_url: str, cluster_name: str) -> AsyncIterator[tuple[Any, Keys, RedisStateStore]]:
    redis = connect_redis(redis_url)
    keys = Keys(cluster_name)
    yield redis, keys, RedisStateStore(redis, keys, StorageSettings())
    await redis.aclose(close_connection_pool=True)


async def _register_owner(redis: Any, keys: Keys, grain: GrainId) -> Any:
    """An Active silo in membership, and its activation of ``grain`` in the directory."""
    from silo.cluster.directory import RedisGrainDirectory
    from silo.cluster.membership import RedisMembershipTable
    from silo.records.membership import MemberRow, SiloStatus

    silo = SiloAddress("127.0.0.1", 1, 1)
    table = RedisMembershipTable(redis, keys)
    await table.join(MemberRow(address=str(silo), host=silo.host, port=silo.port, generation=1))
    await table.set_status(str(silo), SiloStatus.ACTIVE)
    return await RedisGrainDirectory(redis, keys).register(grain, silo, "act-1")


def _encoded(n: int) -> Any:
    return Codec(TypeRegistry()).encode({"n": n})


async def test_a_token_0_write_is_refused_while_the_directory_names_an_owner(
    store: tuple[Any, Keys, RedisStateStore],
) -> None:
    # Token 0 is what an activation outside the directory writes with (a stateless
    # worker). It used to pass the fence whatever the directory said, so such a writer
    # (a type that is a stateless worker on one silo and not on another, mid-upgrade)
    # could overwrite the state of the activation the directory names.
    redis, keys, st = store
    grain = GrainId("Shared", "k")
    etag = await st.write(grain, _encoded(1), None, 0)  # no owner: unfenced, as before
    entry = await _register_owner(redis, keys, grain)
    with pytest.raises(errors.StateConflictError, match="fencing"):
        await st.write(grain, _encoded(2), etag, 0)
    with pytest.raises(errors.StateConflictError, match="fencing"):
        await st.clear(grain, etag, 0)
    # The owner itself still writes.
    await st.write(grain, _encoded(3), etag, entry.token)


async def test_stateless_workers_are_kept_apart_by_the_etag(
    store: tuple[Any, Keys, RedisStateStore],
) -> None:
    # Why token 0 is safe for stateless workers: several workers of one grain id may
    # exist at once by design (no single owner to fence against), and each write is
    # checked against the etag its writer read, so a worker that read an older state
    # is refused and none overwrites another's write unseen.
    _, _, st = store
    grain = GrainId("Worker", "w")
    first = await st.write(grain, _encoded(1), None, 0)
    await st.write(grain, _encoded(2), first, 0)  # worker A, from what it read
    with pytest.raises(errors.StateConflictError, match="etag"):
        await st.write(grain, _encoded(2), first, 0)  # worker B, from the same read


async def test_restore_group_over_a_live_activation_makes_its_next_write_reload(
    store: tuple[Any, Keys, RedisStateStore],
) -> None:
    # Why restore_group's unfenced overwrite ("*", token 0) is safe: it is an admin's
    # write, and the activation that was live keeps the etag of what it read, so its
    # next write is refused (etag) and it reloads the restored state; it never writes
    # over the restore.
    redis, keys, st = store
    grain = GrainId("Shard", "job/0")
    entry = await _register_owner(redis, keys, grain)
    live_etag = await st.write(grain, _encoded(1), None, entry.token)
    cps = Checkpoints(redis, keys, StorageSettings())
    await cps.save("job", 1, grain, _encoded(100), members=[grain], token=entry.token)  # its snapshot
    await cps.restore_group("job", 1, st)
    with pytest.raises(errors.StateConflictError, match="etag"):
        await st.write(grain, _encoded(2), live_etag, entry.token)
    stored = await st.read(grain)
    assert stored is not None
    assert Codec(TypeRegistry()).decode(stored.meta, stored.buffers) == {"n": 100}


async def test_a_token_0_checkpoint_save_is_refused_while_the_directory_names_an_owner(
    store: tuple[Any, Keys, RedisStateStore],
) -> None:
    # The same gap in checkpoints: a snapshot member saved with token 0 passed the fence
    # whatever the directory said, so a writer outside the directory could put its own
    # state into the snapshot the owning activation takes (and a restore would bring it back).
    redis, keys, _ = store
    cps = Checkpoints(redis, keys)
    grain = GrainId("Shard", "ck")
    assert await cps.save("g0", 1, grain, _encoded(1), members=[grain], token=0)  # no owner: as before
    entry = await _register_owner(redis, keys, grain)
    with pytest.raises(errors.StateConflictError, match="fencing"):
        await cps.save("g0", 2, grain, _encoded(2), members=[grain], token=0)
    assert [i.snapshot_id for i in await cps.list("g0", pending=True)] == []  # nothing half-saved stays
    assert await cps.save("g0", 2, grain, _encoded(3), members=[grain], token=entry.token)
