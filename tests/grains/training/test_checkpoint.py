"""A checkpoint restores a shard exactly: parameters and optimizer state, bit for bit."""

from __future__ import annotations

import torch

from grains.training import CoordinatorGrain, ParamShardGrain, TrainingJob
from grains.training.api.messages import ShardConfig
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.strategies.ps.driver import split_by_bytes
from grains.training.submit import check_job
from tests.grains.training.conftest import GRAINS, run_job


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
