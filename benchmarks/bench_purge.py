"""A dead silo's directory entries purged on one Redis and on a 3-master Redis Cluster.

``python -m benchmarks purge [--quick] [--entries N] [--rounds R]``

Issue 39, must-show 4: a purge of 200k entries on a 3-master Cluster no slower than on one
Redis. Each round fills the entries of a dead silo the way ``register`` leaves them (an entry
hash per grain, the silo's index set, its row in membership reading Dead), then times
``RedisGrainDirectory.purge_silo``, which purges in bounded steps (``directory.purge_batch``
grains a step per master). The two targets alternate round by round, so a machine that gets
busier or quieter shifts both alike. Printed: purged entries per second, the median of the
rounds, and the Cluster's rate as a ratio of one Redis'.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

from benchmarks.common import machine_facts, print_header, print_table, run, write_result
from grains.ids import SiloAddress
from silo.cluster.directory import RedisGrainDirectory
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.redis_util import close_redis, connect_redis, connect_redis_sync
from silo.testing.embedded import RedisServer
from silo.testing.redis_cluster import RedisClusterGroup

GOAL_RATIO = 1.0


def _fill(client: Any, keys: Keys, dead: MemberRow, n: int) -> None:
    """``n`` entries naming the dead silo, its index, and its row (Dead)."""
    client.hset(keys.members, dead.address, dead.model_dump_json())
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        grain = f"Counter/user-{i:07d}"
        pipe.hset(keys.directory_entry(grain), mapping={"silo": dead.address, "act": uuid.uuid4().hex, "token": f"1{i + 1:012d}"})
        pipe.sadd(keys.directory_index(dead.address), grain)
        if i % 5_000 == 4_999:
            pipe.execute()
    pipe.execute()


async def _purge(url: str, keys: Keys, dead: MemberRow) -> tuple[int, float]:
    client = connect_redis(url)
    try:
        directory = RedisGrainDirectory(client, keys)
        start = time.perf_counter()
        n = await directory.purge_silo(SiloAddress.parse(dead.address))
        return n, time.perf_counter() - start
    finally:
        await close_redis(client)


def _round(name: str, url: str, sync: Any, entries: int) -> float:
    keys = Keys(f"purge-{uuid.uuid4().hex[:8]}")
    port, generation = 1, 1
    dead = MemberRow(address=f"127.0.0.1:{port}@{generation}", host="127.0.0.1", port=port, generation=generation,
                     status=SiloStatus.DEAD, heartbeat=time.time(), grain_types=["Counter"])  # fmt: skip
    _fill(sync, keys, dead, entries)
    n, took = run(_purge(url, keys, dead))
    if n != entries:
        raise RuntimeError(f"{name}: purged {n} of {entries} entries")
    left = sync.exists(keys.directory_index(dead.address))
    if left:
        raise RuntimeError(f"{name}: the dead silo's index is still there")
    return n / took


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks purge")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--entries", type=int, default=None, help="entries of the dead silo (default 200,000; --quick 5,000)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per target (default 3; --quick 1)")
    args = p.parse_args(argv)
    entries = args.entries or (5_000 if args.quick else 200_000)
    rounds = args.rounds or (1 if args.quick else 3)
    facts = machine_facts()
    print_header(f"purge: {entries:,} directory entries of a dead silo, one Redis vs a 3-master Cluster", facts, args.quick)
    rates: dict[str, list[float]] = {"one Redis": [], "3-master Cluster": []}
    with tempfile.TemporaryDirectory(prefix="rg-purge-") as tmp, RedisServer() as single, \
            RedisClusterGroup(tmp, masters=3) as group:  # fmt: skip
        targets: dict[str, tuple[str, Any]] = {
            "one Redis": (single.url, connect_redis_sync(single.url)),
            "3-master Cluster": (group.url, connect_redis_sync(group.url)),
        }
        try:
            for r in range(rounds):
                for name, (url, sync) in targets.items():
                    rates[name].append(_round(name, url, sync, entries))
                    print(f"# round {r + 1}, {name}: {rates[name][-1]:,.0f} purged/s", flush=True)
        finally:
            for _, sync in targets.values():
                sync.close()  # type: ignore[attr-defined]
    med = {name: statistics.median(v) for name, v in rates.items()}
    ratio = med["3-master Cluster"] / med["one Redis"]
    print_table(["target", "purged/s (median)", "rounds"],
                [[name, f"{med[name]:,.0f}", " / ".join(f"{x:,.0f}" for x in rates[name])] for name in rates])  # fmt: skip
    print(f"# goal: the Cluster purges at least as fast as one Redis: {ratio:.2f}x {'met' if ratio >= GOAL_RATIO else 'MISSED'}")
    write_result("purge", {"machine": facts, "quick": args.quick, "entries": entries, "rates": rates, "median": med, "ratio": ratio})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
