"""The training benchmark runs (tiny sizes; its numbers are not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


def test_training_benchmark_quick_mode_runs_and_writes_its_results():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "training", "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "per-step overhead of 1 trainer" in out.stdout
    data = json.loads((REPO / "benchmarks" / "results" / "training_quick.json").read_text())
    rows = data["results"]["medium"]
    assert rows["2 trainers, 2 silos, sync, topk:0.01"]["bytes_per_step"] * 3 < rows["2 trainers, 2 silos, sync"]["bytes_per_step"]
