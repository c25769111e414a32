"""Parameter-server mode with trainers = "auto": a trainer silo that joins mid-run gets a trainer."""

from __future__ import annotations

from grains.training import CoordinatorGrain, TrainingJob
from tests.grains.training import data_ids
from tests.grains.training.conftest import GRAINS, grown_at_a_gate, status_when, wait_done


async def test_ps_job_with_auto_trainers_gains_a_trainer_when_a_silo_joins(cluster, client):
    data_ids.reset(limit=40)
    try:
        await cluster(1, grains=GRAINS)
        spec = TrainingJob(mode="sync", trainers="auto", shards=1, steps=1500, batch_size=32, optimizer="momentum",
                           lr=0.05, checkpoint_every=20, keep_checkpoints=20, step="tests.grains.training.data_ids:gated")  # fmt: skip
        coord = client.get_grain(CoordinatorGrain, "ps-grow")
        await coord.start(spec)
        first = await status_when(coord, lambda s: s.status == "running" and s.step >= 10)
        assert first.trainers == 1
        (joiner,) = await cluster(1, grains=GRAINS)
        grown = await grown_at_a_gate(coord, lambda s: s.trainers == 2, 60, 1000, 20)
        data_ids.control(limit=None)
        change = grown.changes[-1]
        assert "joined" in change.reason and change.trainers == 2, change
        # Grown right at a committed checkpoint: the new generation restores it, so little is redone.
        assert change.start_step in grown.checkpoints and change.start_step >= first.step - first.step % 20
        st = await wait_done(coord)
    finally:
        data_ids.control(limit=None)
    assert st.status == "completed" and st.trainers == 2, st
    assert str(joiner.address) in st.trainer_silos
    assert st.accuracy is not None and st.accuracy > 0.9, st
