"""The job records the coordinator publishes: named metrics, splits, and records of before."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from grains.training import progress
from grains.training.api.messages import GroupChange, HistoryPoint, TrainingStatus
from grains.training.api.records import JobPoint, JobProgress, job_points
from grains.training.console import metric_text, metrics_text


def test_progress_with_named_metrics_round_trips_through_json() -> None:
    p = JobProgress(
        job="j", step=40, epoch=2.5, loss=0.31, metrics={"acc": 0.91},
        eval_metrics={"loss": 0.28, "accuracy": 0.961}, eval_step=40, accuracy=0.961,
        max_staleness=3, max_gap=1, mode="ssp",
    )  # fmt: skip
    back = JobProgress.model_validate_json(p.model_dump_json())
    assert back == p
    assert (back.epoch, back.metrics, back.eval_metrics, back.eval_step) == (2.5, {"acc": 0.91}, {"loss": 0.28, "accuracy": 0.961}, 40)


def test_a_record_from_before_named_metrics_parses_with_defaults() -> None:
    old = {"job": "j", "status": "running", "step": 7, "total_steps": 10, "epoch": 1, "loss": 0.5,
           "accuracy": 0.9, "samples_per_s": 3.0, "bytes_per_step": 10, "staleness": 4.0, "mode": "async",
           "trainers": [], "shards": [], "checkpoints": [], "recoveries": [], "updated_at": 1.0, "error": None}  # fmt: skip
    p = JobProgress.model_validate_json(json.dumps(old))
    assert (p.epoch, p.metrics, p.eval_metrics, p.eval_step) == (1.0, {}, {}, None)
    assert (p.max_staleness, p.max_gap, p.staleness) == (4.0, 0.0, 4.0)
    ssp = JobProgress.model_validate({**old, "mode": "ssp"})
    assert (ssp.max_staleness, ssp.max_gap) == (0.0, 4.0)  # in ssp the old figure was the gap


def test_non_finite_figures_are_left_out_so_the_record_stays_readable() -> None:
    p = JobProgress(job="j", loss=math.nan, metrics={"mse": math.inf, "mae": 0.5}, eval_metrics={"r2": math.nan})
    back = JobProgress.model_validate_json(p.model_dump_json())
    assert (back.loss, back.metrics, back.eval_metrics) == (None, {"mae": 0.5}, {})


def stream_entry(point: JobPoint) -> dict[bytes, bytes]:
    """The point as redis-py reads a stream entry back (bytes keys and values)."""
    return {k.encode(): v.encode() for k, v in point.fields().items()}


def test_points_of_both_splits_flatten_to_stream_fields_and_back() -> None:
    record = JobProgress(job="j", step=12, loss=0.4, metrics={"mse": 0.4, "odd name/é": 1.5},
                         eval_metrics={"mse": 0.3, "r2": 0.8}, eval_step=10, samples_per_s=99.5,
                         bytes_per_step=123, updated_at=5.0)  # fmt: skip
    train, ev = job_points(record, evaluated=True)
    assert train.fields() == {
        "step": "12", "split": "train", "loss": "0.4", "samples_per_s": "99.5", "bytes": "123", "at": "5.0",
        "m.mse": "0.4", "m.odd name/é": "1.5",
    }  # fmt: skip
    assert ev.fields() == {"step": "10", "split": "eval", "at": "5.0", "m.mse": "0.3", "m.r2": "0.8"}
    assert JobPoint.from_fields(stream_entry(train)) == train
    assert JobPoint.from_fields(stream_entry(ev)) == ev
    assert (ev.loss, ev.samples_per_s) == (None, None)  # no training figure on an eval point


def test_a_training_point_is_written_field_for_field_as_its_job_point_would_be() -> None:
    # The publish path writes training points without building a JobPoint (one a step): the
    # stream entry must be what JobPoint.fields() writes, in the same order, non-finite left out.
    nan, inf = float("nan"), float("inf")
    points = [
        HistoryPoint(step=3, loss=0.5, metrics={"accuracy": 0.25, "f1": nan, "n": 2}, samples_per_s=12.5, at=1.7e9 + 0.123),
        HistoryPoint(step=1, loss=inf, samples_per_s=nan),
        HistoryPoint(step=7, loss=None, samples_per_s=-inf, at=2.0, metrics={"z": -0.0, "big": 1e300}),
        HistoryPoint(step=9, loss=1 / 3, samples_per_s=0.1 + 0.2, at=2.5),
    ]
    for point in points:
        for per_step in (None, 0, 123_456):
            fields = progress.training_fields(point, per_step)
            expected = progress.history_point(point, per_step).fields()
            assert list(fields.items()) == list(expected.items())
            assert JobPoint.from_fields(fields) == progress.history_point(point, per_step)


def test_an_eval_point_is_written_only_when_an_evaluation_finished() -> None:
    record = JobProgress(job="j", step=12, loss=0.4, eval_metrics={"r2": 0.8}, eval_step=10)
    assert [p.split for p in job_points(record)] == ["train"]
    assert [p.split for p in job_points(record, evaluated=True)] == ["train", "eval"]
    assert [p.split for p in job_points(record.model_copy(update={"eval_metrics": {}}), evaluated=True)] == ["train"]


def test_a_stream_entry_from_before_splits_reads_as_a_training_point() -> None:
    old = {b"step": b"3", b"loss": b"0.7", b"accuracy": b"0.8", b"samples_per_s": b"10.0", b"bytes": b"5", b"at": b"1.0"}
    p = JobPoint.from_fields(old)
    assert (p.split, p.step, p.loss, p.accuracy, p.metrics, p.bytes) == ("train", 3, 0.7, 0.8, {}, 5)


def status(**kw: Any) -> TrainingStatus:
    base: dict[str, Any] = {
        "job": "j", "status": "running", "step": 40, "total_steps": 100, "loss": 0.31,
        "metrics": {"acc": 0.91}, "eval_metrics": {"loss": 0.28, "accuracy": 0.961}, "eval_step": 30,
        "epoch": 1.5, "max_staleness": 3, "max_gap": 2, "checkpoints": [20, 40],
        "trainer_silos": ["s1"], "shard_silos": ["s2"],
    }  # fmt: skip
    return TrainingStatus(**{**base, **kw})


def test_job_progress_fills_the_named_figures_from_the_status() -> None:
    p = progress.job_progress(status(), None, ["j/t0"], ["j/s0"], checkpoint_at={20: 100.0})
    assert (p.loss, p.metrics, p.eval_metrics, p.eval_step, p.epoch) == (
        0.31, {"acc": 0.91}, {"loss": 0.28, "accuracy": 0.961}, 30, 1.5,
    )  # fmt: skip
    assert p.accuracy == 0.961  # the evaluation's, not the training batch's
    assert (p.max_staleness, p.max_gap, p.staleness) == (3.0, 2.0, 3.0)
    assert [(c.step, c.at) for c in p.checkpoints] == [(20, 100.0), (40, 0.0)]  # 0: not known
    assert [(t.key, t.silo) for t in p.trainers] == [("j/t0", "s1")]
    regression = progress.job_progress(status(metrics={"mse": 0.2}, eval_metrics={"mse": 0.3}), None, [], [])
    assert regression.accuracy is None


def test_job_progress_in_ssp_mode_keeps_the_gap_as_the_old_staleness_figure() -> None:
    from grains.training.api.job import TrainingJob

    p = progress.job_progress(status(), TrainingJob(mode="ssp"), [], [])
    assert (p.mode, p.max_staleness, p.max_gap, p.staleness) == ("ssp", 3.0, 2.0, 2.0)


class FakeWorkload:
    """What ``progress.publish`` needs of a grain's ``workload(grain)``: ``publish_progress``
    (recorded here)."""

    def __init__(self, cancel: bool = False) -> None:
        self.calls: list[tuple[str, BaseModel, list[dict[str, Any]], bool]] = []
        self.cancel = cancel

    async def publish_progress(
        self, job: str, record: BaseModel, point: list[Mapping[str, Any]], *, restart_history: bool = False
    ) -> bool:
        self.calls.append((job, record, [dict(p) for p in point], restart_history))
        return self.cancel


async def test_publish_writes_the_history_points_it_is_given_in_one_call() -> None:
    grain = FakeWorkload()
    assert not await progress.publish(grain, status(), None, [], [])  # type: ignore[arg-type]
    assert [c[2] for c in grain.calls] == [[]]  # the record alone
    grain.calls.clear()
    points = [HistoryPoint(step=30, loss=0.31, metrics={"acc": 0.91}, samples_per_s=5.0, at=7.0),
              HistoryPoint(step=30, eval_metrics={"loss": 0.28, "accuracy": 0.961}, at=8.0)]  # fmt: skip
    assert not await progress.publish(grain, status(), None, [], [], points=points)  # type: ignore[arg-type]
    ((_, record, (train, ev), restart),) = grain.calls
    assert isinstance(record, JobProgress) and record.eval_metrics == {"loss": 0.28, "accuracy": 0.961} and not restart
    assert JobPoint.from_fields(train).metrics == {"acc": 0.91} and JobPoint.from_fields(train).loss == 0.31
    assert JobPoint.from_fields(ev) == JobPoint(step=30, split="eval", metrics={"loss": 0.28, "accuracy": 0.961}, at=8.0)
    assert await progress.publish(FakeWorkload(cancel=True), status(), None, [], [], points=points, restart=True)  # type: ignore[arg-type]


def test_the_status_line_names_each_metric_and_labels_evaluation() -> None:
    assert metrics_text(status()) == "loss 0.31 acc 91.0% | eval loss 0.28 accuracy 96.1%"
    regression = status(loss=12345.678, metrics={"mse": 0.000123456}, eval_metrics={"mse": 3.14159, "r2": 0.9})
    assert metrics_text(regression) == "loss 12350 mse 0.0001235 | eval mse 3.142 r2 0.9"
    assert metrics_text(status(loss=None, metrics={}, eval_metrics={})) == ""
    assert metric_text("top5_acc", 0.5) == "50.0%" and metric_text("accuracy_pct", 96.1) == "96.1"


def test_status_table_shows_every_metric_by_split(capsys: Any) -> None:
    from grains.training.console import _print_table

    change = GroupChange(generation=1, reason="trainer lost", at=1.0, trainers=2, start_step=10)
    _print_table(status(mode="ssp", changes=[change], metrics={"[b]mse": 0.2}))
    out = capsys.readouterr().out
    for row in ("epoch", "1.50", "train loss", "train [b]mse", "eval loss", "eval accuracy", "96.1%",
                "step 30 (test split)", "max staleness", "max gap"):  # fmt: skip
        assert row in out, row
