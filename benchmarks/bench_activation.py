"""New activations per second: ``python -m benchmarks activation [--quick]``.

First calls to fresh keys of a randomly placed grain across 2 silo
subprocesses: each one is a directory register (a Lua script in Redis), an
activation, and the call itself. Measured two ways: with many first calls in
flight at once (throughput) and one at a time (first-call latency). The
baseline, in the same run, is a call to an already active grain.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from typing import Any

from benchmarks import common

_prefix = itertools.count()


async def measure(cluster: common.BenchCluster, quick: bool) -> dict[str, Any]:
    from benchmarks.grains import BenchEcho
    from silo.client import ClusterClient

    n = 100 if quick else 2000
    n_seq = 20 if quick else 300
    window = 200
    repeats = 2 if quick else 5
    async with await ClusterClient.connect(cluster.redis_url, cluster=cluster.cluster) as client:
        sem = asyncio.Semaphore(window)

        async def first_call(key: str) -> None:
            async with sem:
                await client.get_grain(BenchEcho, key).echo(0)

        async def burst() -> float:
            p = next(_prefix)
            t0 = time.perf_counter()
            await asyncio.gather(*(first_call(f"a{p}-{i}") for i in range(n)))
            return n / (time.perf_counter() - t0)

        lat: list[float] = []

        async def one_at_a_time() -> float:
            p = next(_prefix)
            lat.clear()
            t0 = time.perf_counter()
            for i in range(n_seq):
                t = time.perf_counter()
                await client.get_grain(BenchEcho, f"s{p}-{i}").echo(0)
                lat.append(time.perf_counter() - t)
            return n_seq / (time.perf_counter() - t0)

        warm = client.get_grain(BenchEcho, "warm")
        await warm.echo(0)

        async def active() -> float:
            t0 = time.perf_counter()
            for _ in range(n_seq):
                await warm.echo(0)
            return n_seq / (time.perf_counter() - t0)

        burst_r = await common.repeat(burst, repeats)
        seq_r = await common.repeat(one_at_a_time, repeats)
        p50, p99 = common.percentile(lat, 0.5) * 1e3, common.percentile(lat, 0.99) * 1e3
        active_r = await common.repeat(active, repeats)
    return {"concurrent_per_s": burst_r, "sequential_per_s": seq_r, "first_call_p50_ms": p50,
            "first_call_p99_ms": p99, "active_call_per_s": active_r, "n": n, "window": window}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks activation")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = parser.parse_args(argv)
    facts = common.machine_facts()
    common.print_header("activation: first calls to fresh keys across 2 silos", facts, args.quick)
    with common.BenchCluster(2) as cluster:
        r = common.run(measure(cluster, args.quick))
    seq, act = r["sequential_per_s"], r["active_call_per_s"]
    common.print_table(
        ["measure", "median", "spread", "/call to an active grain"],
        [
            [f"new activations/s ({r['window']} first calls in flight)", common.fmt_rate(r["concurrent_per_s"]["median"]),
             common.fmt_spread(r["concurrent_per_s"]), "-"],
            ["new activations/s (one at a time)", common.fmt_rate(seq["median"]), common.fmt_spread(seq),
             common.ratio(seq["median"], act["median"])],
            ["  first-call latency p50 / p99", f"{r['first_call_p50_ms']:.2f} / {r['first_call_p99_ms']:.2f} ms", "", ""],
            ["calls/s to an active grain (baseline)", common.fmt_rate(act["median"]), common.fmt_spread(act), "1.00x"],
        ],
    )  # fmt: skip
    common.write_result("activation", {"machine": facts, "quick": args.quick, "activation": r})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
