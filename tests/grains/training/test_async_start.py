"""async and ssp trainers start together: a trainer's first pull waits for every trainer's first pull."""

from __future__ import annotations

import asyncio

import pytest

from grains.training import ParamShardGrain, TrainingJob
from grains.training.api.messages import ShardConfig
from grains.training.models import build_model
from tests.grains.training.conftest import GRAINS


async def configured_shard(client, mode: str) -> ParamShardGrain:
    spec = TrainingJob(mode=mode, trainers=2, shards=1, steps=10, batch_size=32, checkpoint_every=0)
    names = [n for n, _ in build_model(spec).named_parameters()]
    key = f"start-{mode}/shard-0"
    cfg = ShardConfig(job=f"start-{mode}", index=0, spec=spec, names=names, shard_keys=[key], trainers=2,
                      generation=0, run=0, restore_step=None)  # fmt: skip
    shard = client.get_grain(ParamShardGrain, key)
    await shard.configure(cfg)
    return shard


@pytest.mark.parametrize("mode", ["async", "ssp"])
async def test_a_first_pull_waits_for_every_trainers_first_pull(cluster, client, mode):
    # Measured before: one trainer ready 2.7 s before the other ran the 16 steps to the first
    # checkpoint alone, at the warmup's lr of step 0, and its next pushes landed 17 updates stale.
    await cluster(1, grains=GRAINS)
    shard = await configured_shard(client, mode)
    first = asyncio.ensure_future(shard.exchange(0, 0, 0, None, -1, -1))
    # Nothing to await for "still waiting": a pull answered at once took milliseconds before; a
    # slow machine can only make this pass, never fail, with the barrier in place.
    done, _ = await asyncio.wait({first}, timeout=1.0)
    assert not done
    second = await shard.exchange(0, 1, 0, None, -1, -1)
    replied = await first
    assert replied.version == second.version == 0 and replied.params is not None
    # A trainer restarted later (same configuration) finds the others past their first pull.
    again = await asyncio.wait_for(shard.exchange(0, 0, 0, None, -1, -1), 30)
    assert again.version == 0


async def test_a_first_pull_alone_is_answered_in_sync_mode(cluster, client):
    # sync needs no start barrier: its first step's reply already waits for every trainer.
    await cluster(1, grains=GRAINS)
    shard = await configured_shard(client, "sync")
    reply = await asyncio.wait_for(shard.exchange(0, 0, 0, None, -1, -1), 30)
    assert reply.version == 0 and reply.params is not None
