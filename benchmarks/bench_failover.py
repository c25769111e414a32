"""Failover time with DEFAULT membership settings: SIGKILL and SIGSTOP of a silo.

``python -m benchmarks failover [--quick] [--trials N]``

Three real silo processes; a client calls every grain of one silo in a loop.
Measured per trial: from the signal to the first successful call of one of
that silo's grains on another silo (and when the client saw it declared
Dead). The baseline measured in the same run is a restart from scratch: the
time to start a replacement silo process until it serves (what a
restart-based system pays at best before reloading any state).
Goals (DESIGN.md §4): under 2 s for a killed silo, under 5 s for a hung one.
Anchors: Orleans declares a silo dead after ~15 s+ by default, Ray restarts
actors in 15-50 s, torchrun's restart from a checkpoint took 2.3-3.3 s here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.census import print_census
from benchmarks.common import (
    BenchCluster,
    machine_facts,
    print_header,
    print_table,
    run,
    summarize,
    write_result,
)
from grains import Grain, random_placement

GOALS = {"kill": 2.0, "stop": 5.0}
ANCHORS = {"kill": "Orleans ~15 s+, Ray 15-50 s", "stop": "Orleans ~15 s+, Ray 15-50 s"}
ORLEANS_S = 15.0


@random_placement
class FailoverProbe(Grain):
    """Answers with the silo it runs on."""

    async def where(self) -> str:
        return str(self.silo)


async def _trial(client: Any, cluster: BenchCluster, kind: str, n: int) -> dict[str, float]:
    from silo import errors

    keys = [f"{kind}{n}-{i}" for i in range(30)]
    placed = {k: await client.get_grain(FailoverProbe, k).where() for k in keys}
    live = [s for s in cluster.silos if s.alive()]
    victim = max(live, key=lambda s: sum(v == str(s.address) for v in placed.values()))
    address = victim.address
    assert address is not None
    mine = [k for k, v in placed.items() if v == str(address)]
    done = asyncio.Event()
    first_ok: list[float] = []

    async def hammer(key: str) -> None:
        ref = client.get_grain(FailoverProbe, key).with_timeout(10.0)
        while not done.is_set():
            try:
                where = await ref.where()
            except errors.RedgrainError:
                continue  # in flight on the victim when it was declared dead (at-most-once)
            if where != str(address):
                first_ok.append(time.monotonic())
                done.set()

    callers = [asyncio.ensure_future(hammer(k)) for k in mine]
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    detected = None
    while not done.is_set() or detected is None:
        if detected is None and client.view.is_dead(address):
            detected = time.monotonic() - t0
        if time.monotonic() - t0 > 60:
            raise RuntimeError(f"{kind}: no failover within 60 s")
        await asyncio.sleep(0.005)
    await asyncio.gather(*callers)
    victim.kill()
    return {"failover_s": first_ok[0] - t0, "detected_s": detected}


async def _main(trials: int, quick: bool = False, census_s: float = 0.0) -> dict[str, Any]:
    from silo.client import ClusterClient

    out: dict[str, Any] = {"kill": [], "stop": [], "restart_s": [], "census": []}
    # Default membership settings: no REDGRAIN_MEMBERSHIP__* in the environment.
    env = {k: "" for k in os.environ if k.startswith("REDGRAIN_MEMBERSHIP__")}
    for k in env:
        os.environ.pop(k, None)
    # Quick: the three silos start at once; the restart baseline is then the one silo re-added
    # after the kill (the full run also times each of the first three starts).
    with BenchCluster(3 if quick else 0, grains="benchmarks.bench_failover") as cluster:
        for _ in range(0 if quick else 3):
            t = time.monotonic()
            await asyncio.to_thread(cluster.add_silo)
            out["restart_s"].append(time.monotonic() - t)
        if census_s > 0:  # who sends what while the three silos are idle, before any trial
            from benchmarks.census import census

            await asyncio.sleep(5.0)  # past the joins
            who = await asyncio.to_thread(census, cluster.redis_url, census_s)
            out["census"] = who.per_silo_s(len(cluster.silos))
        client = await ClusterClient.connect(cluster.redis_url, cluster=cluster.cluster)
        try:
            plan = [(n, kind) for n in range(trials) for kind in ("kill", "stop")]
            for i, (n, kind) in enumerate(plan):
                out[kind].append(await _trial(client, cluster, kind, n))
                if i + 1 < len(plan) and sum(s.alive() for s in cluster.silos) < 3:
                    t = time.monotonic()
                    await asyncio.to_thread(cluster.add_silo)  # back to three silos
                    out["restart_s"].append(time.monotonic() - t)
                    await client.refresh()
        finally:
            await client.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks failover")
    parser.add_argument("--quick", action="store_true", help="one kill and one stop (smoke test)")
    parser.add_argument("--trials", type=int, default=5, help="kills and stops each (default 5)")
    parser.add_argument("--census", type=float, default=5.0,
                        help="seconds of MONITOR on the idle silos first: which component sends what (0: none)")
    args = parser.parse_args(list(argv or []))
    trials = 1 if args.quick else max(1, args.trials)
    facts = machine_facts()
    print_header("failover: signal -> first successful call of the silo's grain elsewhere", facts, args.quick)
    data = run(_main(trials, args.quick, 0.0 if args.quick else args.census))
    restart = summarize(data["restart_s"])
    rows = []
    results: dict[str, Any] = {}
    for kind, label in (("kill", "SIGKILL (process gone)"), ("stop", "SIGSTOP (hung)")):
        fail = summarize([t["failover_s"] for t in data[kind]])
        det = summarize([t["detected_s"] for t in data[kind]])
        results[kind] = {"failover_s": fail, "detected_s": det, "goal_s": GOALS[kind]}
        rows.append([
            label, len(data[kind]), f"{det['median']:.2f} s", f"{fail['median']:.2f} s",
            f"{fail['min']:.2f}-{fail['max']:.2f} s", f"< {GOALS[kind]:.0f} s",
            "met" if fail["median"] < GOALS[kind] else "MISSED",
            f"{fail['median'] / restart['median']:.2f}x", f"{ORLEANS_S / fail['median']:.1f}x faster",
            ANCHORS[kind],
        ])  # fmt: skip
    print_table(
        ["scenario", "n", "declared dead", "failover (median)", "range", "goal", "", "vs restart",
         "vs Orleans 15 s", "anchors"],
        rows,
    )  # fmt: skip
    print(f"# baseline (same run): restart a silo process until it serves: median {restart['median']:.2f} s")
    if data["census"]:
        print("\n# who sends what, 3 idle silos before the trials "
              f"({args.census:.0f} s of MONITOR; commands/s per silo, a script's inner commands charged to it):")
        print_census(data["census"])
    write_result(
        "failover",
        {"quick": args.quick, "machine": facts, "results": results, "restart_s": restart,
         "settings": "default MembershipSettings (heartbeat 1 s, suspect 3 s, dead 4 s, probe 0.25 s)",
         "idle_census": data["census"]},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
