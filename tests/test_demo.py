"""`redgrain demo` as a new user runs it: non-interactive, from nothing to a trained model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_trains_digits_to_95_percent_and_survives_a_silo_kill(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "grains.cli", "demo", "--steps", "200", "--exit", "--data-dir", str(tmp_path / "data")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "dashboard: http://127.0.0.1:" in out
    assert "chaos: SIGKILL silo" in out and "survived the SIGKILL of silo" in out
    acc = float(re.search(r"test split:.*?accuracy ([0-9.]+)%", out, re.S).group(1))  # type: ignore[union-attr]
    assert acc >= 95.0, out
    assert "checkpoints (steps" in out
    assert "stopped: silos, dashboard and Redis are gone" in out
