"""The training benchmark runs (tiny sizes; its numbers are not checked here)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


# Most of the time goes to starting things: silos, torchrun's workers, Ray (about 13 s).
@pytest.mark.timeout(260)
def test_training_benchmark_quick_mode_runs_and_writes_its_results():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "training", "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "per-step overhead of 1 trainer" in out.stdout
    data = json.loads((REPO / "benchmarks" / "results" / "training_quick.json").read_text())
    rows = data["results"]["medium"]
    assert rows["2 trainers, 2 silos, sync, topk:0.01"]["bytes_per_step"] * 3 < rows["2 trainers, 2 silos, sync"]["bytes_per_step"]
    # The communication table: fp16 values shrink top-k's pushes by a quarter (8 -> 6 bytes per
    # entry; the fp16 pulls are the same), so the step's bytes fall, but by less than that.
    comm = rows["communication"]
    assert list(comm) == ["none", "fp16", "topk:0.01", "topk:0.01:fp16"]
    assert comm["topk:0.01"]["bytes_per_step"] * 0.75 < comm["topk:0.01:fp16"]["bytes_per_step"] < comm["topk:0.01"]["bytes_per_step"]
    assert all(isinstance(c["exchange_ms"], float) for c in comm.values()), comm
    assert "exchange ms/step = ms/step -" in out.stdout and rows["plain"]["cpu_ms"] > 0
    # The scaling row: 1, 2 and 4 trainers, with the ceiling stated.
    scaling = rows["scaling"]
    assert list(scaling) == ["1", "2", "4"] and scaling["4"]["row"] == "4 trainers, 2 silos, sync", scaling
    # (a quick job may end before its rate is sampled, so the rates can be 0 here); 4 trainers
    # ran: each pushes and pulls what each of 2 does, so the step moves twice the bytes.
    four, two = rows["4 trainers, 2 silos, sync"]["bytes_per_step"], rows["2 trainers, 2 silos, sync"]["bytes_per_step"]
    assert four == pytest.approx(2 * two, rel=0.01), (four, two)
    assert "ceiling: this machine has" in out.stdout
    ps = data["recovery"]["redgrain PS"]  # both kills recovered, with the times on record
    assert set(ps) == {"trainer", "shard"} and all(r["recovery_s"] > 0 for r in ps.values()), ps
    assert "slowest parameter-server recovery" in out.stdout
    cost = data["cost"]  # issue 38's cost rows ran, each against its plain loop
    assert cost["rounds"] and cost["join_s"] > 0 and cost["group_s"] > 0, cost
    assert "fixed per-step cost of 1 trainer" in out.stdout and "joining trainer, placed -> first step" in out.stdout
    if importlib.util.find_spec("ray") is not None:
        assert rows["Ray PS, 2 workers, sync"]["samples_per_s"] > 0, rows.get("ray_note")
        assert "redgrain / Ray parameter server, samples/s" in out.stdout
    else:
        assert "Ray parameter-server rows skipped" in out.stdout


@pytest.mark.timeout(120)
def test_the_step_census_counts_per_step_what_a_step_does():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "training", "--census", "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    census = json.loads((REPO / "benchmarks" / "results" / "training_census_quick.json").read_text())["census"]
    job, plain = census["job"], census["plain"]
    # The two jobs' difference leaves exactly what each step adds: one history entry a step,
    # and the MLP's step and update inline (no executor job), each call charged to who made it.
    assert job["redis"]["xadd"] == pytest.approx(1.0), job["redis"]
    # Inline, the step and the update are no executor jobs (on the executor: two a step). What
    # the process sends there by the clock (a connection's address lookup, say) a step counts
    # more of the longer the step took: under load it reached 0.06 a step.
    assert job["executor_jobs"] < 0.5, job["executor_jobs_by"]
    assert not [k for k in job["executor_jobs_by"] if "TrainerCore" in k or "ShardCore" in k or "_timed" in k], job["executor_jobs_by"]
    assert job["python_calls"] > plain["python_calls"] > 50 and plain["redis_commands"] == 0
    assert any("trainer" in what for what in job["by_what"]) and any("driver" in what for what in job["by_what"])
    assert "per-step census" in out.stdout
