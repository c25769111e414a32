"""State writes while Redis Cluster slots migrate: nothing acknowledged is lost, no undocumented error.

Writers commit state through the real ``RedisStateStore`` on the session's 3-master Redis
Cluster while the slots of their grains move between masters, key by key, as ``redis-cli
--cluster reshard`` moves them (``CLUSTER SETSLOT ... IMPORTING/MIGRATING``, ``MIGRATE``,
``CLUSTER SETSLOT ... NODE``). Each writer behaves as an activation: after a ``StorageError``
(or a refusal) it reads the state again, as the next activation would, and goes on from there.
Every value holds the number of writes the grain's history has: one that vanished shows as a
count below the writes acknowledged.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import defaultdict

import redis.asyncio as aioredis

from grains.ids import GrainId
from silo import errors
from silo.codec import Encoded
from silo.keys import Keys, slot_of
from silo.redis_util import close_redis, connect_redis
from silo.settings import StorageSettings
from silo.storage.store import RedisStateStore
from silo.testing.redis_cluster import RedisClusterGroup

SLOTS = 3
GRAINS_PER_SLOT = 2
MOVES = 10
TOKEN = 7
WRITES_WHILE_MIGRATING = 2
"""Write attempts each stage of a move waits for on the grains of the moving slot."""
# Small chunks: the writes alternate inline and chunked heads (the chunked commit declares more keys).
SETTINGS = StorageSettings(inline_bytes=256, chunk_bytes=128, retries=3, retry_backoff_s=0.02)


def _grains(keys: Keys) -> dict[int, list[GrainId]]:
    """GRAINS_PER_SLOT grains in each of SLOTS hash slots (the keys of a grain share its slot)."""
    by_slot: dict[int, list[GrainId]] = defaultdict(list)
    for i in itertools.count():
        g = GrainId("Ledger", f"g{i}")
        s = slot_of(keys.state_head(str(g)))
        if len(by_slot) < SLOTS or s in by_slot:
            by_slot[s].append(g)
        if len(by_slot) == SLOTS and all(len(v) >= GRAINS_PER_SLOT for v in by_slot.values()):
            return {s: v[:GRAINS_PER_SLOT] for s, v in by_slot.items()}
    raise AssertionError("unreachable")


def _encode(count: int, last: int) -> Encoded:
    filler = "x" * (300 if last % 2 else 8)  # odd writes chunked, even ones inline
    return Encoded(json.dumps({"count": count, "last": last, "filler": filler}).encode(), [])


class _Writers:
    """One writer per grain; counts what was acknowledged and every error seen."""

    def __init__(self, store: RedisStateStore, grains: list[GrainId]) -> None:
        self.store = store
        self.grains = grains
        self.acked: dict[GrainId, int] = defaultdict(int)
        self.last_acked: dict[GrainId, int] = {}
        self.documented: dict[str, int] = defaultdict(int)
        self.undocumented: list[BaseException] = []
        self.moving: int | None = None
        self.attempts_while_moving = 0
        self.progress = asyncio.Event()
        self.stop = asyncio.Event()
        self._seq = itertools.count(1)

    async def run(self, grain: GrainId, slot: int) -> None:
        count, etag = await self._load(grain)
        while not self.stop.is_set():
            n = next(self._seq)
            if self.moving == slot:
                self.attempts_while_moving += 1
                self.progress.set()
            try:
                etag = await self.store.write(grain, _encode(count + 1, n), etag, TOKEN)
            except errors.StorageError as exc:  # StateConflictError included: documented
                self.documented[type(exc).__name__] += 1
                count, etag = await self._load(grain)  # the next activation reads again
                continue
            except Exception as exc:  # noqa: BLE001 - anything else is what this test looks for
                self.undocumented.append(exc)
                count, etag = await self._load(grain)
                continue
            count += 1
            self.acked[grain] += 1
            self.last_acked[grain] = n

    async def _load(self, grain: GrainId) -> tuple[int, str | None]:
        while True:
            try:
                stored = await self.store.read(grain)
            except errors.StorageError as exc:
                self.documented[type(exc).__name__] += 1
                if self.stop.is_set():  # unreadable for good? The final check says so.
                    return 0, None
                await asyncio.sleep(0.02)  # a reload that failed: an activation would be retried by its caller
                continue
            except Exception as exc:  # noqa: BLE001 - anything else is what this test looks for
                self.undocumented.append(exc)
                await asyncio.sleep(0.02)
                continue
            if stored is None:
                return 0, None
            return int(json.loads(bytes(stored.meta))["count"]), stored.etag

    async def writes_while_moving(self, n: int) -> None:
        """Until the writers of the moving slot's grains tried ``n`` more writes."""
        target = self.attempts_while_moving + n
        while self.attempts_while_moving < target:
            self.progress.clear()
            await asyncio.wait_for(self.progress.wait(), 20)


