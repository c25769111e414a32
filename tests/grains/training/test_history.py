"""A job's history is fit to plot: step order, one training point per completed step, evaluation
points with their own step and figures only, nothing past the job's end (the dashboard's curves too)."""

from __future__ import annotations

from typing import Any

from grains.training import CoordinatorGrain, TrainingJob
from grains.training import history as hist
from grains.training.api.messages import HistoryPoint
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job


def _train(step: int, loss: float = 1.0) -> HistoryPoint:
    return HistoryPoint(step=step, loss=loss)


def _eval(step: int) -> HistoryPoint:
    return HistoryPoint(step=step, eval_metrics={"accuracy": 0.5})


def test_points_stay_in_step_order_whatever_order_they_come_in() -> None:
    h: list[HistoryPoint] = []
    assert [hist.add_training(h, _train(s)) for s in (1, 2, 2, 3, 5)] == [True, True, False, True, True]
    hist.add_evaluation(h, _eval(2))  # finished late, after steps 3 and 5 were recorded
    assert [(p.step, p.eval_metrics is None) for p in h] == [(1, True), (2, True), (2, False), (3, True), (5, True)]
    # Back to step 2 (a rollback): the abandoned steps' points go, the redone steps come again.
    assert hist.add_training(h, _train(3, loss=0.7))
    assert [(p.step, p.loss) for p in h] == [(1, 1.0), (2, 1.0), (2, None), (3, 0.7)]
    hist.truncate(h, 2)
    assert [p.step for p in h] == [1, 2, 2]


def _training_points(points: list[Any]) -> list[Any]:
    return [p for p in points if p.eval_metrics is None]


async def test_a_job_records_no_point_before_its_first_step_and_one_per_step(cluster, client):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    st = await run_job(client, "hist-start", TrainingJob(trainers=2, steps=30, batch_size=32, seed=1))
    assert st.status == "completed", st
    train = _training_points(await client.get_grain(CoordinatorGrain, "hist-start").history())
    # One point per step done, in order; none of an idle tick at step 0.
    assert [p.step for p in train] == list(range(1, 31)), [p.step for p in train]
    assert all(p.loss is not None and p.loss > 0.0 for p in train), [p.loss for p in train]


async def test_evaluation_points_sit_at_their_step_and_carry_no_training_figures(cluster, client):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(trainers=2, steps=60, batch_size=32, eval_every=10, checkpoint_every=10, keep_checkpoints=10, seed=2)
    st = await run_job(client, "hist-eval", spec)
    assert st.status == "completed", st
    points = await client.get_grain(CoordinatorGrain, "hist-eval").history()
    assert [p.step for p in points] == sorted(p.step for p in points), [(p.step, p.eval_metrics is not None) for p in points]
    evals = [p for p in points if p.eval_metrics is not None]
    assert [p.step for p in evals] == [10, 20, 30, 40, 50, 60], evals  # the final evaluation too
    assert all(p.loss is None and p.metrics == {} for p in evals), evals
    assert evals[-1].eval_metrics == st.eval_metrics


class StopAt20:
    def on_eval(self, step: int, metrics: dict[str, float]) -> bool:
        return step >= 20


async def test_an_early_stop_leaves_no_point_past_the_step_it_stopped_at(cluster, client, redis_url, cluster_name):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(trainers=2, steps=3000, batch_size=32, eval_every=10, checkpoint_every=10,
                       callbacks=[f"{__name__}:StopAt20"])  # fmt: skip
    st = await run_job(client, "hist-stop", spec, timeout_s=120)
    assert st.status == "completed" and st.step == 20 and st.stopped_early, st
    points = await client.get_grain(CoordinatorGrain, "hist-stop").history()
    assert max(p.step for p in points) == 20, [p.step for p in points][-20:]
    assert [p.step for p in points if p.eval_metrics is not None] == [10, 20]
    from fastapi.testclient import TestClient

    from dashboard.app import create_app

    with TestClient(create_app(redis_url, cluster_name, cache_s=0.0)) as api:
        curves = api.get("/api/jobs/hist-stop").json()["history"]
    train = [p["step"] for p in curves if p["split"] == "train"]
    assert train == list(range(1, 21)), curves
    assert [p["step"] for p in curves if p["split"] == "eval"] == [10, 20], curves
