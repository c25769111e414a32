"""A job's named metrics through the dashboard: the job API by split, and /metrics by name.

Published as a coordinator does (``publish_job_progress`` writes the same records as
``workload(grain).publish_progress``); no silo and no training core needed.
"""

from __future__ import annotations

import json

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dashboard import models as m
from grains.training.api.records import JobProgress, publish_job_progress
from silo.keys import Keys
from silo.redis_util import connect_redis


async def publish_regression(redis_url: str, keys: Keys, job: str, steps: int, eval_every: int) -> None:
    """Training ``mse`` every step, an evaluation (``mse``, ``r2``, no accuracy) every ``eval_every``."""
    r = connect_redis(redis_url)
    evaluation: dict[str, float] = {}
    for step in range(1, steps + 1):
        evaluated = step % eval_every == 0
        if evaluated:
            evaluation = {"mse": 0.5 / step, "r2": 1 - 1 / step}
        progress = JobProgress(
            job=job,
            step=step,
            total_steps=steps,
            epoch=step / 4,
            loss=1.0 / step,
            metrics={"mse": 1.0 / step},
            eval_metrics=evaluation,
            eval_step=step - step % eval_every if evaluation else None,
        )
        await publish_job_progress(r, keys, progress, evaluated=evaluated)
    await r.aclose()


async def test_custom_metrics_show_by_name_and_split_in_the_job_api(
    api: TestClient, redis_url: str, cluster_name: str
) -> None:
    await publish_regression(redis_url, Keys(cluster_name), "reg", steps=12, eval_every=4)

    job = m.JobDetail.model_validate(api.get("/api/jobs/reg").json())
    assert job.metric_names == {"train": ["loss", "mse"], "eval": ["mse", "r2"]}
    train = [p for p in job.history if p.split == "train"]
    evals = [p for p in job.history if p.split == "eval"]
    assert [p.step for p in train] == list(range(1, 13))
    assert [p.step for p in evals] == [4, 8, 12]
    # Never mixed: a train point has no eval figure, an eval point no training loss.
    assert all(set(p.metrics) == {"mse"} and p.loss is not None for p in train)
    assert all(set(p.metrics) == {"mse", "r2"} and p.loss is None for p in evals)
    assert train[-1].metrics["mse"] == 1 / 12 and evals[-1].metrics == {"mse": 0.5 / 12, "r2": 1 - 1 / 12}
    assert (job.progress.eval_step, job.progress.accuracy, job.progress.epoch) == (12, None, 3.0)
    listed = m.JobList.model_validate(api.get("/api/jobs").json())
    assert listed.jobs[0].eval_metrics == {"mse": 0.5 / 12, "r2": 1 - 1 / 12}


async def test_metrics_endpoint_has_a_gauge_per_named_metric_and_split(
    api: TestClient, redis_url: str, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    await publish_regression(redis_url, keys, "reg", steps=8, eval_every=4)
    r = connect_redis(redis_url)
    await publish_job_progress(r, keys, JobProgress(
        job="digits", step=5, loss=0.3, metrics={"accuracy": 0.9},
        eval_metrics={"loss": 0.25, "accuracy": 0.95}, accuracy=0.95, eval_step=5,
    ), evaluated=True)  # fmt: skip
    await r.aclose()

    families = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
    named = {
        (s.labels["job"], s.labels["split"], s.labels["name"]): s.value
        for s in families["redgrain_job_metric"].samples
    }
    assert named == {
        ("reg", "train", "loss"): 1 / 8,
        ("reg", "train", "mse"): 1 / 8,
        ("reg", "eval", "mse"): 0.5 / 8,
        ("reg", "eval", "r2"): 1 - 1 / 8,
        ("digits", "train", "loss"): 0.3,
        ("digits", "train", "accuracy"): 0.9,
        ("digits", "eval", "loss"): 0.25,
        ("digits", "eval", "accuracy"): 0.95,
    }
    accuracy = families["redgrain_job_accuracy"]
    assert "test split" in accuracy.documentation
    assert [(s.labels["job"], s.value) for s in accuracy.samples] == [("digits", 0.95)]  # reg has none
    assert {s.labels["job"]: s.value for s in families["redgrain_job_loss"].samples} == {"reg": 1 / 8, "digits": 0.3}
    assert {s.labels["job"]: s.value for s in families["redgrain_job_epoch"].samples} == {"reg": 2.0, "digits": 0.0}
    assert {s.labels["job"] for s in families["redgrain_job_step"].samples} == {"reg", "digits"}


async def test_records_and_points_written_before_named_metrics_still_show(
    api: TestClient, redis_url: str, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    r = connect_redis(redis_url)
    old = {"job": "old", "status": "running", "step": 2, "total_steps": 10, "epoch": 1, "loss": 0.7,
           "accuracy": 0.8, "samples_per_s": 10.0, "bytes_per_step": 5, "staleness": 2.0, "mode": "async",
           "trainers": [], "shards": [], "checkpoints": [{"snapshot": "1", "step": 1, "at": 5.0}],
           "recoveries": [], "updated_at": 1.0, "error": None}  # fmt: skip
    await r.set(keys.job_progress("old"), json.dumps(old))
    await r.sadd(keys.jobs, "old")
    for step, loss, acc in ((1, 0.9, "0.5"), (2, 0.7, "0.8")):
        await r.xadd(keys.job_history("old"), {"step": step, "loss": repr(loss), "accuracy": acc,
                                               "samples_per_s": "10.0", "bytes": "5", "at": "1.0"})  # fmt: skip
    await r.aclose()

    job = m.JobDetail.model_validate(api.get("/api/jobs/old").json())
    assert (job.progress.epoch, job.progress.max_staleness, job.progress.metrics) == (1.0, 2.0, {})
    assert [(p.split, p.step, p.loss, p.accuracy, p.metrics) for p in job.history] == [
        ("train", 1, 0.9, 0.5, {}),
        ("train", 2, 0.7, 0.8, {}),
    ]
    # The old accuracy was the evaluation's: it shows on the eval accuracy curve.
    assert job.metric_names == {"train": ["loss"], "eval": ["accuracy"]}
    families = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
    assert [s.value for s in families["redgrain_job_accuracy"].samples] == [0.8]
