"""``python -m benchmarks failover --quick`` runs end to end and prints both goals."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO


def test_failover_benchmark_quick_mode_prints_times_beside_the_goals() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "failover", "--quick"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SIGKILL (process gone)" in out.stdout and "SIGSTOP (hung)" in out.stdout
    assert "< 2 s" in out.stdout and "< 5 s" in out.stdout and "Orleans" in out.stdout
    result = json.loads((REPO / "benchmarks" / "results" / "failover.json").read_text())
    assert result["quick"] is True
    for kind in ("kill", "stop"):
        assert result["results"][kind]["failover_s"]["median"] > 0
