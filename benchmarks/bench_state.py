"""Grain state throughput: ``python -m benchmarks state [--quick]``.

Writes and reads a tensor state through ``RedisStateStore`` (codec encode,
etag + fencing Lua, chunking above ``chunk_bytes``; read assembles the chunks
and decodes the tensor zero-copy) next to raw redis-py ``SET`` / ``GET`` of
the same number of bytes, in the same run against the same private
redis-server (no persistence). Sizes: 1 KB, 1 MB, 100 MB. Goal: the state
path moves at least 70% of raw's MB/s at 100 MB.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks import common

GOAL = 0.70


async def _measure(sizes: list[int], repeats: int, max_ops: int) -> dict[str, Any]:
    from silo.keys import Keys
    from silo.redis_util import connect_redis
    from silo.settings import StorageSettings
    from silo.storage.store import RedisStateStore
    from silo.testing.embedded import RedisServer

    results: dict[str, Any] = {}
    with RedisServer() as server:
        r = connect_redis(server.url, timeout_s=60)
        store = RedisStateStore(r, Keys("bench"), StorageSettings())
        try:
            for size in sizes:
                results[_label(size)] = await _measure_size(r, store, size, repeats, max_ops)
        finally:
            await r.aclose()
    return results


async def _measure_size(
    r: Any, store: Any, size: int, repeats: int, max_ops: int
) -> dict[str, Any]:
    import torch

    from grains.ids import GrainId
    from silo.codec import Codec

    codec = Codec()
    state = {"step": 1, "weights": torch.ones(size // 4, dtype=torch.float32)}
    raw = bytes(size)
    gid = GrainId("Bench", str(size))
    ops = max(1, min(max_ops, (64 << 20) // max(size, 1)))  # ~64 MB or max_ops per sample
    etag: str | None = None

    async def state_write() -> float:
        nonlocal etag
        t = time.perf_counter()
        for _ in range(ops):
            etag = await store.write(gid, codec.encode(state), etag, 0)
        return ops * size / (time.perf_counter() - t) / 1e6

    async def state_read() -> float:
        t = time.perf_counter()
        for _ in range(ops):
            stored = await store.read(gid)
            assert stored is not None
            out = codec.decode(stored.meta, stored.buffers)
            assert out["weights"].numel() == size // 4
        return ops * size / (time.perf_counter() - t) / 1e6

    async def raw_write() -> float:
        t = time.perf_counter()
        for _ in range(ops):
            await r.set("bench:raw", raw)
        return ops * size / (time.perf_counter() - t) / 1e6

    async def raw_read() -> float:
        t = time.perf_counter()
        for _ in range(ops):
            got = await r.get("bench:raw")
            assert got is not None and len(got) == size
        return ops * size / (time.perf_counter() - t) / 1e6

    row: dict[str, Any] = {}
    # Alternate the two sides so drift hits both alike.
    for name, fn in (("raw_write", raw_write), ("state_write", state_write),
                     ("raw_read", raw_read), ("state_read", state_read)):  # fmt: skip
        row[name] = await common.repeat(fn, repeats)
    row["write_ratio"] = row["state_write"]["median"] / row["raw_write"]["median"]
    row["read_ratio"] = row["state_read"]["median"] / row["raw_read"]["median"]
    await r.delete("bench:raw")
    await store.clear(gid, "*", 0)
    return row


def _label(size: int) -> str:
    for unit, n in (("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= n:
            return f"{size // n} {unit}"
    return f"{size} B"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks state")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    sizes = [1 << 10, 64 << 10, 4 << 20] if args.quick else [1 << 10, 1 << 20, 100 << 20]
    repeats = 1 if args.quick else args.repeats
    facts = common.machine_facts()
    common.print_header("grain state vs raw redis-py SET/GET (MB/s)", facts, args.quick)
    results = common.run(_measure(sizes, repeats, 20 if args.quick else 500))
    rows = []
    for label, row in results.items():
        rows.append([
            label,
            f"{row['raw_write']['median']:.1f}", f"{row['state_write']['median']:.1f}", f"{row['write_ratio']:.2f}",
            f"{row['raw_read']['median']:.1f}", f"{row['state_read']['median']:.1f}", f"{row['read_ratio']:.2f}",
            f"{common.fmt_spread(row['state_write'])} / {common.fmt_spread(row['state_read'])}",
        ])  # fmt: skip
    common.print_table(
        [
            "size",
            "raw SET",
            "state write",
            "ratio",
            "raw GET",
            "state read",
            "ratio",
            "state spread w/r",
        ],
        rows,
    )
    big = list(results)[-1]
    worst = min(results[big]["write_ratio"], results[big]["read_ratio"])
    verdict = "met" if worst >= GOAL else "NOT met"
    print(f"# goal: state >= {GOAL:.0%} of raw at {big}: write {results[big]['write_ratio']:.2f},"
          f" read {results[big]['read_ratio']:.2f} -> {verdict}")  # fmt: skip
    common.write_result(
        "state", {"quick": args.quick, "machine": facts, "goal": GOAL, "results": results}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
