"""``python -m benchmarks state --quick`` runs end to end and prints its ratios."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO


def test_state_benchmark_quick_mode_prints_ratios_against_raw_redis() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "state", "--quick"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "raw SET" in out.stdout and "# goal: state >= 70% of raw" in out.stdout
    result = json.loads((REPO / "benchmarks" / "results" / "state.json").read_text())
    assert result["quick"] is True
    assert set(result["results"]) == {"1 KB", "64 KB", "4 MB"}
    assert all(r["write_ratio"] > 0 and r["read_ratio"] > 0 for r in result["results"].values())
