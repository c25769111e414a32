"""Async and ssp reach sync's accuracy with the same spec: the small benchmark config (momentum-SGD,
Adam) and the HF-style fine-tune (AdamW)."""

from __future__ import annotations

import pytest

from grains.training import TrainingJob
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job, training_silos

# benchmarks/bench_training.py's small config: the digits MLP, momentum 0.9 at lr 0.05, batch 64.
SMALL = {"optimizer": "momentum", "lr": 0.05, "batch_size": 64, "checkpoint_every": 0, "trainers": 2, "shards": 2}
ADAM = {**SMALL, "optimizer": "adam", "lr": 0.003}


# Adam over four seeds, its modes compared by their means: one seed's async or ssp run moves a
# point or two from run to run (the order the two trainers' pushes land in), and seed 0 is the
# worst of seeds 0-6: its ssp 0.958-0.972 against sync's 0.975, its async 0.950-0.969. Over two
# seeds (0, 1) that failed about one run in eighteen; over four, seed 0's worst run seen moves
# the mean by 0.6 points. Seeds 0-3, once each (2026-12-05, fused and foreach Adam): sync
# 0.975/0.978/0.978/0.969, async within 1.4 points of it and ssp within 1.7 on every seed, the
# means within 0.3. Momentum-SGD's ssp and async end at or above sync on each of seeds 0-6.
@pytest.mark.parametrize(("spec", "seeds"), [(SMALL, (0,)), (ADAM, (0, 1, 2, 3))], ids=["momentum", "adam"])
async def test_async_and_ssp_end_within_a_point_of_sync(cluster, client, spec, seeds):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    acc: dict[str, list[float]] = {}
    for seed in seeds:
        for mode in ("sync", "async", "ssp"):
            job = TrainingJob(**spec, mode=mode, steps=600, seed=seed)
            st = await run_job(client, f"conv-{mode}-{seed}", job, timeout_s=180)
            assert st.status == "completed" and st.accuracy is not None, st
            acc.setdefault(mode, []).append(st.accuracy)
    mean = {mode: sum(a) / len(a) for mode, a in acc.items()}
    assert all(a >= 0.95 for a in acc["sync"]), acc
    # Before the staleness-aware rate, momentum-SGD async ended anywhere between 38% and 93% here.
    assert mean["async"] >= mean["sync"] - 0.01 and mean["ssp"] >= mean["sync"] - 0.01, acc


@pytest.mark.slow
@pytest.mark.soak  # about a minute: make soak (make test keeps the digits cases and test_async_rate.py)
async def test_ssp_with_adamw_ends_within_two_f1_points_of_sync_on_the_hf_fine_tune(silo_processes, client):
    # samples/hf_finetune.py's job (tiny BERT, AdamW with no-decay groups, HF's warmup schedule,
    # accumulation 2, clipping) run to its end: early stopping on a plateau would measure when
    # the plateau ended, not the update rule. Seed 3: sync F1 0.991, ssp 0.980-0.996 measured.
    # Async is held only to leaving the task's initial plateau (F1 ~0.2): run by run it ended
    # 0.786-0.978 here at lr/sqrt(trainers); with delay compensation and the start barrier,
    # 0.9-1.9 points behind sync on average over seeds 1-4 in `python -m benchmarks async_adam`
    # at load 6-9 (2.3-3.8 idle) and up to 3.1 (5.9 idle) behind on one seed, so one run
    # cannot hold async to 2 points, nor separate it from the rules before. test_async_rate.py,
    # test_delay_compensation.py and test_async_start.py pin the rules.
    from samples.hf_finetune import Args, job

    silo_processes(2, grains="grains.training", env={"OMP_NUM_THREADS": "1"})
    await training_silos(client, 2)
    f1 = {}
    for mode in ("sync", "async", "ssp"):
        spec = TrainingJob.model_validate({**job(Args(seed=3), mode), "callbacks": []})
        st = await run_job(client, f"hf-{mode}", spec, timeout_s=180)
        assert st.status == "completed" and st.step == spec.steps, st
        f1[mode] = st.eval_metrics["f1"]
    assert f1["sync"] >= 0.98, f1
    assert f1["ssp"] >= f1["sync"] - 0.02, f1
    assert f1["async"] >= 0.7, f1
