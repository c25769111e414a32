"""A step's random draws are a function of (seed, step, rank): a resumed job draws what the first run drew.

Before, dropout masks after a resume came from wherever torch's generator
happened to be, so a job resumed from checkpoint c was not the run it replaced.
One trainer per process here: in-process silos share torch's default
generator, and two trainers in one process would draw from it in turn.
"""

from __future__ import annotations

import pytest
import torch

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.loop.rng import seed_step, step_seed
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job

DROPOUT = {"model": "grains.training.models:cnn_bn", "model_args": {"dropout": 0.5}, "trainers": 1,
           "batch_size": 32, "optimizer": "momentum", "lr": 0.05, "keep_checkpoints": 5}  # fmt: skip


MODES = {"sync": {}, "allreduce": {}, "pipeline": {"stages": 2, "microbatches": 2}}


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_a_resumed_job_with_dropout_ends_with_the_weights_of_the_uninterrupted_run(cluster, client, mode):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    coord = client.get_grain(CoordinatorGrain, f"rng-{mode}")
    first = await run_job(client, f"rng-{mode}", TrainingJob(**DROPOUT, mode=mode, **MODES[mode], seed=3, steps=20, checkpoint_every=10))
    assert first.status == "completed", first
    straight = await coord.parameters()
    again = await run_job(client, f"rng-{mode}", TrainingJob(**DROPOUT, mode=mode, **MODES[mode], seed=3, steps=20, checkpoint_every=10,
                                                             resume_from_step=10))  # fmt: skip
    assert again.status == "completed" and again.resumed_from == 10, again
    resumed = await coord.parameters()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    # The dropout draws matter: another seed for the same steps from checkpoint 10 ends elsewhere.
    other = await run_job(client, f"rng-{mode}", TrainingJob(**DROPOUT, mode=mode, **MODES[mode], seed=4, steps=20, checkpoint_every=10,
                                                             resume_from_step=10))  # fmt: skip
    assert other.status == "completed", other
    moved = await coord.parameters()
    assert any(not torch.equal(moved[n], straight[n]) for n in straight)


def test_step_seeds_differ_by_seed_step_rank_and_part_and_repeat_exactly():
    seeds = {step_seed(s, t, r, p) for s in (0, 1) for t in range(50) for r in range(4) for p in range(3)}
    assert len(seeds) == 2 * 50 * 4 * 3 and all(0 <= s < 2**63 for s in seeds)
    seed_step(7, 12, 1)
    a = torch.rand(5)
    torch.rand(100)  # whatever else ran since
    seed_step(7, 12, 1)
    assert torch.equal(torch.rand(5), a)


def test_the_step_runner_draws_by_step_and_rank_and_repeats_a_step_exactly():
    """What the resume test cannot tell apart: a seed that ignores the step or the rank would
    resume exactly too, but give every step (or every trainer) the same dropout masks."""
    from grains.training.data.batches import Batches
    from grains.training.datasets import load_dataset
    from grains.training.loop.step_runner import StepRunner
    from grains.training.models import build_model

    spec = TrainingJob(**{k: v for k, v in DROPOUT.items() if k != "keep_checkpoints"}, seed=1)
    model = build_model(spec)
    runner = StepRunner(spec, "cpu", model.parameters())
    batch = Batches(load_dataset(spec, "train")).batch(32, 1, 0, 0, spec.seed)

    def grads(step: int, rank: int) -> list[torch.Tensor]:
        runner.backward(model, batch, step, rank=rank, trainers=2)
        return [p.grad.clone() for p in runner.params]

    first = grads(3, 0)
    torch.rand(100)  # whatever else drew meanwhile
    assert all(torch.equal(a, b) for a, b in zip(first, grads(3, 0), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, grads(4, 0), strict=True))  # another step
    assert not all(torch.equal(a, b) for a, b in zip(first, grads(3, 1), strict=True))  # another rank
