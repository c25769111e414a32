"""The call rows (and the serving fronts' rows) of two checkouts, in alternating bursts in one run.

    python -m benchmarks.side_by_side --baseline ../old-main --what calls --interleave [--rounds 30]
    python -m benchmarks.side_by_side --baseline ../old-main --what serving --interleave [--rounds 20]

``side_by_side``'s plain mode runs each tree's whole ``calls`` benchmark in turn,
a few minutes each. On a shared host whose speed drifts by 1.5x within minutes
(docs/performance.md, sessions 18-19) two rounds of one tree differ as much as
the trees do, so a 5% difference cannot be read off them. Here both trees run at
once, each with its own Redis, two silos and a client (a worker process started
inside each tree, so each measures its own code), and the coordinator asks them
in turn for one short burst of one row: ``rounds`` times each row, the order of
the two trees swapped every round. A drift slower than a burst (about 0.2 s)
then falls on both trees alike.

A row's ratio is this tree's rate over the baseline's, from the summed times of
all bursts; its 95% interval comes from the per-round ratios (a t-interval on
their logarithms), so a reader sees whether a ratio below 1 is more than noise.
The idle tree is not paused: its silos' background work (heartbeats, a membership
poll) runs beside the other's burst, and each worker reports its silos' CPU per
second while idle, so that cost is seen, not guessed.

``--what serving``: each tree's worker starts ``redgrain serve`` (HTTP and gRPC) for the
digits model as ``benchmarks serving`` does, and this tree's clients
(benchmarks/wire_clients.py: tritonclient HTTP and gRPC, httpx JSON) drive each front in
turn at 1, 8, 16 and 64 requests in flight: the same client code for both, so only the
servers differ.

The worker only uses what both trees have (``BenchCluster``, ``BenchEcho``,
``BenchDriver``, ``ClusterClient``), so the baseline can be any checkout since
a965e2b.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SMALL = 100
MB = 1 << 20
BURST_S = 0.2
"""A burst's target length: long against the loop's start-up, short against the host's drift."""

# (row, what, payload bytes, unit): a burst is a whole number of units. A pipelined row's unit
# is the calls the calls benchmark puts in flight at once (10,000 of 100 B, 64 of 1 MB), issued
# together, the units one after another: wider, and a mailbox over max_queue (10,000) sheds.
ROWS: list[tuple[str, str, int, int]] = [
    ("client_grain_seq_100B", "client_seq", SMALL, 1),
    ("client_grain_pipe_100B", "client_pipe", SMALL, 10_000),
    ("grain_grain_one_silo_seq_100B", "same_seq", SMALL, 1),
    ("grain_grain_one_silo_pipe_100B", "same_pipe", SMALL, 10_000),
    ("grain_grain_across_seq_100B", "across_seq", SMALL, 1),
    ("grain_grain_across_pipe_100B", "across_pipe", SMALL, 10_000),
    ("client_grain_seq_1MB", "client_seq", MB, 1),
    ("client_grain_pipe_1MB", "client_pipe", MB, 64),
    ("grain_grain_one_silo_seq_1MB", "same_seq", MB, 1),
    ("grain_grain_one_silo_pipe_1MB", "same_pipe", MB, 64),
    ("grain_grain_across_seq_1MB", "across_seq", MB, 1),
    ("grain_grain_across_pipe_1MB", "across_pipe", MB, 64),
    ("tensor_across_16MB", "tensor_across", 16 * MB, 1),
    ("tensor_echo_client_16MB", "tensor_echo", 16 * MB, 1),
]


