"""Two checkouts measured in one session, printed side by side.

    python -m benchmarks.side_by_side --baseline ../old-main [--rounds 2] [--what calls,training,serving]

``--baseline`` is another checkout of redgrain with its own ``.venv`` (``make
install`` there). Rounds alternate baseline and this tree, so a machine that
gets busier or quieter during the run shifts both columns alike. ``calls`` runs
``python -m benchmarks calls --no-ray`` in each tree and reads its
``benchmarks/results/calls.json``; ``training`` runs the medium configuration's
core rows (plain loop, 1 trainer, 2 trainers sync and async, all-reduce) with
each tree's own ``benchmarks.bench_training`` (this file is run as a worker
inside the other tree, so only functions both trees have are used); ``serving`` runs
``python -m benchmarks serving --no-ray`` and reads the per-second figures of
``benchmarks/results/serving.json`` (the Predictor, plain grain calls, the fronts over the wire).

``--what calls --interleave`` (or ``--what serving --interleave``) runs both trees at
once instead and alternates short bursts of each row (benchmarks/interleaved.py): on a
host whose speed drifts within minutes, the only form whose ratios separate a few
percent from noise. ``--rounds`` is then the number of bursts a row (30 calls rounds
are about 6 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
TRAINING_ROWS = ("1 trainer, 1 silo", "2 trainers, 2 silos, sync", "2 trainers, 2 silos, async", "2 trainers, 2 silos, allreduce")


def _python(tree: Path) -> str:
    exe = tree / ".venv" / "bin" / "python"
    if not exe.exists():
        raise SystemExit(f"{tree} has no .venv: run `make install` there first")
    return str(exe)


def _numbers(value: Any, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a results dict, keyed by its path."""
    out: dict[str, float] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(_numbers(v, f"{prefix}{k} / " if prefix or k else ""))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix.rstrip(" /")] = float(value)
    return out


def measure_calls(tree: Path) -> dict[str, float]:
    # Rebalancing off in both trees (the silos inherit the environment): moves of the
    # randomly placed grains mid-run would turn "one silo" rows into cross-silo ones.
    env = {**os.environ, "PYTHONPATH": str(tree), "REDGRAIN_REBALANCER__MAX_MOVES_PER_PERIOD": "0"}
    subprocess.run([_python(tree), "-m", "benchmarks", "calls", "--no-ray"], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL, env=env)  # fmt: skip
    data = json.loads((tree / "benchmarks" / "results" / "calls.json").read_text())
    rows = _numbers(data.get("redgrain", {}))
    return {k.replace(" / median", ""): v for k, v in rows.items() if k.endswith("/ median")}


