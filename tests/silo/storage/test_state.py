"""Grain state in Redis: fencing, write-behind, schema evolution (in-process silos)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from grains import Grain, grain_type
from grains.call import Call
from grains.ids import GrainId
from silo import errors
from silo.client import ClusterClient
from silo.settings import SiloSettings
from silo.silo import Silo
from tests.conftest import FAST_MEMBERSHIP
from tests.sample_grains import Buffered, Counter


async def _take_over(silo: Silo, grain: GrainId, new_owner: Silo) -> None:
    """Make the directory name another activation (on ``new_owner``) with a fresh fencing token."""
    r, k = silo.redis, silo.keys
    token = await r.incr(k.fencing_counter())
    await r.hset(
        k.directory_entry(str(grain)),
        mapping={"silo": str(new_owner.address), "act": "usurper", "token": token},
    )


def _activation(silo: Silo, grain: GrainId) -> Any:
    act = silo.catalog.get(grain)
    assert act is not None, f"{grain} is not active on {silo.address}"
    return act


async def _stored_value(silo: Silo, grain: GrainId) -> dict[str, Any] | None:
    stored = await silo.store.read(grain)
    return None if stored is None else silo.codec.decode(stored.meta, stored.buffers)


async def test_state_is_stored_as_a_map_of_fields_and_the_model_is_registered(
    cluster, client
) -> None:
    (silo,) = await cluster(1)
    assert await client.get_grain(Counter, "c").add(5) == 5
    assert await _stored_value(silo, GrainId("Counter", "c")) == {"value": 5}
    assert "Counter.State" in silo.codec.registry.names()  # nested State models travel too


async def test_zombie_activation_gets_state_conflict_and_is_deactivated(cluster, client) -> None:
    a, b = await cluster(2)
    gid = GrainId("Counter", "z")
    # Activate on a known silo: call through that silo's own router with a fresh key.
    ref = a.get_grain(Counter, "z")
    assert await ref.add(1) == 1
    owner = a if a.catalog.get(gid) is not None else b
    other = b if owner is a else a
    act = _activation(owner, gid)
    await _take_over(owner, gid, other)
    with pytest.raises(errors.StateConflictError, match="fencing token"):
        await owner.dispatcher.dispatch(Call(gid, "add", (10,)), asyncio.get_running_loop().time() + 5)
    await asyncio.wait_for(act.deactivated.wait(), 5)
    assert owner.catalog.get(gid) is None
    assert await _stored_value(owner, gid) == {"value": 1}  # the zombie's +10 never landed
    assert owner.store.statistics().conflicts >= 1


async def test_zombie_whose_directory_entry_was_purged_cannot_write(cluster) -> None:
    (silo,) = await cluster(1)
    gid = GrainId("Counter", "purged")
    assert await silo.get_grain(Counter, "purged").add(2) == 2
    act = _activation(silo, gid)
    await silo.redis.delete(silo.keys.directory_entry(str(gid)))  # as a survivor's purge would
    with pytest.raises(errors.StateConflictError):
        await silo.dispatcher.dispatch(Call(gid, "add", (1,)), asyncio.get_running_loop().time() + 5)
    await asyncio.wait_for(act.deactivated.wait(), 5)
    assert await _stored_value(silo, gid) == {"value": 2}


async def test_write_behind_coalesces_writes_and_deactivation_flushes(cluster, client) -> None:
    (silo,) = await cluster(1)
    gid = GrainId("Buffered", "wb")
    ref = client.get_grain(Buffered, "wb")
    before = silo.store.statistics().writes
    for v in range(1, 51):
        assert await ref.set(v) == v
    assert await ref.get() == 50
    assert silo.store.statistics().writes == before  # nothing flushed yet (interval is 60 s)
    assert await _stored_value(silo, gid) is None
    act = _activation(silo, gid)
    await ref.retire()
    await asyncio.wait_for(act.deactivated.wait(), 5)
    assert silo.store.statistics().writes == before + 1
    assert await _stored_value(silo, gid) == {"value": 50}
    assert await ref.get() == 50  # a new activation loads the flushed state


async def test_write_behind_flush_from_a_zombie_is_refused(cluster) -> None:
    a, b = await cluster(2)
    gid = GrainId("Buffered", "wbz")
    ref = a.get_grain(Buffered, "wbz")
    await ref.set(1)
    owner = a if a.catalog.get(gid) is not None else b
    act = _activation(owner, gid)
    await act.state_handle().flush()
    await ref.set(2)
    assert act.state_handle().dirty
    await _take_over(owner, gid, b if owner is a else a)
    with pytest.raises(errors.StateConflictError):
        await act.state_handle().flush()
    await asyncio.wait_for(act.deactivated.wait(), 5)
    assert await _stored_value(owner, gid) == {"value": 1}


async def test_write_failure_other_than_conflict_deactivates_so_memory_is_reloaded(cluster) -> None:
    (silo,) = await cluster(1)
    gid = GrainId("Counter", "flaky")
    ref = silo.get_grain(Counter, "flaky")
    assert await ref.add(1) == 1
    act = _activation(silo, gid)
    real = silo.store.write

    async def broken(*args: Any, **kwargs: Any) -> str:
        raise errors.StorageError("injected: Redis unreachable")

    silo.store.write = broken  # type: ignore[method-assign]
    with pytest.raises(errors.StorageError, match="injected"):
        await ref.add(100)
    await asyncio.wait_for(act.deactivated.wait(), 5)
    silo.store.write = real  # type: ignore[method-assign]
    assert await ref.add(1) == 2  # the unacknowledged +100 was dropped with the activation


async def test_a_connection_closed_under_a_state_write_is_a_storage_error_and_deactivates(cluster) -> None:
    # uvloop's form of "redis-py closed the connection as the call picked it up" (the asyncio
    # loop's is an AttributeError): the write's fate is unknown, so the caller gets a documented
    # StorageError after the store's retries, and the activation goes (the next one re-reads).
    (silo,) = await cluster(1)
    gid = GrainId("Counter", "closed-under-us")
    ref = silo.get_grain(Counter, "closed-under-us")
    assert await ref.add(1) == 1
    act = _activation(silo, gid)
    real = silo.store._write

    async def closed(*, keys: Any, args: Any) -> Any:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True reading=False 0x1>; the handler is closed")

    silo.store._write = closed  # type: ignore[assignment]
    with pytest.raises(errors.StorageError, match="handler is closed"):
        await ref.add(100)
    await asyncio.wait_for(act.deactivated.wait(), 5)
    silo.store._write = real
    assert await ref.add(1) == 2


# --- schema evolution -----------------------------------------------------------


@grain_type("Evolving")
class EvolvingV1(Grain):
    class State(BaseModel):
        count: int = 0
        label: str = ""
        dropped: list[int] = []

    async def put(self, count: int, label: str) -> None:
        self.state.count, self.state.label, self.state.dropped = count, label, [1, 2]
        await self.write_state()

    async def get(self) -> dict[str, Any]:
        return self.state.model_dump()


@grain_type("Evolving")
class EvolvingV2(Grain):
    """``dropped`` removed, ``ratio`` added with a default; the class has a new name too."""

    class State(BaseModel):
        count: int = 0
        label: str = ""
        ratio: float = 0.5

    async def get(self) -> dict[str, Any]:
        return self.state.model_dump()


@grain_type("Evolving")
class EvolvingV3(Grain):
    """``count`` changed type: stored ints do not fit a list."""

    class State(BaseModel):
        count: list[str] = []
        label: str = ""

    async def get(self) -> dict[str, Any]:
        return self.state.model_dump()


async def _silo_with(redis_url: str, cluster_name: str, cls: type[Grain]) -> Silo:
    settings = SiloSettings(redis_url=redis_url, cluster=cluster_name, membership=FAST_MEMBERSHIP)
    return await Silo(settings, grains=[cls]).start()


async def test_state_from_an_older_model_loads_with_defaults_and_ignores_removed_fields(
    redis_url: str, cluster_name: str
) -> None:
    old = await _silo_with(redis_url, cluster_name, EvolvingV1)
    try:
        await old.get_grain(EvolvingV1, "e").put(7, "seven")
    finally:
        await old.stop(graceful=False)
    new = await _silo_with(redis_url, cluster_name, EvolvingV2)
    try:
        assert await new.get_grain(EvolvingV2, "e").get() == {
            "count": 7,
            "label": "seven",
            "ratio": 0.5,
        }
    finally:
        await new.stop(graceful=False)


async def test_state_whose_field_changed_type_fails_naming_grain_and_field(
    redis_url: str, cluster_name: str
) -> None:
    old = await _silo_with(redis_url, cluster_name, EvolvingV1)
    try:
        await old.get_grain(EvolvingV1, "t").put(3, "three")
    finally:
        await old.stop(graceful=False)
    new = await _silo_with(redis_url, cluster_name, EvolvingV3)
    try:
        with pytest.raises(errors.StorageError) as info:
            await new.get_grain(EvolvingV3, "t").get()
        text = str(info.value)
        assert "Evolving/t" in text and "'count'" in text and "EvolvingV3.State" in text
        # The silo keeps serving: a grain with no stored state activates fine.
        assert await new.get_grain(EvolvingV3, "fresh").get() == {"count": [], "label": ""}
    finally:
        await new.stop(graceful=False)


async def test_state_written_by_one_client_call_is_read_by_another_client(
    cluster, redis_url: str, cluster_name: str
) -> None:
    await cluster(1)
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as c1:
        await c1.get_grain(Counter, "shared").add(3)
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as c2:
        assert await c2.get_grain(Counter, "shared").get() == 3
