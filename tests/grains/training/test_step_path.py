"""The parameter-server step path's cost rules (issue 38): what a step sends passes by reference
on one silo, and cheap work runs on the event loop while it stays cheap."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from grains.immutable import is_immutable
from grains.training.api.job import TrainingJob
from grains.training.api.messages import ExchangeReply, ShardConfig, TrainerAssignment
from grains.training.models import build_model
from grains.training.state.model_tensors import layout_of
from grains.training.strategies.ps.inline import InlineWhenCheap, whole
from grains.training.strategies.ps.shard_core import ShardCore
from grains.training.strategies.ps.trainer import TrainerCore
from silo.codec import Codec

SPEC = TrainingJob(model="grains.training.models:mlp", dataset="grains.training.datasets:digits", batch_size=16,
                   optimizer="momentum", lr=0.05, steps=4, trainers=1, shards=1, checkpoint_every=0, eval_every=0)  # fmt: skip


def _cores() -> tuple[TrainerCore, ShardCore]:
    names = list(layout_of(build_model(SPEC)).sizes())
    a = TrainerAssignment(job="j", rank=0, trainers=1, spec=SPEC, generation=0, start_step=0, end_step=4,
                          shard_keys=["s"], shard_names=[names])  # fmt: skip
    cfg = ShardConfig(job="j", index=0, spec=SPEC, names=names, shard_keys=["s"], trainers=1, generation=0, end_step=4)
    return TrainerCore(a, "cpu"), ShardCore(cfg, "cpu", None)


def test_a_step_sends_and_receives_its_tensors_by_reference_on_one_silo():
    # A call to a grain on the caller's silo copies what is not @immutable (decision 70): the
    # gradients pushed, the parameters published and the reply must all be marked.
    trainer, shard = _cores()
    codec = Codec()
    published = shard.current[1]
    copied = codec.copy(published)
    assert published and all(copied[n] is t for n, t in published.items())
    r = trainer.step([published], 0)
    pushed = codec.copy(r.grads[0])
    assert r.grads[0] and all(pushed[n] is g for n, g in r.grads[0].items())
    assert is_immutable(ExchangeReply(version=1, params=published))
    # The shard publishes fresh tensors for the next version (the trainer holds the old ones),
    # and its update in place never reaches them: the master weights are one flat buffer,
    # and a version is a copy of it, not views of it.
    before = {n: t.clone() for n, t in published.items()}
    shard.push_sync(r.grads[0], None, False, True, 1.0, 0)
    assert all(shard.current[1][n] is not t for n, t in published.items())
    assert all(torch.equal(published[n], before[n]) for n in published)
    assert not all(torch.equal(shard.current[1][n], before[n]) for n in published)
    flat = shard._flat.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() != flat for t in shard.current[1].values())
    assert all(p.untyped_storage().data_ptr() == flat for p in shard.params.values())


def test_cheap_work_runs_inline_once_measured_and_slow_work_goes_back_to_the_executor():
    threaded: list[str] = []

    async def run_in_thread(fn: Any, *args: Any) -> Any:
        threaded.append(args[0].__name__)
        return await asyncio.to_thread(fn, *args)

    def cheap() -> int:
        return 1

    def slow() -> int:
        time.sleep(0.03)
        return 2

    async def main() -> None:
        work = InlineWhenCheap(run_in_thread, budget_s=0.01)
        assert await work.run(cheap) == 1 and threaded == ["cheap"]  # the first: on the executor
        assert work.inline
        assert await work.run(cheap) == 1 and threaded == ["cheap"]  # measured cheap: inline
        assert await work.run(slow) == 2 and threaded == ["cheap"]  # still inline: the last was cheap
        assert not work.inline
        assert await work.run(cheap) == 1 and threaded == ["cheap", "cheap"]  # after a slow one: executor
        assert work.inline

    asyncio.run(main())


def test_short_named_optimizers_run_fused_and_step_as_the_per_tensor_loop_does_to_rounding():
    from grains.training.loop.optim import build_optimizer

    def steps(spec: TrainingJob, ours: list[torch.nn.Parameter], theirs: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = build_optimizer([(str(i), p) for i, p in enumerate(ours)], spec)
        assert opt is not None
        # What a plain loop writes (foreach left to torch: the per-tensor loop on the CPU).
        plain: torch.optim.Optimizer = (
            torch.optim.SGD(theirs, lr=spec.lr, momentum=spec.momentum, weight_decay=0.01) if spec.optimizer == "momentum"
            else torch.optim.AdamW(theirs, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=0.01)
        )  # fmt: skip
        for _ in range(5):
            grads = [torch.randn_like(p) for p in ours]
            for p, q, g in zip(ours, theirs, grads, strict=True):
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            plain.step()
        return opt

    torch.manual_seed(0)
    for name in ("momentum", "adamw"):
        spec = SPEC.model_copy(update={"optimizer": name, "weight_decay": 0.01})
        a = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        opt = steps(spec, a, b)
        assert opt.defaults["fused"] is True and not opt.defaults.get("foreach")
        # Fused kernels may round differently from the loop (an operation fused), never by more.
        assert all(torch.allclose(p, q, rtol=1e-6, atol=1e-6) for p, q in zip(a, b, strict=True)), name
        # Asked for foreach: bitwise the loop's steps.
        a = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        opt = steps(spec.model_copy(update={"optimizer_args": {"foreach": True}}), a, b)
        assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), name
    custom = SPEC.model_copy(update={"optimizer": "adamw", "optimizer_args": {"foreach": False}})
    opt = build_optimizer([("w", torch.nn.Parameter(torch.randn(3)))], custom)
    assert opt is not None and opt.defaults["foreach"] is False and not opt.defaults.get("fused")
    # A device with no fused kernels gets foreach (the meta device: shapes only).
    opt = build_optimizer([("w", torch.nn.Parameter(torch.empty(3, device="meta")))], SPEC.model_copy(update={"optimizer": "adamw"}))
    assert opt is not None and opt.defaults["foreach"] is True and not opt.defaults.get("fused")


def test_whole_runs_a_coroutine_that_does_not_suspend_without_a_task_and_shields_one_that_does():
    async def main() -> None:
        tasks = len(asyncio.all_tasks())

        async def at_once() -> int:
            assert len(asyncio.all_tasks()) == tasks  # no shield's task was made for it
            return 1

        assert await whole(at_once()) == 1

        async def failing() -> None:
            raise ValueError("in the first part")

        with pytest.raises(ValueError, match="first part"):
            await whole(failing())

        gate, steps = asyncio.Event(), []

        async def suspends() -> int:
            steps.append("before")
            await gate.wait()
            await asyncio.sleep(0)  # a bare yield to the loop, passed through too
            steps.append("after")
            return 2

        caller = asyncio.create_task(whole(suspends()))
        await asyncio.sleep(0)
        assert steps == ["before"]
        caller.cancel()  # the caller gives up while its coroutine waits: the rest still runs
        with pytest.raises(asyncio.CancelledError):
            await caller
        gate.set()
        for _ in range(10):
            await asyncio.sleep(0)
        assert steps == ["before", "after"]

        async def fails_later() -> None:
            await asyncio.sleep(0)
            raise KeyError("after suspending")

        with pytest.raises(KeyError, match="after suspending"):
            await whole(fails_later())
        assert await whole(suspends()) == 2  # gate set: its result comes back through the task

    asyncio.run(main())


def test_a_trainers_counters_report_the_rate_over_its_last_steps_when_read():
    from collections import deque

    from grains.training.strategies.ps.trainer import _RunCounters

    n = _RunCounters(step=5, steps_done=3, staleness_sum=6, replies=4)
    times: deque[tuple[float, int]] = deque([(10.0, 64), (10.5, 64), (11.0, 32)], maxlen=3)
    fields = n.fields(times)
    # The first step's samples came before the window's span began: (64 + 32) / 1.0 s.
    assert fields["samples_per_s"] == 96.0 and fields["mean_staleness"] == 1.5
    times.append((12.0, 64))  # the oldest leaves the window
    assert n.fields(times)["samples_per_s"] == (32 + 64) / 1.5
    assert _RunCounters().fields(deque())["samples_per_s"] == 0.0
