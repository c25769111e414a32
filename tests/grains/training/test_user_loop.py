"""The user's training loop, grown to what real scripts need: accumulation, a step context,
callbacks with early stopping, the best checkpoint kept, a resume from any committed step."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.steps import classification_step
from silo import errors
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job
from tests.grains.training.test_sync import reference_parameters


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
async def test_grad_accumulation_equals_a_batch_that_many_times_larger(cluster, client, mode):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    common = {"mode": mode, "trainers": 2, "steps": 20, "optimizer": "sgd", "lr": 0.1, "seed": 4, "checkpoint_every": 10}
    st = await run_job(client, f"accum-{mode}", TrainingJob(**common, batch_size=8, grad_accumulation=4))
    assert st.status == "completed", st
    assert st.samples_run == 20 * 2 * 32, st  # each trainer took 32 samples a step
    got = await client.get_grain(CoordinatorGrain, f"accum-{mode}").parameters()
    want = reference_parameters(TrainingJob(**common, batch_size=32), trainers=2, steps=20)
    for name in want:
        # Four chunks of 8 sum in another order than one batch of 32: float tolerance only. A
        # chunk's loss not divided by 4, or chunks of other samples, is off by 1e-2 or more.
        assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-5), name


def context_step(model: torch.nn.Module, batch: Any, ctx: Any) -> Any:
    ctx.log("rank", ctx.rank)
    ctx.log("trainers", ctx.trainers)
    ctx.log("epoch", ctx.epoch)
    ctx.log("step_seen", torch.tensor(float(ctx.step)))
    return classification_step(model, batch)


async def test_a_step_that_takes_a_context_knows_its_step_rank_trainers_and_epoch(cluster, client):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(trainers=2, batch_size=64, epochs=3, step=f"{__name__}:context_step", seed=3)
    st = await run_job(client, "ctx", spec)
    assert st.status == "completed", st
    # Digits: 1,437 training samples, 11 steps of 2 x 64 an epoch.
    assert st.total_steps == 33, st
    assert st.metrics["rank"] == 0.5 and st.metrics["trainers"] == 2.0, st.metrics  # means over the 2 trainers
    assert st.metrics["epoch"] == 2.0 and st.metrics["step_seen"] == 32.0, st.metrics
    assert {"accuracy", "rank", "trainers", "epoch", "step_seen"} <= set(st.metrics)


class StopAtStep20:
    """Early stopping in its simplest form; records what it was told (in-process silos)."""

    seen: list[tuple[str, int]] = []

    def on_eval(self, step: int, metrics: dict[str, float]) -> bool:
        assert "accuracy" in metrics
        self.seen.append(("eval", step))
        return step >= 20

    def on_checkpoint(self, step: int) -> None:
        self.seen.append(("checkpoint", step))

    def on_end(self, status: str, step: int) -> None:
        # A slow on_end (saving an artifact, say): the job must not read ended before it returns.
        time.sleep(0.3)
        self.seen.append((status, step))


async def test_a_callback_stops_the_job_at_an_evaluated_step_which_is_then_its_result(cluster, client):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    StopAtStep20.seen.clear()
    spec = TrainingJob(trainers=2, steps=3000, batch_size=32, eval_every=10, checkpoint_every=10,
                       callbacks=[f"{__name__}:StopAtStep20"], keep_best="eval.loss:max", keep_checkpoints=2)  # fmt: skip
    coord = client.get_grain(CoordinatorGrain, "early")
    st = await run_job(client, "early", spec, timeout_s=120)
    assert st.status == "completed", st
    assert st.step == st.total_steps == 20 and "stopped at step 20" in st.stopped_early, st
    assert max(st.checkpoints) == 20, st  # later checkpoints were abandoned
    evals = [s for kind, s in StopAtStep20.seen if kind == "eval"]
    assert evals == [10, 20], StopAtStep20.seen
    assert ("checkpoint", 10) in StopAtStep20.seen and StopAtStep20.seen[-1] == ("completed", 20)
    final = await coord.state_dict()
    at20 = await coord.state_dict(step=20)
    assert all(torch.equal(final[n], at20[n]) for n in final)
    # keep_best (the worst loss here, step 10's) outlives retention: checkpoint 10 is long gone.
    assert st.best_step == 10 and 10 not in st.checkpoints, st
    best = await coord.state_dict(best=True)
    history = {h.step: h.eval_metrics for h in await coord.history() if h.eval_metrics is not None}
    from grains.training.data.batches import Batches, batch_samples
    from grains.training.datasets import load_dataset
    from grains.training.loop.program import Program, evaluate
    from grains.training.models import build_model

    model = build_model(spec)
    model.load_state_dict(best, strict=True)
    again = evaluate(Program.of(spec), model, Batches(load_dataset(spec, "test")).eval_batches(spec.eval_batch_size), batch_samples)
    assert again == history[10]


async def test_a_job_resumes_from_an_older_committed_step_and_ends_as_if_it_had_never_gone_past_it(cluster, client):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    common = {"trainers": 2, "batch_size": 32, "optimizer": "momentum", "lr": 0.05, "seed": 9, "keep_checkpoints": 5}
    coord = client.get_grain(CoordinatorGrain, "rewind")
    first = await run_job(client, "rewind", TrainingJob(**common, steps=40, checkpoint_every=10))
    assert first.status == "completed" and {20, 40} <= set(first.checkpoints), first
    with pytest.raises(errors.ConfigError, match="no committed checkpoint at step 25"):
        await coord.start(TrainingJob(**common, steps=40, checkpoint_every=10, resume_from_step=25))
    second = await run_job(client, "rewind", TrainingJob(**common, steps=30, checkpoint_every=10, resume_from_step=20))
    assert second.status == "completed" and second.resumed_from == 20, second
    assert 40 not in second.checkpoints and max(second.checkpoints) == 30, second
    got = await coord.parameters()
    want = reference_parameters(TrainingJob(**common, steps=30), trainers=2, steps=30)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-3, atol=1e-4), name


def test_bad_callback_and_keep_best_specs_are_refused_with_the_reason():
    with pytest.raises(errors.ConfigError, match="keep_best"):
        from grains.training.api.job import parse_job

        parse_job({"keep_best": "accuracy:max"})
    from grains.training.api.callbacks import resolve_callback

    with pytest.raises(errors.ConfigError, match="has none of on_eval"):
        resolve_callback(f"{__name__}:F")
    with pytest.raises(errors.ConfigError, match="cannot import module"):
        resolve_callback("no_such_module:Thing")
    assert F is not None


async def test_init_from_a_plain_loops_checkpoint_carries_its_adam_state_into_the_job(cluster, client, tmp_path):
    # A plain loop trains 15 steps with Adam and saves torch's usual {"model", "optimizer"} dict;
    # the job goes on from it. Adam's moments and step count matter from the first update on:
    # a job starting them afresh differs from the continued plain loop by far more than floats.
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    from grains.training.datasets import load_dataset
    from grains.training.models import build_model
    from grains.training.strategies.ps.shard import make_optimizer

    common = {"trainers": 2, "batch_size": 32, "optimizer": "adam", "lr": 0.01, "seed": 6, "steps": 15, "checkpoint_every": 0}
    base = TrainingJob(**common)
    model = build_model(base)
    opt = make_optimizer(list(model.parameters()), base)
    x, y = load_dataset(base, "train").tensors  # type: ignore[attr-defined]
    for t in range(15):
        idx = torch.arange(t * 64, (t + 1) * 64)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    path = tmp_path / "plain.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    # The plain loop continued on the job's 15 batches.
    n, per_epoch = len(y), len(y) // 64
    for t in range(15):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(base.seed + t // per_epoch))
        idx = perm[(t % per_epoch) * 64 : (t % per_epoch + 1) * 64]
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    want = {k: v.detach() for k, v in model.named_parameters()}
    for with_state in (True, False):
        spec = TrainingJob(**common, init_from=str(path), init_optimizer=with_state)
        st = await run_job(client, f"init-opt-{with_state}", spec)
        assert st.status == "completed", st
        got = await client.get_grain(CoordinatorGrain, f"init-opt-{with_state}").parameters()
        close = all(torch.allclose(got[k], want[k], rtol=1e-3, atol=1e-4) for k in want)
        assert close is with_state, (with_state, max(float((got[k] - want[k]).abs().max()) for k in want))
    with pytest.raises(errors.ConfigError, match="init_optimizer reads"):
        from grains.training.api.job import parse_job

        parse_job({"init_optimizer": True})


def test_the_step_contexts_first_names_still_read_with_a_deprecation_warning():
    from grains.training.loop.program import StepContext

    ctx = StepContext(step=3, epoch=0, rank=1, trainers=2, device="cpu")
    with pytest.deprecated_call(match="rank"):
        assert ctx.slot == 1
    with pytest.deprecated_call(match="trainers"):
        assert ctx.world == 2


async def test_the_final_checkpoint_is_kept_as_the_best_when_its_evaluation_is_the_best(cluster, client):
    # The final evaluation used to reach the status only: a job whose last checkpoint scored best
    # kept an earlier, worse one as "best" (state_dict(best=True), --save-best).
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(trainers=2, steps=30, batch_size=32, optimizer="sgd", lr=0.1, seed=5, eval_every=10,
                       checkpoint_every=10, keep_best="eval.accuracy:max")  # fmt: skip
    coord = client.get_grain(CoordinatorGrain, "best-last")
    st = await run_job(client, "best-last", spec, timeout_s=120)
    assert st.status == "completed" and st.total_steps == 30, st
    evals = {h.step: h.eval_metrics["accuracy"] for h in await coord.history() if h.eval_metrics is not None}
    assert set(evals) == {10, 20, 30}, evals
    assert evals[10] < evals[20] < evals[30], evals  # this spec's accuracy only rises (seeded)
    assert st.best_step == 30 and st.best_value == evals[30], (st, evals)
    final, best = await coord.state_dict(), await coord.state_dict(best=True)
    assert all(torch.equal(final[n], best[n]) for n in final)
