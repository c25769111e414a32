"""A checkpoint restores a shard exactly: parameters and optimizer state, bit for bit."""

from __future__ import annotations

import torch

from grains.training import CoordinatorGrain, ParamShardGrain, TrainingJob
from grains.training.api.messages import ShardConfig
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.strategies.ps.driver import split_by_bytes
from grains.training.submit import check_job
from tests.grains.training.conftest import GRAINS, run_job
from tests.grains.training.test_sync import reference_parameters


def assert_identical(a: TrainingSnapshot, b: TrainingSnapshot) -> None:
    assert a.version == b.version
    assert a.params.keys() == b.params.keys()
    for n in a.params:
        assert a.params[n].dtype == b.params[n].dtype and torch.equal(a.params[n], b.params[n]), n
    sa, sb = a.optimizer["state"], b.optimizer["state"]
    assert sa.keys() == sb.keys() and sa, "optimizer state is empty"
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for field in sa[k]:
            x, y = sa[k][field], sb[k][field]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (k, field)
    assert a.optimizer["param_groups"] == b.optimizer["param_groups"]


async def test_checkpoint_restores_parameters_and_adam_state_bit_exactly(cluster, client):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(optimizer="adam", lr=0.01, weight_decay=0.01, trainers=2, shards=2, steps=30,
                       batch_size=32, checkpoint_every=15, mode="async")  # fmt: skip
    st = await run_job(client, "ckpt", spec)
    assert st.status == "completed" and st.checkpoints == [15, 30], st
    # The job's shards were released when it completed; its final checkpoint (30) is read
    # whole, and a shard configured from 15 and then from 30 must hold exactly that.
    coord = client.get_grain(CoordinatorGrain, "ckpt")
    final = await coord.parameters()
    layout = split_by_bytes(check_job(spec).sizes(), 2)  # as the driver split the model
    for i, key in enumerate(st.shard_keys):
        shard = client.get_grain(ParamShardGrain, key)
        names = layout[i]
        cfg = ShardConfig(job="ckpt", index=i, spec=spec, names=names, shard_keys=st.shard_keys,
                          trainers=2, generation=st.generation + 1, run=st.run, restore_step=30)  # fmt: skip
        await shard.configure(cfg)
        at_30 = await shard.export_state()
        for n in at_30.params:
            assert torch.equal(at_30.params[n], final[n]), n
        await shard.configure(cfg.model_copy(update={"generation": st.generation + 2, "restore_step": 15}))
        at_15 = await shard.export_state()
        assert at_15.version < at_30.version
        assert not all(torch.equal(at_15.params[n], at_30.params[n]) for n in at_30.params)
        await shard.configure(cfg.model_copy(update={"generation": st.generation + 3, "restore_step": 30}))
        assert_identical(await shard.export_state(), at_30)


async def test_parameter_shards_restore_their_slice_and_never_build_the_whole_model(cluster, client, monkeypatch):
    """The seeded weights are the run's checkpoint 0: each shard reads its slice of it (a shard
    used to build the whole model for its slice, twice)."""
    from grains.training.strategies.ps import shard, shard_core

    def refuse(spec):
        raise AssertionError("a parameter shard built the whole model")

    monkeypatch.setattr(shard, "build_model", refuse)
    monkeypatch.setattr(shard_core, "build_model", refuse)
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(mode="sync", trainers=2, shards=2, steps=20, batch_size=32, checkpoint_every=10, keep_checkpoints=5)
    st = await run_job(client, "no-whole-model", spec)
    assert st.status == "completed" and st.checkpoints == [0, 10, 20], st
    want = reference_parameters(spec, trainers=2, steps=20)  # the seeded model, trained as one process
    got = await client.get_grain(CoordinatorGrain, "no-whole-model").parameters()
    for name, w in want.items():
        assert torch.allclose(got[name], w, rtol=1e-3, atol=1e-4), name