# --- inside each tree ---------------------------------------------------------------------------
def worker() -> None:
    """Serve bursts on stdin/stdout: ``ROW N`` runs N calls of ROW, answers ``[calls, seconds]``;
    ``IDLE S`` answers the silos' CPU seconds per second over S seconds of nothing."""
    import asyncio

    import psutil
    import torch

    from benchmarks.bench_calls import PINNED
    from benchmarks.common import BenchCluster, fix_torch_threads, run
    from benchmarks.grains import BenchDriver, BenchEcho
    from silo.client import ClusterClient

    fix_torch_threads()
    rows = {name: (what, size, unit) for name, what, size, unit in ROWS}

    async def place(client: Any, grain: type, n: int) -> dict[str, list[str]]:
        keys = [f"{grain.__name__}-{i}" for i in range(n)]
        by_silo: dict[str, list[str]] = {}
        for k, w in zip(keys, await asyncio.gather(*(client.get_grain(grain, k).where() for k in keys))):
            by_silo.setdefault(w, []).append(k)
        return by_silo

    async def serve(bc: BenchCluster) -> None:
        loop = asyncio.get_running_loop()
        async with await ClusterClient.connect(bc.redis_url, cluster=bc.cluster) as client:
            echoes, drivers = await place(client, BenchEcho, 24), await place(client, BenchDriver, 24)
            home = next(s for s in drivers if s in echoes and len(echoes) > 1)
            same, other = echoes[home][0], next(keys[0] for s, keys in echoes.items() if s != home)
            driver, echo = client.get_grain(BenchDriver, drivers[home][0]), client.get_grain(BenchEcho, other)
            payloads = {size: b"x" * size for size in {s for _, s, _ in rows.values() if s <= MB}}
            tensors = {size: torch.randn(size // 4) for size in {s for _, s, _ in rows.values() if s > MB}}
            silos = [psutil.Process(s.pid) for s in bc.silos]

            async def burst(what: str, size: int, unit: int, n: int) -> float:
                p = payloads.get(size)
                if what == "client_seq":
                    t0 = time.perf_counter()
                    for _ in range(n):
                        await echo.echo(p)
                    return time.perf_counter() - t0
                if what == "client_pipe":
                    t0 = time.perf_counter()
                    for _ in range(n // unit):
                        await asyncio.gather(*(echo.echo(p) for _ in range(unit)))
                    return time.perf_counter() - t0
                if what in ("same_seq", "across_seq"):
                    return float(sum(await driver.sequential(same if what == "same_seq" else other, n, p)))
                if what in ("same_pipe", "across_pipe"):
                    target = same if what == "same_pipe" else other
                    return float(sum([await driver.pipelined(target, unit, p) for _ in range(n // unit)]))
                if what == "tensor_across":
                    return float(sum(await driver.tensor_to(other, size, n)))
                t, t0 = tensors[size], time.perf_counter()
                for _ in range(n):
                    await echo.echo(t)
                return time.perf_counter() - t0

            print(json.dumps({"ready": [s.pid for s in bc.silos]}), flush=True)
            while True:
                line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
                if not line:
                    return
                if line[0] == "IDLE":
                    before = sum(sum(p.cpu_times()[:2]) for p in silos)
                    await asyncio.sleep(float(line[1]))
                    after = sum(sum(p.cpu_times()[:2]) for p in silos)
                    print(json.dumps([(after - before) / float(line[1])]), flush=True)
                    continue
                what, size, unit = rows[line[0]]
                n = int(line[1])
                print(json.dumps([n, await burst(what, size, unit, n)]), flush=True)

    with BenchCluster(2, env=PINNED) as bc:
        run(serve(bc))


# --- the coordinator -------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    unit: int
    size: int
    n: int = 1
    """Calls per burst, sized in the warm-up to take about BURST_S."""
    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    round_ratios: list[float] = field(default_factory=list)

    def rate(self, tree: str) -> float:
        return self.calls[tree] / self.seconds[tree] if self.seconds.get(tree) else 0.0


class Worker:
    def __init__(self, name: str, tree: Path, python: str, kind: str = "calls") -> None:
        self.name = name
        runner = (f"import runpy, sys; sys.argv = ['interleaved', {kind!r}]; "
                  f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__worker__')")  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen([python, "-c", runner], cwd=tree, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip

    def ready(self) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{") and "ready" in json.loads(line):
                return json.loads(line)["ready"]
        raise RuntimeError(f"the {self.name} worker ended before it was ready (exit {self.proc.wait()})")

    def ask(self, command: str) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker ended (exit {self.proc.wait()})")
        return [float(x) for x in json.loads(line)]

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def interval(ratios: list[float]) -> tuple[float, float]:
    """A 95% interval of the typical per-round ratio (a t-interval on logarithms); (nan, nan) with <2."""
    if len(ratios) < 2:
        return math.nan, math.nan
    logs = [math.log(r) for r in ratios]
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    # t quantiles for 95%, two-sided; 1.96 past 30 degrees of freedom.
    df = len(logs) - 1
    t = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}.get(df, 2.23 if df < 15 else 2.05 if df < 30 else 1.96)
    half = t * sd / math.sqrt(len(logs))
    return math.exp(mean - half), math.exp(mean + half)


def measure(baseline: Path, this: Path, python: dict[str, str], rounds: int, only: list[str] | None = None) -> dict[str, Any]:
    """Both trees' rows in ``rounds`` alternating bursts; the rows, ratios and intervals as a dict."""
    workers = {"baseline": Worker("baseline", baseline, python["baseline"]), "this tree": Worker("this tree", this, python["this tree"])}
    rows = [Row(name, unit, size) for name, _, size, unit in ROWS if only is None or name in only]
    try:
        for w in workers.values():
            w.ready()
        for row in rows:  # warm-up, and the burst size: about BURST_S on the baseline
            n = row.unit
            while True:
                for w in workers.values():
                    w.ask(f"{row.name} {n}")
                _, took = workers["baseline"].ask(f"{row.name} {n}")
                if took >= BURST_S / 2 or n >= 1_000_000:
                    break
                n = max(n * 2, int(n * BURST_S / max(took, 1e-6)) // row.unit * row.unit)
            row.n = n
        idle = {name: w.ask("IDLE 2")[0] for name, w in workers.items()}
        for r in range(rounds):
            order = list(workers) if r % 2 == 0 else list(workers)[::-1]
            for row in rows:
                took: dict[str, float] = {}
                for name in order:
                    n, took[name] = workers[name].ask(f"{row.name} {row.n}")
                    row.calls[name] = row.calls.get(name, 0) + int(n)
                    row.seconds[name] = row.seconds.get(name, 0.0) + took[name]
                row.round_ratios.append(took["baseline"] / took["this tree"])
            print(f"# interleaved: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    out: dict[str, Any] = {"rounds": rounds, "idle_silo_cpu_per_s": idle, "rows": {}}
    for row in rows:
        lo, hi = interval(row.round_ratios)
        base, ours = row.rate("baseline"), row.rate("this tree")
        scale = row.size if row.size > MB else 1  # tensor rows: bytes/s, as the calls benchmark prints them
        out["rows"][row.name] = {
            "baseline_per_s": base * scale, "this_per_s": ours * scale, "ratio": ours / base if base else math.nan,
            "interval": [lo, hi], "burst_calls": row.n, "calls": dict(row.calls),
        }  # fmt: skip
    return out


def print_table(result: dict[str, Any]) -> None:
    idle = result["idle_silo_cpu_per_s"]
    print(f"\n## calls, interleaved ({result['rounds']} alternating bursts a row; per second, higher is better)")
    print(f"idle silos' CPU while the other tree runs: baseline {idle['baseline'] * 1000:.1f} ms/s,"
          f" this tree {idle['this tree'] * 1000:.1f} ms/s")  # fmt: skip
    print(f"{'row':<34} {'baseline':>14} {'this tree':>14} {'ratio':>6}  {'95% interval':>13}")
    for name, r in result["rows"].items():
        def fmt(v: float, tensor: bool = name.startswith("tensor")) -> str:
            return f"{v / 1e9:.2f} GB/s" if tensor else f"{v:,.0f}"

        lo, hi = r["interval"]
        print(f"{name:<34} {fmt(r['baseline_per_s']):>14} {fmt(r['this_per_s']):>14} {r['ratio']:>5.2f}x  {lo:.2f}-{hi:.2f}")


# --- serving: the fronts over the wire --------------------------------------------------------------
def serving_worker() -> None:
    """Inside a tree: its own Redis, a serving silo and ``redgrain serve`` (HTTP and gRPC) for the
    digits model, as ``benchmarks serving`` starts them; prints the ports, serves until stdin closes."""
    import tempfile

    from benchmarks import common, serving_wire
    from benchmarks.bench_serving import save_weights
    from benchmarks.serving_common import MAX_BATCH, MODELS

    model = serving_wire.MODEL
    factory, features = MODELS[model]
    with tempfile.TemporaryDirectory() as tmp, common.BenchCluster(1, grains="grains.serving") as lc:
        weights = save_weights(Path(tmp))[model]
        port, grpc_port = serving_wire._free_port(), serving_wire._free_port()
        front = common.start_subprocess(
            ["-m", "grains.cli", "serve", "--redis", lc.redis_url, "--cluster", lc.cluster, "--name", model,
             "--model", factory, "--weights", weights, "--input", f"input:FP32:-1,{features}",
             "--max-batch-size", str(MAX_BATCH), "--port", str(port), "--grpc-port", str(grpc_port)]
        )  # fmt: skip
        try:
            serving_wire._wait_ready(f"127.0.0.1:{port}", front, f"/v2/models/{model}/ready")
            print(json.dumps({"ready": {"http": port, "grpc": grpc_port, "model": model, "features": features}}), flush=True)
            sys.stdin.read()
        finally:
            serving_wire._stop(front)


SERVING_IN_FLIGHT = (1, 8, 16, 64)


def measure_serving(baseline: Path, this: Path, python: dict[str, str], rounds: int, only: list[str] | None = None) -> dict[str, Any]:
    """The fronts of both trees, driven by this tree's clients (benchmarks/wire_clients.py), one
    burst of one kind and concurrency at a time, alternating; as :func:`measure` for calls."""
    from benchmarks import wire_clients
    from benchmarks.serving_wire import kinds_available

    workers = {"baseline": Worker("baseline", baseline, python["baseline"], "serving"),
               "this tree": Worker("this tree", this, python["this tree"], "serving")}  # fmt: skip
    kinds, _ = kinds_available()
    rows = [Row(f"{kind} / {c}", c, 0) for kind in kinds for c in SERVING_IN_FLIGHT]
    rows = [r for r in rows if only is None or r.name in only]
    try:
        fronts = {name: w.ready() for name, w in workers.items()}

        def burst(tree: str, row: Row) -> float:
            kind, c = row.name.split(" / ")
            f = fronts[tree]
            url = f"127.0.0.1:{f['grpc'] if kind == 'triton-grpc' else f['http']}"
            got = wire_clients.measure(kind, url, f["model"], f["features"], int(c), row.n, int(c))
            return float(got["requests"] / got["per_s"])

        for row in rows:
            n = row.unit * 20
            while True:
                for tree in workers:
                    burst(tree, _sized(row, n))
                took = burst("baseline", _sized(row, n))
                if took >= BURST_S or n >= 1_000_000:
                    break
                n = max(n * 2, int(n * 1.5 * BURST_S / max(took, 1e-6)) // row.unit * row.unit)
            row.n = n
        for r in range(rounds):
            order = list(workers) if r % 2 == 0 else list(workers)[::-1]
            for row in rows:
                took: dict[str, float] = {}
                for name in order:
                    took[name] = burst(name, row)
                    row.calls[name] = row.calls.get(name, 0) + row.n
                    row.seconds[name] = row.seconds.get(name, 0.0) + took[name]
                row.round_ratios.append(took["baseline"] / took["this tree"])
            print(f"# interleaved serving: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    out: dict[str, Any] = {"rounds": rounds, "rows": {}}
    for row in rows:
        lo, hi = interval(row.round_ratios)
        base, ours = row.rate("baseline"), row.rate("this tree")
        out["rows"][row.name] = {"baseline_per_s": base, "this_per_s": ours, "ratio": ours / base if base else math.nan,
                                 "interval": [lo, hi], "burst_calls": row.n, "calls": dict(row.calls)}  # fmt: skip
    return out


def _sized(row: Row, n: int) -> Row:
    return Row(row.name, row.unit, row.size, n)


def print_serving(result: dict[str, Any]) -> None:
    print(f"\n## serving over the wire, interleaved ({result['rounds']} alternating bursts a row; requests/s)")
    print(f"{'client / in flight':<34} {'baseline':>14} {'this tree':>14} {'ratio':>6}  {'95% interval':>13}")
    for name, r in result["rows"].items():
        lo, hi = r["interval"]
        print(f"{name:<34} {r['baseline_per_s']:>14,.0f} {r['this_per_s']:>14,.0f} {r['ratio']:>5.2f}x  {lo:.2f}-{hi:.2f}")


if __name__ == "__worker__":
    serving_worker() if sys.argv[1:] == ["serving"] else worker()