async def _assign(nodes: dict[int, aioredis.Redis], ids: dict[int, str], slot: int, src: int, dst: int) -> None:
    """End a move: the keys left on ``src`` migrated, then ``slot`` belongs to ``dst``, told to the
    target, the source, then the rest.

    The source refuses the slot's new owner while it holds keys of it, unless the target's claim
    has already reached it by gossip (which deletes them): a test that ends a move half-way won
    that race on an idle host and lost it on a loaded one.
    """
    while keys := await nodes[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
        await nodes[src].execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
    for port in (dst, src, *(p for p in nodes if p not in (src, dst))):
        await nodes[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])


async def _move(nodes: dict[int, aioredis.Redis], ids: dict[int, str], slot: int, src: int, dst: int, writers: _Writers) -> None:
    """Move ``slot`` from master ``src`` to ``dst``, as ``redis-cli --cluster reshard`` does, with
    writes while the slot is marked migrating and again while its keys are split between the two."""
    await nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
    await nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
    writers.moving = slot
    await writers.writes_while_moving(WRITES_WHILE_MIGRATING)
    half = int(await nodes[src].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)) // 2
    for keys in (await nodes[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, max(half, 1)), None):
        if keys is None:
            await writers.writes_while_moving(WRITES_WHILE_MIGRATING)  # some keys here, some there
            keys = await nodes[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if keys:
            await nodes[src].execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
    await _assign(nodes, ids, slot, src, dst)
    writers.moving = None


async def test_state_writes_lose_nothing_while_their_slots_move_between_masters(
    redis_cluster_url: str, redis_cluster_group: RedisClusterGroup, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    grains_by_slot = _grains(keys)
    client = connect_redis(redis_cluster_url)
    masters = redis_cluster_group.masters()
    nodes = {p: aioredis.Redis(host="127.0.0.1", port=p) for p in masters}
    try:
        ids = {p: (await nodes[p].execute_command("CLUSTER", "MYID")).decode() for p in masters}
        for grains in grains_by_slot.values():
            for g in grains:  # the grain's directory entry: this writer's activation owns it
                await client.hset(keys.directory_entry(str(g)), mapping={"silo": "s", "act": "a", "token": TOKEN})
        store = RedisStateStore(client, keys, SETTINGS)
        all_grains = [g for gs in grains_by_slot.values() for g in gs]
        writers = _Writers(store, all_grains)
        tasks = [
            asyncio.create_task(writers.run(g, slot)) for slot, gs in grains_by_slot.items() for g in gs
        ]
        slots = list(grains_by_slot)
        for move in range(MOVES):
            slot = slots[move % SLOTS]
            src = redis_cluster_group.master_of(slot)
            dst = masters[(masters.index(src) + 1) % len(masters)]
            await _move(nodes, ids, slot, src, dst, writers)
        await writers.writes_while_moving(0)
        writers.stop.set()
        await asyncio.gather(*tasks)

        assert not writers.undocumented, writers.undocumented[:5]
        lost: dict[str, tuple[int, object]] = {}
        for g in all_grains:
            try:
                stored = await store.read(g)
            except errors.StorageError as exc:
                lost[str(g)] = (writers.acked[g], f"unreadable: {exc}")
                continue
            count = json.loads(bytes(stored.meta))["count"] if stored else 0
            # Writes whose reply was lost may have landed too: at least every acknowledged one.
            if count < writers.acked[g]:
                lost[str(g)] = (writers.acked[g], count)
            entry = await client.hget(keys.directory_entry(str(g)), "token")
            assert entry is not None and int(entry) == TOKEN, f"directory entry of {g} lost"
        assert not lost, f"acknowledged writes lost (acked, stored): {lost}; errors: {dict(writers.documented)}"
        assert sum(writers.acked.values()) > MOVES * WRITES_WHILE_MIGRATING
    finally:
        for n in nodes.values():
            await n.aclose()
        await close_redis(client)
        # The session's cluster serves other tests: every slot on some master, none mid-move.
        redis_cluster_group.wait_ok(30)


async def test_a_key_that_moved_is_read_from_its_new_master_while_its_slot_migrates(
    redis_cluster_url: str, redis_cluster_group: RedisClusterGroup, cluster_name: str
) -> None:
    # The ASK redirection: ASKING and the command must travel on one connection. With several
    # idle connections to the target they used not to, and the read failed until the move ended.
    keys = Keys(cluster_name)
    moved = keys.state_head("Ledger/ask")
    slot = slot_of(moved)
    masters = redis_cluster_group.masters()
    src = redis_cluster_group.master_of(slot)
    dst = masters[(masters.index(src) + 1) % len(masters)]
    theirs = [k for k in (keys.state_head(f"Ledger/t{i}") for i in range(200)) if redis_cluster_group.master_of(slot_of(k)) == dst][:8]
    client = connect_redis(redis_cluster_url)
    nodes = {p: aioredis.Redis(host="127.0.0.1", port=p) for p in masters}
    try:
        ids = {p: (await nodes[p].execute_command("CLUSTER", "MYID")).decode() for p in masters}
        await client.hset(moved, mapping={"etag": "e1"})
        await asyncio.gather(*(client.hgetall(k) for k in theirs))  # several idle connections to dst
        await nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        await nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
        await nodes[src].execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", moved)
        for _ in range(5):
            assert await client.hgetall(moved) == {b"etag": b"e1"}
            assert await asyncio.gather(*(client.hgetall(k) for k in theirs)) == [{}] * len(theirs)
    finally:
        await _assign(nodes, ids, slot, src, dst)
        for n in nodes.values():
            await n.aclose()
        await close_redis(client)
        redis_cluster_group.wait_ok(30)


async def test_a_chunked_state_is_read_while_its_chunks_lie_on_two_masters(
    redis_cluster_url: str, redis_cluster_group: RedisClusterGroup, cluster_name: str
) -> None:
    # Half-way through a move, a multi-key MGET of the chunks gets TRYAGAIN until the move
    # ends: the read failed for the whole move, and an activation needing the state with it
    # (this deadlocked the reshard test, whose move waited for writers stuck re-reading).
    keys = Keys(cluster_name)
    grain = GrainId("Ledger", "split")
    head = keys.state_head(str(grain))
    slot = slot_of(head)
    masters = redis_cluster_group.masters()
    src = redis_cluster_group.master_of(slot)
    dst = masters[(masters.index(src) + 1) % len(masters)]
    client = connect_redis(redis_cluster_url)
    nodes = {p: aioredis.Redis(host="127.0.0.1", port=p) for p in masters}
    store = RedisStateStore(client, keys, SETTINGS)
    try:
        ids = {p: (await nodes[p].execute_command("CLUSTER", "MYID")).decode() for p in masters}
        await client.hset(keys.directory_entry(str(grain)), mapping={"silo": "s", "act": "a", "token": TOKEN})
        etag = await store.write(grain, _encode(1, 1), None, TOKEN)  # odd: 3 chunks of 128 bytes
        stored_keys = [k.decode() for k in await nodes[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)]
        chunks = sorted(k for k in stored_keys if etag in k)
        assert len(chunks) >= 2, stored_keys
        await nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        await nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
        await nodes[src].execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", chunks[0])
        stored = await store.read(grain)
        assert stored is not None and stored.etag == etag
        assert json.loads(bytes(stored.meta)) == json.loads(_encode(1, 1).meta)
    finally:
        await _assign(nodes, ids, slot, src, dst)
        for n in nodes.values():
            await n.aclose()
        await close_redis(client)
        redis_cluster_group.wait_ok(30)
