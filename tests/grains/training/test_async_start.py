"""async and ssp trainers start together: the reply to a trainer's first push waits until every
trainer's first push is applied; later replies do not wait (async)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from grains.training import ParamShardGrain, TrainingJob
from grains.training.api.messages import ShardConfig
from grains.training.models import build_model
from tests.grains.training.conftest import GRAINS


async def configured_shard(client, mode: str) -> tuple[ParamShardGrain, dict[str, torch.Tensor]]:
    spec = TrainingJob(mode=mode, trainers=2, shards=1, steps=10, batch_size=32, checkpoint_every=0)
    grads = {n: torch.full_like(p, 0.01) for n, p in build_model(spec).named_parameters()}
    key = f"start-{mode}/shard-0"
    cfg = ShardConfig(job=f"start-{mode}", index=0, spec=spec, names=list(grads), shard_keys=[key], trainers=2,
                      generation=0, run=0, restore_step=None)  # fmt: skip
    shard = client.get_grain(ParamShardGrain, key)
    await shard.configure(cfg)
    return shard, grads


@pytest.mark.parametrize("mode", ["async", "ssp"])
async def test_the_first_push_is_answered_once_every_trainer_pushed_its_first_step(cluster, client, mode):
    # Measured before: a trainer whose first step came 2.7 s after the other's on a fresh cluster
    # let that one run the 16 steps to the first checkpoint alone, and then push 17 updates stale.
    await cluster(1, grains=GRAINS)
    shard, grads = await configured_shard(client, mode)
    await asyncio.gather(*(shard.exchange(0, r, 0, None, -1, -1) for r in (0, 1)))  # pulls never wait
    first = asyncio.ensure_future(shard.exchange(0, 0, 0, grads, 0, 0))
    # Nothing to await for "still waiting": a reply that does not wait took milliseconds before;
    # a slow machine can only make this pass, never fail, with the wait in place.
    done, _ = await asyncio.wait({first}, timeout=1.0)
    assert not done
    second = await shard.exchange(0, 1, 0, grads, 0, 0)
    replied = await first
    assert replied.version >= 1 and second.version == 2
    if mode == "async":  # past the first step, a push is answered alone again
        third = await asyncio.wait_for(shard.exchange(0, 0, 1, grads, replied.version, replied.version), 30)
        assert third.version == 3
