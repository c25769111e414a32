"""Keys an older version wrote (one slot, ``rg:{cluster}:…``) move to the per-grain layout and read back."""

from __future__ import annotations

import json

from grains.ids import GrainId
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.reminders import ReminderTable
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.migrate_keys import migrate
from silo.redis_util import close_redis, connect_redis
from silo.settings import StorageSettings
from silo.storage.checkpoint import Checkpoints
from silo.storage.store import RedisStateStore, stream_parts

CODEC = Codec(TypeRegistry())


def _stream(value: object) -> bytes:
    return b"".join(bytes(p) for p in stream_parts(CODEC.encode(value)))


async def test_an_old_layout_moves_and_reads_back(redis_url: str) -> None:
    r = connect_redis(redis_url)
    k = Keys("old")
    p = k.prefix
    small, big = _stream({"n": 1}), _stream({"blob": "x" * 3000})
    # As the one-slot layout wrote them (silo/keys.py before decision 83).
    await r.hset(p + "dir:Counter/a", mapping={"silo": "127.0.0.1:7000@1", "act": "a1", "token": "7"})
    await r.hset(p + "state:Counter/a", mapping={"etag": "e1", "nchunks": 0, "size": len(small), "d": small})
    await r.hset(p + "state:Counter/b", mapping={"etag": "e2", "nchunks": 2, "size": len(big)})
    await r.set(p + "state:Counter/b:ve2:0", big[:2000])
    await r.set(p + "state:Counter/b:ve2:1", big[2000:])
    await r.hset(p + "nstate:meta:g:Counter/a", mapping={"etag": "e3", "nchunks": 0, "size": len(small), "d": small})
    await r.hset(p + "ckpt:job:5", mapping={"members": json.dumps(["Counter/a"]), "order": 5, "keep": 3,
                                             "status": "complete", "written": 1, "created": 1, "w:Counter/a": 1})  # fmt: skip
    await r.zadd(p + "ckpt:job", {"5": 5})
    await r.hset(p + "ckpt:job:5:m:Counter/a", mapping={"etag": "e4", "nchunks": 0, "size": len(small), "d": small})
    await r.hset(p + "reminders:rows", '["Reminded","r","tick"]', json.dumps({"type": "Reminded", "key": "r", "name": "tick", "period_ms": 5000}))
    await r.zadd(p + "reminders", {'["Reminded","r","tick"]': 1})
    try:
        moved = await migrate(r, k)
        assert moved == {"directory": 1, "state": 4, "named_state": 1, "checkpoint": 1, "reminders": 2}
        assert await migrate(r, k) == dict.fromkeys(moved, 0)  # idempotent
        store = RedisStateStore(r, k, StorageSettings())
        a, b = GrainId("Counter", "a"), GrainId("Counter", "b")
        for grain, state, want in ((a, "", {"n": 1}), (b, "", {"blob": "x" * 3000}), (a, "meta", {"n": 1})):
            stored = await store.read(grain, state=state)
            assert stored is not None and CODEC.decode(stored.meta, stored.buffers) == want
        entry = await RedisGrainDirectory(r, k).lookup(a)
        assert entry is not None and (entry.activation_id, entry.token) == ("a1", 7)
        loaded, snap = await Checkpoints(r, k).load("job", None, a)
        assert snap == "5" and CODEC.decode(loaded.meta, loaded.buffers) == {"n": 1}
        assert [x.name for x in await ReminderTable(r, k).list()] == ["tick"]
        assert not [key async for key in r.scan_iter(match=p + "state:Counter/*")]
    finally:
        await close_redis(r)
