"""Move a cluster's keys from the one-slot layout to the per-grain layout (decision 83).

Before decision 83 every key was ``rg:{cluster}:…``; a grain's directory entry,
states and checkpoint member blobs now live under the grain's own hash tag, and
the reminder tables under ``rg:{cluster:reminders}``. This renames what an
older version wrote, on the one Redis it ran on (``RENAME`` keeps values and
TTLs; Redis Cluster was refused then, so there is nothing to move on one)::

    python -m silo.migrate_keys --redis redis://127.0.0.1:6379/0 --cluster dev

Run it with every silo stopped. It is idempotent: a key already moved is not
found again. Leader leases are left to expire; indexes, membership and the
fencing counter kept their names.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import redis.asyncio as aioredis

from silo.keys import Keys, chunk_key
from silo.redis_util import close_redis, open_redis

__all__ = ["migrate"]


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def _move_blob(r: aioredis.Redis, old_head: str, new_head: str) -> int:
    """A head+chunks value: its chunks (named by the head's etag), then the head."""
    if not await r.exists(old_head):  # SCAN may name a key twice: moved already
        return 0
    etag, n = await r.hmget(old_head, ["etag", "nchunks"])
    moved = 0
    for i in range(int(n or 0)):
        old = chunk_key(old_head + ":v", _text(etag), i)
        if await r.exists(old):
            await r.rename(old, chunk_key(new_head + ":v", _text(etag), i))
            moved += 1
    await r.rename(old_head, new_head)
    return moved + 1


async def migrate(r: aioredis.Redis, keys: Keys) -> dict[str, int]:
    """Rename every old-layout key of ``keys.cluster``; returns how many of each kind moved."""
    p = keys.prefix
    out = {"directory": 0, "state": 0, "named_state": 0, "checkpoint": 0, "reminders": 0}
    async for raw in r.scan_iter(match=p + "dir:*", count=1000):
        old = _text(raw)
        if await r.exists(old):
            await r.rename(old, keys.directory_entry(old[len(p + "dir:") :]))
            out["directory"] += 1
    async for raw in r.scan_iter(match=p + "state:*", count=1000, _type="hash"):
        old = _text(raw)
        grain = old[len(p + "state:") :]
        out["state"] += await _move_blob(r, old, keys.state_head(grain))
    async for raw in r.scan_iter(match=p + "nstate:*:g:*", count=1000, _type="hash"):
        old = _text(raw)
        name, _, grain = old[len(p + "nstate:") :].partition(":g:")
        out["named_state"] += await _move_blob(r, old, keys.named_state_head(grain, name))
    async for raw in r.scan_iter(match=p + "ckpt:*:*:m:*", count=1000, _type="hash"):
        old = _text(raw)
        group, snap, member = _checkpoint_parts(old[len(p + "ckpt:") :])
        out["checkpoint"] += await _move_blob(r, old, keys.checkpoint_member(group, snap, member))
    for old, new in ((p + "reminders", keys.reminders), (p + "reminders:rows", keys.reminder_rows),
                     (p + "reminders:fired", keys.reminder_fired)):  # fmt: skip
        if await r.exists(old):
            await r.rename(old, new)
            out["reminders"] += 1
    return out


def _checkpoint_parts(rest: str) -> tuple[str, str, str]:
    """``{group}:{snap}:m:{member}``: group and snapshot ids have no ``:``."""
    group, _, tail = rest.partition(":")
    snap, _, member = tail.partition(":m:")
    return group, snap, member


async def _main(url: str, cluster: str) -> None:
    r = await open_redis(url, f"migrate keys of {cluster}")
    try:
        print(await migrate(r, Keys(cluster)))
    finally:
        await close_redis(r)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m silo.migrate_keys", description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", required=True, help="the Redis the cluster ran on")
    parser.add_argument("--cluster", required=True, help="the cluster name")
    args = parser.parse_args(argv)
    asyncio.run(_main(args.redis, args.cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
