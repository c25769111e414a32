"""``loggers = ["tensorboard", "mlflow"]``: the job's history, learning rate and checkpoint events,
read back with each library's own reader; a logger that fails is a warning, not a failed job."""

from __future__ import annotations

from pathlib import Path

import pytest

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.api.job import parse_job
from silo import errors
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job


def test_unknown_or_repeated_logger_names_are_refused_with_the_names_that_work() -> None:
    with pytest.raises(errors.ConfigError, match="unknown logger 'wandb': use 'tensorboard' or 'mlflow'"):
        parse_job({"loggers": ["tensorboard", "wandb"]})
    with pytest.raises(errors.ConfigError, match="name a logger twice"):
        parse_job({"loggers": ["mlflow", "mlflow"]})


def _spec(**kw: object) -> TrainingJob:
    # warmup_steps: a rate that changes every step for 4 steps, then lr.
    base: dict[str, object] = {"trainers": 2, "steps": 12, "batch_size": 32, "checkpoint_every": 4, "eval_every": 4,
                               "keep_checkpoints": 5, "lr": 0.1, "warmup_steps": 4, "seed": 3}  # fmt: skip
    return TrainingJob(**{**base, **kw})  # type: ignore[arg-type]


async def test_tensorboard_and_mlflow_hold_every_step_the_rate_the_evaluations_and_the_checkpoints(
    cluster, client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the reader's side of MLflow's file store
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    st = await run_job(client, "logged", _spec(loggers=["tensorboard", "mlflow"], log_dir=str(tmp_path)))
    assert st.status == "completed" and not st.warnings, st
    history = await client.get_grain(CoordinatorGrain, "logged").history()
    losses = {h.step: h.loss for h in history if h.eval_metrics is None}
    evals = {h.step: h.eval_metrics for h in history if h.eval_metrics is not None}
    assert sorted(losses) == list(range(1, 13)) and sorted(evals) == [4, 8, 12], history
    rates = [0.02, 0.04, 0.06, 0.08] + [0.1] * 8  # LinearLR from lr/(w+1), then lr

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (tmp_path / "logged").iterdir()
    tb = EventAccumulator(str(run_dir))
    tb.Reload()
    loss = tb.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 13))
    assert [e.value for e in loss] == pytest.approx([losses[s] for s in range(1, 13)], rel=1e-6)
    assert [e.value for e in tb.Scalars("train/lr")] == pytest.approx(rates)
    assert {e.step: e.value for e in tb.Scalars("eval/accuracy")} == pytest.approx({s: m["accuracy"] for s, m in evals.items()})
    assert [e.step for e in tb.Scalars("eval/loss")] == [4, 8, 12]
    checkpoints = [e.step for e in tb.Scalars("checkpoint")]
    assert checkpoints == sorted(checkpoints) and {4, 8} <= set(checkpoints), checkpoints

    from mlflow.tracking import MlflowClient

    ml = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = ml.get_experiment_by_name("logged")
    assert experiment is not None
    (run,) = ml.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "0.1" and run.data.params["steps"] == "12"
    mloss = sorted(ml.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in mloss] == list(range(1, 13))
    assert [m.value for m in mloss] == pytest.approx([losses[s] for s in range(1, 13)])
    mlr = sorted(ml.get_metric_history(run.info.run_id, "train/lr"), key=lambda m: m.step)
    assert [m.value for m in mlr] == pytest.approx(rates)
    macc = sorted(ml.get_metric_history(run.info.run_id, "eval/accuracy"), key=lambda m: m.step)
    assert {m.step: m.value for m in macc} == pytest.approx({s: m["accuracy"] for s, m in evals.items()})
    mckpt = sorted(m.step for m in ml.get_metric_history(run.info.run_id, "checkpoint"))
    assert mckpt == checkpoints, (mckpt, checkpoints)


async def test_a_logger_that_fails_is_a_warning_and_the_job_completes(cluster, client, tmp_path: Path) -> None:
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("in the way")
    spec = _spec(loggers=["tensorboard", "mlflow"], log_dir=str(not_a_dir), mlflow_tracking_uri="nosuchscheme://nowhere")
    st = await run_job(client, "badlog", spec)
    assert st.status == "completed", st
    assert len(st.warnings) == 2, st.warnings
    assert "logger tensorboard failed" in st.warnings[0] and "logger mlflow failed" in st.warnings[1], st.warnings


async def test_a_resumed_run_logs_on_in_the_same_places_and_its_steps_replace_the_abandoned_ones(
    cluster, client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    common = {"loggers": ["tensorboard", "mlflow"], "log_dir": str(tmp_path), "eval_every": 0}
    assert (await run_job(client, "again", _spec(**common, steps=8))).status == "completed"
    st = await run_job(client, "again", _spec(**common, steps=12, resume_from_step=4))
    assert st.status == "completed" and st.resumed_from == 4 and not st.warnings, st
    history = await client.get_grain(CoordinatorGrain, "again").history()
    second = {h.step: h.loss for h in history if h.eval_metrics is None}
    assert sorted(second) == list(range(5, 13)), history

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (tmp_path / "again").iterdir()  # the same run: the same directory
    tb = EventAccumulator(str(run_dir))
    tb.Reload()
    scalars = tb.Scalars("train/loss")
    assert [e.step for e in scalars] == list(range(1, 13)), scalars  # steps 5-8 once: the resumed run's
    loss = {e.step: e.value for e in scalars}
    assert [loss[s] for s in range(5, 13)] == pytest.approx([second[s] for s in range(5, 13)], rel=1e-6)

    from mlflow.tracking import MlflowClient

    ml = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = ml.get_experiment_by_name("again")
    assert experiment is not None
    (run,) = ml.search_runs([experiment.experiment_id])  # one MLflow run, gone on with
    assert run.info.status == "FINISHED"
    assert max(m.step for m in ml.get_metric_history(run.info.run_id, "train/loss")) == 12
