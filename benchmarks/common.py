"""Shared by every benchmark: machine facts, statistics, result files, a cluster to measure.

Thread counts are fixed (one BLAS/OpenMP thread per process, set before torch
loads) so numbers from different runs compare; the header of every result
says what machine they come from.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from silo.testing.local import LocalCluster, SiloLaunch

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
T = TypeVar("T")

# Every process of a benchmark (this one, silos, baselines) runs with these.
FIXED_THREADS = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
}
os.environ.update(FIXED_THREADS)


def fix_torch_threads() -> None:
    """One intra-op and one inter-op thread, like the silos (call before any torch work)."""
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or torch already ran parallel work
        pass


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def redis_server_version() -> str:
    from silo.testing.embedded import find_redis_server

    try:
        out = subprocess.run([find_redis_server(), "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    for word in out.stdout.split():
        if word.startswith("v="):
            return word[2:]
    return out.stdout.strip()[:40]


def machine_facts() -> dict[str, Any]:
    """What a reader needs to know to compare numbers across machines."""
    return {
        "cpu_count": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "msgpack": _version("msgpack"),
        "uvloop": _version("uvloop"),
        "redis_server": redis_server_version(),
        "redis_py": _version("redis"),
        "ray": _version("ray"),
        "threads": dict(FIXED_THREADS),
        "load_average_at_start": os.getloadavg(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_header(title: str, facts: dict[str, Any], quick: bool) -> None:
    print(f"# {title}{' (quick: tiny sizes, numbers not meaningful)' if quick else ''}")
    print(
        f"# {facts['cpu_count']} CPUs ({facts['cpu']}), Python {facts['python']}, torch {facts['torch']},"
        f" numpy {facts['numpy']}, redis-server {facts['redis_server']}, uvloop {facts['uvloop']},"
        f" ray {facts['ray'] or 'not installed'}; 1 BLAS/OpenMP thread per process;"
        f" load average at start {facts['load_average_at_start'][0]:.1f}"
    )


# --- statistics -----------------------------------------------------------------------------
def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median and spread of repeated measurements (spread = (max - min) / median)."""
    med = statistics.median(samples)
    lo, hi = min(samples), max(samples)
    return {
        "median": med,
        "min": lo,
        "max": hi,
        "spread": (hi - lo) / med if med else 0.0,
        "samples": list(samples),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of values, nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def repeat(measure: Callable[[], Awaitable[float]], repeats: int, warmup: int = 1) -> dict[str, Any]:
    """Run ``measure`` warmup + repeats times; summarize the last ``repeats``."""
    for _ in range(warmup):
        await measure()
    return summarize([await measure() for _ in range(repeats)])


def call_rates(
    call: Callable[[], Awaitable[Any]], n_seq: int, n_pipe: int, lat: list[float]
) -> tuple[Callable[[], Awaitable[float]], Callable[[], Awaitable[float]]]:
    """The two measures every call benchmark takes: sequential calls/s (latencies into
    ``lat``) and pipelined calls/s (``n_pipe`` calls in flight through asyncio.gather)."""

    async def sequential() -> float:
        lat.clear()
        t0 = time.perf_counter()
        for _ in range(n_seq):
            t = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t)
        return n_seq / (time.perf_counter() - t0)

    async def pipelined() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(call() for _ in range(n_pipe)))
        return n_pipe / (time.perf_counter() - t0)

    return sequential, pipelined


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def fmt_spread(s: dict[str, Any]) -> str:
    return f"±{100 * s['spread'] / 2:.0f}%"


def ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in columns], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/NAME.json`` (the directory is created if needed)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **data}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"# results written to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return path


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a benchmark coroutine on uvloop when installed (as silos do)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


# --- a cluster to measure ---------------------------------------------------------------------
class BenchCluster(LocalCluster):
    """A :class:`~silo.testing.local.LocalCluster` with the benchmarks' settings.

    A private redis-server that writes nothing to disk and ``silos`` silo
    subprocesses hosting ``grains``, with the fixed thread counts, imports
    and working directory at the repository (so ``python_args=["-m",
    "cProfile", "-o", "silo.prof"]`` writes ``silo.prof`` there).
    ``with BenchCluster(2) as c: c.redis_url, c.cluster, c.silos``; everything
    is stopped on exit.
    """

    def __init__(
        self,
        silos: int = 1,
        *,
        grains: str = "benchmarks.grains",
        env: Mapping[str, str] | None = None,
        cluster: str = "bench",
        python_args: Sequence[str] = (),
    ) -> None:
        launch = SiloLaunch(
            env={**FIXED_THREADS, **(env or {})}, python_args=tuple(python_args), cwd=REPO, import_path=(REPO,)
        )
        super().__init__(grains, silos=silos, cluster=cluster, launch=launch, persist=False)

    @property
    def redis_pid(self) -> int | None:
        return self.redis.pid if self.redis is not None else None


def start_subprocess(args: list[str]) -> subprocess.Popen[str]:
    """A Python helper process with fixed thread counts, talking on stdin/stdout."""
    # The repository first; the caller's own PYTHONPATH (Ray installed apart, say) after it.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, **FIXED_THREADS, "PYTHONPATH": path}
    return subprocess.Popen(
        [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