def measure_serving(tree: Path) -> dict[str, float]:
    """The Predictor, plain grain calls and the over-the-wire rows (``serving --no-ray``): per second."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([_python(tree), "-m", "benchmarks", "serving", "--no-ray"], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL, env=env)  # fmt: skip
    data = json.loads((tree / "benchmarks" / "results" / "serving.json").read_text())
    parts = {"predictor": data.get("redgrain", {}), "grain call": data.get("grain_calls", {}),
             "wire": (data.get("wire") or {}).get("front", {})}  # fmt: skip
    rows: dict[str, float] = {}
    for part, value in parts.items():
        rows.update({f"{part} / {k}": v for k, v in _numbers(value).items() if k.endswith("per_s")})
    return rows


def measure_training(tree: Path) -> dict[str, float]:
    # run_path, not `python FILE`: a script's own folder would go first on sys.path, and
    # benchmarks/grains.py would shadow the grains package.
    worker = f"import runpy, sys; sys.argv = ['side_by_side', '--worker-training']; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
    proc = subprocess.run([_python(tree), "-c", worker], cwd=tree, check=True,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})  # fmt: skip
    return {k: float(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def _training_worker() -> None:
    """Inside a tree: the medium rows with that tree's benchmark code; prints one JSON line."""
    import asyncio

    from benchmarks import bench_training as bt
    from benchmarks.common import BenchCluster, fix_torch_threads
    from silo.client import ClusterClient

    fix_torch_threads()
    cfg, steps = bt.CONFIGS["medium"], 200
    rows: dict[str, float] = {"plain loop": bt.plain_loop(cfg, steps)["samples_per_s"]}

    async def jobs() -> None:
        with BenchCluster(1, grains="grains.training") as bc:
            async with await ClusterClient.connect(bc.redis_url, cluster=bc.cluster) as client:
                rows[TRAINING_ROWS[0]] = (await bt.run_job(client, "m-1", cfg, steps, trainers=1, shards=1))["samples_per_s"]
                bc.add_silo()
                await client.refresh()
                for label, kw in ((TRAINING_ROWS[1], {"mode": "sync", "shards": 2}), (TRAINING_ROWS[2], {"mode": "async", "shards": 2}),
                                  (TRAINING_ROWS[3], {"mode": "allreduce"})):  # fmt: skip
                    rows[label] = (await bt.run_job(client, f"m-{kw['mode']}", cfg, steps, trainers=2, **kw))["samples_per_s"]

    asyncio.run(jobs())
    print(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side")
    p.add_argument("--baseline", type=Path, help="another checkout (with .venv) to compare against")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--what", default="calls,training")
    p.add_argument("--interleave", action="store_true",
                   help="calls or serving: both trees at once, each row in alternating short bursts (benchmarks/interleaved.py)")
    p.add_argument("--rows", help="with --interleave: only these rows (comma-separated names)")
    p.add_argument("--worker-training", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_training:
        _training_worker()
        return 0
    if args.baseline is None:
        p.error("--baseline is required")
    trees = {"baseline": args.baseline.resolve(), "this tree": HERE}
    if args.interleave:
        from benchmarks import interleaved

        pythons = {name: _python(tree) for name, tree in trees.items()}
        only = args.rows.split(",") if args.rows else None
        what = "calls" if args.what == p.get_default("what") else args.what
        if what not in ("calls", "serving"):
            p.error("--interleave measures --what calls or --what serving")
        if what == "calls":
            result = interleaved.measure(trees["baseline"], HERE, pythons, args.rounds, only)
            interleaved.print_table(result)
        else:
            result = interleaved.measure_serving(trees["baseline"], HERE, pythons, args.rounds, only)
            interleaved.print_serving(result)
        out = HERE / "benchmarks" / "results" / f"side_by_side_interleaved{'' if what == 'calls' else '_serving'}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"baseline": str(trees["baseline"]), **result}, indent=2))
        print(f"# written to {out}", file=sys.stderr)
        return 0
    for what in args.what.split(","):
        fn = {"calls": measure_calls, "training": measure_training, "serving": measure_serving}[what]
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name, tree in trees.items():
                print(f"# {what}: round {r + 1}, {name} ({tree})", file=sys.stderr, flush=True)
                runs[name].append(fn(tree))
        keys = [k for k in runs["this tree"][0] if all(k in run for rs in runs.values() for run in rs)]
        print(f"\n## {what} ({args.rounds} rounds each, alternating; per second, higher is better)")
        print(f"{'row':<58} {'baseline':>24} {'this tree':>24} {'ratio':>6}")
        for k in keys:
            old = [run[k] for run in runs["baseline"]]
            new = [run[k] for run in runs["this tree"]]
            ratio = statistics.median(new) / statistics.median(old) if statistics.median(old) else float("nan")
            fmt = " / ".join(f"{v:,.0f}" if v >= 100 else f"{v:.2f}" for v in old), " / ".join(f"{v:,.0f}" if v >= 100 else f"{v:.2f}" for v in new)
            print(f"{k[:58]:<58} {fmt[0]:>24} {fmt[1]:>24} {ratio:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
