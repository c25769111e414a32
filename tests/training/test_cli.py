"""`redgrain train`: a bad job file is refused with a clear message before anything starts."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def test_train_command_rejects_a_bad_job_file_with_a_clear_message(tmp_path, redis_url):
    job = tmp_path / "bad.toml"
    job.write_text('job = "bad"\ntrainers = 0\ncompression = "topk:0.01"\n')
    out = subprocess.run(
        [sys.executable, "-m", "silo.cli", "train", str(job), "--redis", redis_url, "--cluster", "cli-test"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "bad training job spec: trainers: a job needs at least one trainer" in out.stderr
