"""Group checkpoints: consistent across members, retained, restored bit-exact."""

from __future__ import annotations

import pytest

from silo import errors
from silo.client import ClusterClient
from silo.codec import Codec
from silo.settings import StorageSettings
from silo.storage.checkpoint import Checkpoints
from silo.storage.store import RedisStateStore
from tests.sample_grains import Shard, tensor_digest

NUMEL = 300_000  # 1.2 MB per shard: over the chunk size below, so snapshots are chunked


async def test_snapshot_of_three_shards_is_consistent_retained_and_restored_bit_exact(
    cluster, client: ClusterClient
) -> None:
    await cluster(2, storage=StorageSettings(chunk_bytes=256 << 10))
    shards = [client.get_grain(Shard, f"job/s{i}") for i in range(3)]
    members = [f"Shard/job/s{i}" for i in range(3)]
    cps = Checkpoints(client.redis, client.keys)
    digests: dict[int, list[str]] = {}
    for step in (10, 20, 30):
        digests[step] = [await s.train(step, NUMEL) for s in shards]
        assert await shards[0].checkpoint("job", members, 2) is False
        assert await shards[1].checkpoint("job", members, 2) is False
        # Two of three members saved: listed as pending, not as a snapshot.
        assert str(step) in [p.snapshot_id for p in await cps.list("job", pending=True)]
        latest = await cps.latest_complete("job")
        assert latest is None or latest.snapshot_id != str(step)
        with pytest.raises(errors.StorageError, match="incomplete"):
            await shards[0].restore("job", step)
        assert await shards[2].checkpoint("job", members, 2) is True

    infos = await cps.list("job")
    assert [i.snapshot_id for i in infos] == ["20", "30"]  # keep=2: step 10 is gone, data and all
    assert all(
        i.complete and i.written == sorted(members) and i.bytes > 3 * NUMEL * 4 for i in infos
    )
    assert [
        k
        async for k in client.redis.scan_iter(
            match=client.keys.checkpoint_manifest("job", "10") + "*"
        )
    ] == []
    assert await cps.list("job", pending=True) == []
    assert await cps.groups() == ["job"]

    for s in shards:
        await s.train(40, NUMEL)
    assert [await s.restore("job", 20) for s in shards] == ["20", "20", "20"]
    assert [await s.digest() for s in shards] == [(20, d) for d in digests[20]]
    assert [await s.restore("job", None) for s in shards] == ["30", "30", "30"]  # None: the latest
    assert [await s.digest() for s in shards] == [(30, d) for d in digests[30]]


async def test_group_restore_from_a_client_overwrites_persisted_state(
    cluster, client: ClusterClient
) -> None:
    await cluster(1)
    shards = [client.get_grain(Shard, f"g/s{i}") for i in range(3)]
    members = [s.grain_id for s in shards]
    want = [await s.train(5, 1000) for s in shards]
    for s in shards:
        await s.checkpoint("g", [str(m) for m in members], 3)
    for s in shards:
        await s.train(6, 1000)
    cps = Checkpoints(client.redis, client.keys)
    assert await cps.restore_group("g", 5) == [str(m) for m in members]
    store = RedisStateStore(client.redis, client.keys, StorageSettings())
    codec = Codec()
    for m, d in zip(members, want, strict=True):
        stored = await store.read(m)
        assert stored is not None
        fields = codec.decode(stored.meta, stored.buffers)
        assert (fields["step"], tensor_digest(fields["weights"])) == (5, d)
    assert await cps.delete("g", 5) is True
    assert await cps.list("g") == []


async def test_a_save_with_different_members_or_into_a_complete_snapshot_is_refused(
    cluster, client: ClusterClient
) -> None:
    await cluster(1)
    a, b = client.get_grain(Shard, "m/a"), client.get_grain(Shard, "m/b")
    await a.train(1, 10)
    await b.train(1, 10)
    assert await a.checkpoint("m", ["Shard/m/a", "Shard/m/b"], 3) is False
    with pytest.raises(errors.StorageError, match="started with members"):
        await b.checkpoint("m", ["Shard/m/b"], 3)
    assert await b.checkpoint("m", ["Shard/m/a", "Shard/m/b"], 3) is True
    with pytest.raises(errors.StorageError, match="complete"):
        await b.checkpoint("m", ["Shard/m/a", "Shard/m/b"], 3)
    with pytest.raises(errors.ConfigError):
        await a.checkpoint("m", ["Shard/m/b"], 3)  # not a member of its own snapshot


async def test_a_newer_epoch_takes_over_what_an_abandoned_one_left_at_the_same_id(
    cluster, client: ClusterClient
) -> None:
    """A training generation rolled back leaves snapshots at step ids the next generation
    saves again: complete ones used to refuse it ("complete and can no longer change"),
    pending ones to mix the two generations' members into one snapshot."""
    await cluster(1)
    a, b = client.get_grain(Shard, "e/a"), client.get_grain(Shard, "e/b")
    both = ["Shard/e/a", "Shard/e/b"]
    await a.train(3, 10)
    await b.train(3, 10)
    assert await a.checkpoint("e", both, 5, epoch=1) is False
    assert await b.checkpoint("e", both, 5, epoch=1) is True  # epoch 1 completed step 3
    assert await a.checkpoint("e", both, 5, epoch=2) is False  # taken over: pending again
    store = Checkpoints(client.redis, client.keys)
    assert [i.snapshot_id for i in await store.list("e")] == []
    with pytest.raises(errors.StorageError, match="newer epoch 2"):
        await b.checkpoint("e", both, 5, epoch=1)  # the abandoned epoch cannot finish it
    assert await b.checkpoint("e", both, 5, epoch=2) is True
    assert [i.snapshot_id for i in await store.list("e")] == ["3"]
    # A pending snapshot of an abandoned epoch is never completed by the next one's members.
    await a.train(4, 10)
    await b.train(4, 10)
    assert await a.checkpoint("e", both, 5, epoch=2) is False
    assert await b.checkpoint("e", both, 5, epoch=3) is False  # a's epoch-2 part no longer counts
    assert await a.checkpoint("e", both, 5, epoch=3) is True



async def test_a_snapshot_retention_unlisted_is_not_complete_though_its_saver_died_before_deleting_it(
    cluster, client: ClusterClient
) -> None:
    # Retention unlists an old snapshot in the script that completes a newer one; the saver then
    # deletes its blobs, the manifest last. A saver SIGKILLed in between left a manifest saying
    # "complete" over deleted blobs, and a training rollback that asked info() restored from it
    # forever ("holds no state", tests/grains/training/test_faults.py under load).
    await cluster(1)
    shards = [client.get_grain(Shard, f"ret/s{i}") for i in range(2)]
    members = [f"Shard/ret/s{i}" for i in range(2)]
    cps = Checkpoints(client.redis, client.keys)
    for step in (10, 20):
        for s in shards:
            await s.train(step, 1000)
            await s.checkpoint("ret", members, 2)
    assert (await cps.info("ret", 10)).complete  # type: ignore[union-attr]
    # What a saver killed mid-retention leaves: 10 unlisted, one member's blob gone, the manifest kept.
    await client.redis.zrem(client.keys.checkpoint_index("ret"), "10")
    await client.redis.delete(client.keys.checkpoint_member("ret", "10", members[0]))
    info = await cps.info("ret", 10)
    assert info is not None and not info.complete
    assert (await cps.latest_complete("ret")).snapshot_id == "20"  # type: ignore[union-attr]
    with pytest.raises(errors.StorageError, match="incomplete"):
        await shards[0].restore("ret", 10)
    assert await shards[0].restore("ret", 20) == "20"
