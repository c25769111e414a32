"""``python -m benchmarks dashboard --quick`` runs end to end and prints its ratio."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.slow
def test_dashboard_benchmark_quick_mode_prints_the_ratio() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "dashboard", "--quick"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "open/none" in out.stdout and "goal: under 3% difference" in out.stdout
    result = json.loads((REPO / "benchmarks" / "results" / "dashboard.json").read_text())
    assert result["quick"] is True
    assert {"pipelined x100", "sequential"} == set(result["results"])
    assert all(r["ratio_on_off"] > 0 for r in result["results"].values())
