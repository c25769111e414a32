"""samples/train_digits.py: 2 silos, 2 trainers, 2 shards, at least 95% on the digits test split."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


def test_train_digits_sample_reaches_95_percent_with_two_silos():
    out = subprocess.run(
        [sys.executable, "samples/train_digits.py"], cwd=REPO, capture_output=True, text=True, timeout=115, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert "completed" in line and "test accuracy" in line, line
    assert float(line.split("test accuracy ")[1].split("%")[0]) >= 95.0
