"""``python -m silo.testing.sim run --seeds 1-200 [--scenario NAME]`` and ``... scale --silos N --kill K``.

``run`` prints one line per failing seed (``seed N FAIL <invariant>: <detail>``
and the command that replays it), then ``digest <hex>`` over every seed's
event trace, and exits 1 if any seed failed. ``scale`` runs a cluster's
membership and failure detection at size N on virtual time and kills K silos.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Iterable
from typing import Any


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _run(args: argparse.Namespace) -> int:
    from silo.testing.sim.runner import scenario_for
    from silo.testing.sim.world import SCENARIOS

    if args.scenario is not None and args.scenario not in SCENARIOS:
        print(f"unknown scenario {args.scenario!r}; scenarios: {', '.join(sorted(SCENARIOS))}", file=sys.stderr)
        return 2
    # The runtime logs every fault it meets (a refused connection, a Redis cut); the
    # verdict is the checkers'. --log-level shows them when replaying one seed.
    total = hashlib.sha256()
    failed = failovers = lost = 0
    started = time.perf_counter()
    seeds = _seeds(args.seeds)
    jobs = max(1, min(args.jobs, len(seeds)))
    work = [(seed, scenario_for(seed, args.scenario).name, args.log_level, tuple(args.ignore)) for seed in seeds]
    results: Iterable[dict[str, Any]]
    if jobs == 1:
        results = map(_one, work)
    else:
        import multiprocessing

        # Forked workers inherit PYTHONHASHSEED and the imports; each seed runs alone in one.
        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap(_one, work)
    for r in results:
        seed, name = r["seed"], r["scenario"]
        replay = f"(replay: python -m silo.testing.sim run --seeds {seed} --scenario {name})"
        total.update(f"{seed}:{r['digest']}".encode())
        failovers, lost = failovers + r["failovers"], lost + r["lost"]
        if args.verbose:
            print(f"seed {seed} {name} {'FAIL' if r['violation'] else 'ok'} calls {r['calls']} events {r['events']} "
                  f"faults {r['faults']} digest {r['digest'][:16]}", flush=True)  # fmt: skip
        if r["violation"] is None:
            continue
        failed += 1
        print(f"seed {seed} FAIL {r['violation']} {replay}", flush=True)
        if args.shrink and r["faults"]:
            from silo.testing.sim.runner import run_seed, shrink

            scenario = SCENARIOS[name]
            out = run_seed(seed, scenario)
            if out.violation is not None:
                small = shrink(seed, scenario, out)
                print(f"  seed {seed} shrunk to {len(small.faults)} of {len(out.faults)} faults: "
                      f"{', '.join(str(f) for f in small.faults) or 'none'}", flush=True)  # fmt: skip
        if args.first_failure:
            break
    if jobs > 1:
        pool.terminate()
    took = time.perf_counter() - started
    if failovers:
        # What the docs allow a failover to lose (docs/reliability.md), counted, not failed.
        print(f"{failovers} Redis failovers; acknowledged writes they lost: {lost} (each acknowledged short of its replica)", flush=True)
    print(f"{len(seeds)} seeds, {failed} failed, {took:.1f} s; digest {total.hexdigest()}", flush=True)
    return 1 if failed else 0


def _one(work: tuple[int, str, str, tuple[str, ...]]) -> dict[str, Any]:
    """Run one seed (in this process or a pool's worker); what the report needs of it."""
    import logging

    from silo.testing.sim import checks
    from silo.testing.sim.runner import run_seed
    from silo.testing.sim.world import SCENARIOS

    seed, name, level, ignore = work
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(name)s %(levelname)s %(message)s")
    logging.getLogger().setLevel(getattr(logging, level.upper()))
    checks.CHECKS[:] = [c for c in checks.ALL_CHECKS if c.__name__ not in ignore]
    try:
        out = run_seed(seed, SCENARIOS[name])
    except Exception as exc:  # noqa: BLE001 - a world that breaks is a failing seed, not a crash of the tool
        return {"seed": seed, "scenario": name, "digest": "crash", "violation": f"crashed: {type(exc).__name__}: {exc}",
                "calls": 0, "events": 0, "faults": [], "failovers": 0, "lost": 0}  # fmt: skip
    return {
        "seed": seed, "scenario": name, "digest": out.digest, "violation": None if out.violation is None else str(out.violation),
        "calls": out.calls, "events": out.events, "faults": [str(f) for f in out.faults],
        "failovers": out.failovers, "lost": out.lost_acknowledged,
    }  # fmt: skip


def _scale(args: argparse.Namespace) -> int:
    from silo.testing.sim.scale import run_scale

    return run_scale(silos=args.silos, kill=args.kill, seed=args.seed, window_s=args.window)


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0" and argv is None:
        # Sets of strings iterate by hash: fix it so a seed replays in any process.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "silo.testing.sim", *sys.argv[1:]])
    parser = argparse.ArgumentParser(prog="python -m silo.testing.sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run seeds and check every invariant")
    run.add_argument("--seeds", default="1-200", help="e.g. 1-200, or 7, or 1-10,40")
    run.add_argument("--scenario", default=None, help="one scenario for every seed (default: seeds cycle through all)")
    run.add_argument("--jobs", type=int, default=1, help="seeds run in this many processes at once")
    run.add_argument("--first-failure", action="store_true", help="stop at the first failing seed")
    run.add_argument("--shrink", action="store_true", help="shrink each failing seed's faults")
    run.add_argument("--log-level", default="critical", help="the runtime's log level (default: critical)")
    run.add_argument("--ignore", action="append", default=[], metavar="INVARIANT", help="skip one checker (exploring)")
    run.add_argument("-v", "--verbose", action="store_true", help="a line for every seed")
    scale = sub.add_parser("scale", help="membership and failure detection at scale, on virtual time")
    scale.add_argument("--silos", type=int, default=1000)
    scale.add_argument("--kill", type=int, default=3)
    scale.add_argument("--seed", type=int, default=1)
    scale.add_argument("--window", type=float, default=5.0, help="virtual seconds of idleness measured before the kills")
    args = parser.parse_args(argv)
    return _run(args) if args.command == "run" else _scale(args)


if __name__ == "__main__":
    sys.exit(main())
