"""Checkpoints are a facility a grain reaches through its context (``snapshots(self)``), not
members of the class a user subclasses; a plain user grain saves, reads and restores with it."""

from __future__ import annotations

from typing import Any

import pytest

from grains import Grain
from grains.checkpoints import Snapshots, snapshots
from grains.ids import GrainId
from grains.workload import Workload
from silo import errors
from silo.client import ClusterClient
from silo.codec import Codec
from silo.settings import StorageSettings
from silo.storage.checkpoint import Checkpoints
from silo.storage.store import RedisStateStore
from tests.facility_grains import GROUP, Notebook

GRAINS = ("tests.facility_grains",)

MOVED = {
    # to grains.checkpoints.Snapshots
    "save_snapshot", "load_snapshot", "read_snapshot_member", "snapshot_info", "latest_snapshot",
    "list_snapshots", "delete_snapshot", "checkpoint_groups",
    # to grains.workload.Workload
    "redis_client", "rendezvous_prefix", "publish_progress", "forget_progress",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MOVED))
def test_the_grain_a_user_subclasses_holds_no_workload_member(name: str) -> None:
    assert not hasattr(Grain, name)


def test_each_moved_member_has_a_home_on_a_facility() -> None:
    on_facilities = {n for cls in (Snapshots, Workload) for n in dir(cls) if not n.startswith("_")}
    renamed = {"save_snapshot": "save", "load_snapshot": "load", "read_snapshot_member": "read_member",
               "snapshot_info": "info", "latest_snapshot": "latest_complete", "list_snapshots": "list",
               "delete_snapshot": "delete", "checkpoint_groups": "groups"}  # fmt: skip
    assert {renamed.get(n, n) for n in MOVED} <= on_facilities


def test_a_grain_the_runtime_never_activated_has_no_facility() -> None:
    with pytest.raises(AttributeError):
        snapshots(Notebook())


async def test_a_plain_user_grain_checkpoints_its_group_through_the_facility(
    cluster: Any, client: ClusterClient
) -> None:
    await cluster(1, grains=GRAINS)
    a, b = client.get_grain(Notebook, "a"), client.get_grain(Notebook, "b")
    members = ["Notebook/a", "Notebook/b"]
    await a.write("a1")
    await b.write("b1")
    assert await a.save(1, members) is False  # one member of two: pending
    listed = await a.catalogue()
    assert (listed["complete"], listed["pending"], listed["latest"]) == ([], ["1"], None)
    assert listed["groups"] == [GROUP]
    assert await b.save(1, members) is True  # the save that completed it

    await a.write("a2")
    assert await a.peek(1, "Notebook/b") == ["b1"]  # another member's part, as this grain's State
    assert await a.pages() == ["a1", "a2"]  # ... which left its own state alone
    listed = await a.catalogue()
    assert (listed["complete"], listed["pending"], listed["latest"]) == (["1"], [], "1")
    assert sorted(listed["members"]) == members

    assert await a.restore() == "1"  # None: the latest complete
    assert await a.pages() == ["a1"]
    stored = await RedisStateStore(client.redis, client.keys, StorageSettings()).read(GrainId.parse("Notebook/a"))
    assert stored is not None and Codec().decode(stored.meta, stored.buffers)["pages"] == ["a1"]  # written
    assert await Checkpoints(client.redis, client.keys).groups() == [GROUP]  # what a client sees too
    with pytest.raises(errors.StorageError):
        await a.restore(2)

    assert await a.drop(1) is True
    assert await a.drop(1) is False
    assert (await a.catalogue())["complete"] == []
