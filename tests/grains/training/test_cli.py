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


def test_the_last_line_says_what_became_of_the_job():
    from grains.training.api.messages import TrainingStatus
    from grains.training.console import outcome

    failed = TrainingStatus(job="j", status="failed", step=20, total_steps=60, error="RuntimeError: trainer 0: boom")
    assert outcome(failed) == "job j failed at step 20/60: RuntimeError: trainer 0: boom"
    stopped = TrainingStatus(job="j", status="completed", step=140, total_steps=140, best_step=120, best_metric="eval.accuracy",
                             best_value=0.9712, stopped_early="stopped at step 140 by callback mypkg:Stop")  # fmt: skip
    assert outcome(stopped) == (
        "job j stopped early at step 140 (best step 120, eval.accuracy 97.1%): stopped at step 140 by callback mypkg:Stop"
    )
    done = TrainingStatus(job="j", status="completed", step=180, total_steps=180, skipped=3)
    assert outcome(done) == "job j completed at step 180/180; 3 steps skipped"


async def test_an_early_stopped_job_says_so_and_save_best_writes_its_best_checkpoint(
    cluster, redis_url, cluster_name, tmp_path, capsys
):
    import torch

    from grains.cli.main import build_parser
    from grains.training import CoordinatorGrain
    from grains.training.console import run
    from silo.client import ClusterClient
    from tests.grains.training.conftest import GRAINS

    await cluster(2, grains=GRAINS)
    job = tmp_path / "early.toml"
    job.write_text(
        'job = "early"\nsteps = 3000\nbatch_size = 32\neval_every = 10\ncheckpoint_every = 10\nkeep_checkpoints = 2\n'
        'callbacks = ["tests.grains.training.test_user_loop:StopAtStep20"]\nkeep_best = "eval.loss:max"\n'
    )
    best, last = tmp_path / "best.pt", tmp_path / "last.pt"
    args = build_parser().parse_args(
        ["train", str(job), "--save", str(last), "--save-best", str(best), "--timeout", "120"]
    )
    assert await run(args, redis_url, cluster_name) == 0
    out = capsys.readouterr().out
    # The worst loss (keep_best "max" of the loss) is step 10's; the job stopped at 20.
    assert "job early stopped early at step 20 (best step 10, eval.loss" in out, out
    # Without a terminal: whole progress lines (rich cut them at 80 columns).
    progress = [line for line in out.splitlines() if line.startswith("early step ")]
    assert progress and all("samples/s" in line and "/step" in line for line in progress), out
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as client:
        coord = client.get_grain(CoordinatorGrain, "early")
        want_best, want_last = await coord.state_dict(best=True), await coord.state_dict()
    got_best, got_last = torch.load(best, weights_only=True), torch.load(last, weights_only=True)
    assert all(torch.equal(got_best[k], v) for k, v in want_best.items())
    assert all(torch.equal(got_last[k], v) for k, v in want_last.items())
    assert not all(torch.equal(got_best[k], got_last[k]) for k in got_last)
