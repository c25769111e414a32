"""Every ``benchmarks/bench_*.py`` runs in its tiny ``--quick`` mode and writes its JSON.

Numbers from --quick runs mean nothing; this only proves the suite still runs.
Ray columns run when ``ray`` is installed and are skipped, saying so, when not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# These two have smoke tests of their own that also check what they print
# (tests/grains/training/test_bench_smoke.py, tests/dashboard/test_bench_smoke.py).
OWN_SMOKE_TEST = {"training", "dashboard"}
BENCHES = sorted(
    p.stem.removeprefix("bench_")
    for p in (REPO / "benchmarks").glob("bench_*.py")
    if p.stem.removeprefix("bench_") not in OWN_SMOKE_TEST
)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", BENCHES)
def test_benchmark_runs_in_quick_mode_and_writes_its_json(name: str) -> None:
    result = REPO / "benchmarks" / "results" / f"{name}.json"
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", name, "--quick"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        check=False,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert result.exists() and result.stat().st_mtime >= started - 1, f"{name} did not write {result}"
    data = json.loads(result.read_text())
    assert data.get("quick") is True or "quick" not in data
    if name == "serving":  # the over-the-wire rows exist (their speed is not a test's business)
        wire = data["wire"]
        for kind in ("triton-http", "httpx-json"):
            assert set(wire["front"][kind]) == set(wire["noop"][kind]) == {"1", "8", "16", "64"}
        assert "front / no-op" in proc.stdout and "goal: tritonclient HTTP at 16 in flight" in proc.stdout
        assert "tritonclient gRPC row absent" in proc.stdout or "triton-grpc" in wire["kinds"]
        if importlib.util.find_spec("ray") is None:
            assert "Ray Serve HTTP row absent" in proc.stdout
        else:
            assert isinstance(data["ray_http"], dict), data["ray_http"]
    if name == "calls":
        ray_installed = importlib.util.find_spec("ray") is not None
        if ray_installed:
            assert data["ray"], data.get("ray_note")
        else:
            assert "Ray columns skipped" in proc.stdout and data["ray"] is None


def test_the_interleaved_interval_is_a_t_interval_of_the_rounds_log_ratios() -> None:
    from benchmarks.interleaved import interval

    assert interval([1.25] * 6) == pytest.approx((1.25, 1.25))
    lo, hi = interval([1.0, 4.0])  # geometric mean 2, t(1 df) = 12.71, sd of logs ln(4)/sqrt(2)
    assert lo == pytest.approx(2 / 4**6.355) and hi == pytest.approx(2 * 4**6.355)
    few, many = interval([0.9, 1.1] * 3), interval([0.9, 1.1] * 30)
    assert few[0] < many[0] < 1 < many[1] < few[1]  # more rounds, a narrower interval


_DESCRIPTORS = """
import os, threading
import numpy as np
from benchmarks.wire_clients import _caller

def one_client():
    call, close = _caller("triton-http", "127.0.0.1:1", "m", np.zeros((1, 4), np.float32))
    try:
        call()  # nothing listens there: refused, after the thread's gevent loop is made
    except Exception:
        pass
    close()

before = len(os.listdir("/proc/self/fd"))
for _ in range(20):
    t = threading.Thread(target=one_client)
    t.start()
    t.join()
print(len(os.listdir("/proc/self/fd")) - before)
"""


def test_a_tritonclient_http_caller_gives_back_its_threads_descriptors() -> None:
    # Each burst of the serving rows makes a client on each of up to 64 threads; gevent kept each
    # thread's event loop open after the thread ended (two descriptors a client), and a 100-round
    # interleaved run died at round 54 of "Too many open files". (In a process of its own: in
    # pytest's, the loops happened to be collected.)
    out = subprocess.run([sys.executable, "-c", _DESCRIPTORS], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert int(out.stdout.split()[-1]) < 5, out.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_side_by_side_interleaved_runs_both_trees_burst_for_burst() -> None:
    # This tree against itself: two workers (each its Redis, two silos, a client), two rows.
    result = REPO / "benchmarks" / "results" / "side_by_side_interleaved.json"
    started = time.time()
    rows = ["client_grain_seq_100B", "grain_grain_across_pipe_1MB"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.side_by_side", "--baseline", str(REPO), "--interleave", "--rounds", "2",
         "--rows", ",".join(rows)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, check=False, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert result.stat().st_mtime >= started - 1
    data = json.loads(result.read_text())
    assert list(data["rows"]) == rows and data["rounds"] == 2
    for name, row in data["rows"].items():
        # Every round ran one burst of the row's size on each tree, whole units only.
        assert row["calls"] == {"baseline": 2 * row["burst_calls"], "this tree": 2 * row["burst_calls"]}, name
        assert row["burst_calls"] % (64 if name.endswith("pipe_1MB") else 1) == 0
        assert row["baseline_per_s"] > 0 and row["this_per_s"] > 0 and 0 < row["interval"][0] <= row["interval"][1]
        assert name in proc.stdout
    assert "idle silos' CPU while the other tree runs" in proc.stdout
