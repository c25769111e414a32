"""`redgrain train`: a bad job file is refused with a clear message before anything starts; `--status`
and the dashboard's job record show the job's recoveries."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO


def test_train_command_rejects_a_bad_job_file_with_a_clear_message(tmp_path, redis_url):
    job = tmp_path / "bad.toml"
    job.write_text('job = "bad"\ntrainers = 0\ncompression = "topk:0.01"\n')
    out = subprocess.run(
        [sys.executable, "-m", "grains.cli", "train", str(job), "--redis", redis_url, "--cluster", "cli-test"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "bad training job spec: trainers: a job needs at least one trainer" in out.stderr


def test_status_table_shows_the_last_recovery(capsys):
    from grains.training.api.messages import GroupChange, TrainingStatus
    from grains.training.console import _print_table

    change = GroupChange(generation=2, reason="shard(s) job/shard-1 lost or behind", at=100.0, trainers=2,
                         start_step=150, first_step_at=100.4)  # fmt: skip
    _print_table(TrainingStatus(job="j", status="running", step=170, total_steps=400, rollbacks=1, changes=[change]))
    out = capsys.readouterr().out
    assert "last recovery" in out and "from step 150" in out and "0.40 s after" in out, out


def test_the_dashboard_record_lists_the_jobs_recoveries():
    from grains.training.api.messages import GroupChange, TrainingStatus
    from grains.training.progress import job_progress

    changes = [
        GroupChange(generation=1, reason="trainer 1 restarted", at=10.0, trainers=2, start_step=40, first_step_at=10.3,
                    ranks=[1]),
        GroupChange(generation=2, reason="shard lost", at=20.0, trainers=2, start_step=50),
    ]  # fmt: skip
    rec = job_progress(TrainingStatus(job="j", status="running", changes=changes), None, [], []).recoveries
    assert [(r.start_step, r.trainers, r.back_after_s) for r in rec] == [(40, 1, pytest.approx(0.3)), (50, 0, None)]


async def test_train_with_save_writes_a_state_dict_the_model_loads_strictly(cluster, redis_url, cluster_name, tmp_path):
    import torch

    from grains.cli.main import build_parser
    from grains.training import TrainingJob
    from grains.training.console import run
    from grains.training.models import build_model
    from tests.grains.training.conftest import GRAINS

    await cluster(2, grains=GRAINS)
    job = tmp_path / "small.toml"
    job.write_text('job = "saved"\nmodel = "grains.training.models:cnn_bn"\nsteps = 30\nbatch_size = 16\n')
    target = tmp_path / "model.pt"
    args = build_parser().parse_args(["train", str(job), "--save", str(target), "--timeout", "120"])
    assert await run(args, redis_url, cluster_name) == 0
    model = build_model(TrainingJob(model="grains.training.models:cnn_bn"))
    model.load_state_dict(torch.load(target, weights_only=True), strict=True)
    assert int(model.state_dict()["2.num_batches_tracked"]) == 30  # BatchNorm's counter came back too
