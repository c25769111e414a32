"""/metrics passes ``promtool check metrics`` (Prometheus' own linter) with everything in it.

A real cluster with calls (some raising), a reminder, a training job's record
and a silo stats record with GPU figures: every family the dashboard writes is
present, so a name, type or HELP line promtool objects to fails here.
``make test`` installs Debian's ``prometheus`` package for promtool.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path
from subprocess import PIPE, STDOUT

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from grains.call import Call
from grains.training.api.records import JobProgress, publish_job_progress
from silo import errors
from silo.client import ClusterClient
from silo.keys import Keys
from silo.records.stats import GpuRecord
from tests.dashboard.conftest import CALM
from tests.dashboard.test_metrics import put_stats_record
from tests.sample_grains import Echo, Reminded

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def grafana_exprs() -> list[str]:
    """Every PromQL query of deploy/grafana-dashboard.json (panels and variables)."""
    board = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    return exprs + [v["definition"] for v in board["templating"]["list"] if "definition" in v]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is missing: `make test` installs it as root; else run "
            "'sudo apt-get install -y --no-install-recommends prometheus' (Debian's package ships /usr/bin/promtool)"
        )
    return path


async def test_metrics_with_jobs_reminders_errors_and_gpus_pass_promtool(
    cluster, client: ClusterClient, api: TestClient, cluster_name: str
) -> None:
    tool = promtool()
    # Publishing hourly: the records below are the only ones after the first.
    (silo,) = await cluster(1, membership=CALM, stats_interval_s=3600.0)
    keys = Keys(cluster_name)
    for i in range(20):
        await client.get_grain(Echo, f"e{i % 4}").echo(i)
    with pytest.raises(errors.RemoteGrainError, match="boom"):
        await client.get_grain(Echo, "e0").fail("boom")
    echo = client.get_grain(Echo, "e0")
    with pytest.raises(errors.UnknownMethodError):
        await client.router.invoke(Call(echo.grain_id, "no_such_method", ()))
    await client.get_grain(Reminded, "r").start(3600.0)
    await publish_job_progress(silo.redis, keys, JobProgress(
        job="digits", step=40, total_steps=100, loss=0.4, metrics={"accuracy": 0.8},
        eval_metrics={"loss": 0.35, "accuracy": 0.9}, eval_step=40, accuracy=0.9,
        steps_run=45.0, samples_run=45 * 32 * 2, samples_per_s=1200.0,
    ), evaluated=True)  # fmt: skip
    await publish_job_progress(
        silo.redis, keys, JobProgress(job="done", status="completed", step=10)
    )
    await silo.stats_publisher.stop()  # from here on the record is the test's
    rec = silo.stats_publisher.record()
    await put_stats_record(silo.redis, keys, rec.model_copy(update={"gpus": [
        GpuRecord(index=0, name="H200", source="nvml", utilization=0.75,
                  memory_used_bytes=3 << 30, memory_total_bytes=141 << 30),
        GpuRecord(index=1, name="H200", source="torch", memory_used_bytes=1 << 30,
                  memory_total_bytes=141 << 30),
    ]}))  # fmt: skip

    text = api.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # Everything the check is about is in the text it checks.
    present = {
        "redgrain_training_steps", "redgrain_training_samples", "redgrain_job_metric",
        "redgrain_reminders_registered", "redgrain_call_errors",
        "redgrain_silo_gpu_utilization_ratio", "redgrain_silo_gpu_memory_used_bytes",
    }  # fmt: skip
    assert all(families[name].samples for name in present), sorted(families)
    errs = {s.labels["method"]: s.value for s in families["redgrain_call_errors"].samples}
    assert errs["fail"] == 1.0 and errs["echo"] == 0.0
    assert families["redgrain_reminders_registered"].samples[0].value == 1.0

    proc = await asyncio.create_subprocess_exec(
        tool, "check", "metrics", stdin=PIPE, stdout=PIPE, stderr=STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(text.encode()), 60)
    assert proc.returncode == 0 and not out.strip(), (
        f"promtool check metrics (rc {proc.returncode}):\n{out.decode()}"
    )
    # The Grafana dashboard asks only for series /metrics has.
    samples = {s.name for f in families.values() for s in f.samples}
    names = {n for e in grafana_exprs() for n in re.findall(r"\bredgrain_[a-z_]+", e)}
    asked = names - {"redgrain_cluster"}  # the scrape config's target label
    assert asked and asked <= samples, sorted(asked - samples)


def test_the_scrape_config_and_the_grafana_queries_pass_promtool(tmp_path: Path) -> None:
    tool = promtool()
    config = subprocess.run([tool, "check", "config", str(DEPLOY / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert config.returncode == 0, config.stdout + config.stderr
    # promtool parses PromQL in rule files: one recording rule per query, variables filled in.
    rules = {"groups": [{"name": "grafana", "rules": [
        {"record": f"redgrain:grafana_query:{i}",
         "expr": e.replace("$cluster", ".*").replace("$job", ".*")}
        for i, e in enumerate(grafana_exprs()) if not e.startswith("label_values(")
    ]}]}  # fmt: skip
    path = tmp_path / "grafana-queries.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    checked = subprocess.run([tool, "check", "rules", str(path)],
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
