"""A failed job's status shows the step it failed at, in every mode and after a resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch.nn.functional as F

from grains.training import TrainingJob
from tests.grains.training.conftest import GRAINS, run_job

FAIL_AT = 12


def nan_at_12(model: Any, batch: Any, ctx: Any) -> Any:
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    return loss * float("nan") if ctx.step == FAIL_AT else loss


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
async def test_a_job_failed_at_step_12_says_step_12_and_so_does_its_resume(cluster, client, mode):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(mode=mode, step=f"{__name__}:nan_at_12", steps=30, batch_size=16, checkpoint_every=5)
    first = await run_job(client, f"fails-{mode}", spec)
    assert first.status == "failed" and "NonFiniteLossError" in first.error, first
    assert first.step == FAIL_AT, first
    # The resumed run restores checkpoint 10 and fails again at 12: never "step 0/30, epoch 3.6".
    again = await run_job(client, f"fails-{mode}", spec.model_copy(update={"resume": True}))
    assert again.status == "failed" and again.resumed_from == 10, again
    assert again.step == FAIL_AT, again
