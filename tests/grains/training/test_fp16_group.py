"""fp16 loss scaling is one value per job, not one per rank: ranks stay bit-identical.

An all-reduce mean of gradients scaled by different factors is no gradient:
a joiner that came with a fresh scaler used to leave the ranks 1e-2 apart
after one step. The loss scale now travels in every snapshot (a peer's copy
and the checkpoint alike), and every rank unscales the same mean, so every
rank takes the same overflow decision.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import torch

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.state.checkpoint import extract
from grains.training.state.store import CheckpointStoreGrain
from grains.training.steps import classification_step
from grains.training.strategies.allreduce.trainer_core import TrainerCore
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, status_when, wait_done

_TRACES: dict[str, list[str]] = {}
_IDS = itertools.count()


def traced_step(model: torch.nn.Module, batch: Any) -> Any:
    """The default step, recording a digest of the weights it starts from, per model object."""
    tag = model.__dict__.setdefault("_rg_trace", f"m{next(_IDS)}")
    digest = hashlib.sha1(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
    _TRACES.setdefault(tag, []).append(digest)
    return classification_step(model, batch)


def distinct(trace: list[str]) -> list[str]:
    """The weights a model went through, repeats collapsed (a skipped or replayed step repeats them)."""
    return [d for i, d in enumerate(trace) if i == 0 or trace[i - 1] != d]


SPEC = {"mode": "allreduce", "precision": "fp16", "loss_scale": 2.0**24, "loss_scale_growth_interval": 3,
        "batch_size": 32, "optimizer": "momentum", "lr": 0.05, "seed": 11}  # fmt: skip


async def test_fp16_ranks_stay_bit_identical_through_overflows_and_a_reformed_group(cluster, client):
    silos = await cluster(3, grains=GRAINS, membership=MembershipSettings(suspect_after_s=1.0))
    for silo in silos:
        await silo.view.refresh()
    _TRACES.clear()
    spec = TrainingJob(**SPEC, trainers=2, steps=400, checkpoint_every=20, step=f"{__name__}:traced_step")
    coord = client.get_grain(CoordinatorGrain, "fp16-group")
    await coord.start(spec)
    before = await status_when(coord, lambda s: s.status == "running" and s.step >= 30)
    # Kill (no drain, no hand-off) a rank's silo that is not the coordinator's.
    victim = next(s for s in silos if str(s.address) in before.trainer_silos and str(s.address) != before.coordinator_silo)
    await victim.stop(graceful=False)
    st = await wait_done(coord, timeout_s=120)
    assert st.status == "completed", st
    assert st.generation > before.generation and str(victim.address) not in st.trainer_silos, st
    traces = [distinct(t) for t in _TRACES.values() if len(t) > 5]  # the ranks (not the submit check)
    assert len(traces) == 3, [len(t) for t in traces]  # two first ranks and the one that joined
    traces.sort(key=len, reverse=True)
    survivor = traces[0]
    lost, joiner = sorted(traces[1:], key=lambda t: t[0] != survivor[0])  # the lost one began with it
    # The survivor went through every state; the lost rank through the same ones until it died,
    # and the joiner from the state it copied on: bit for bit, at every step.
    assert lost == survivor[: len(lost)]
    assert joiner == survivor[len(survivor) - len(joiner) :]
    assert len(joiner) > 10
    # Overflows happened (scale 2**24 overflows fp16 at once) and the scale came back down.
    evaluator_names = list((await coord.state_dict()).keys())
    store: Any = client.get_grain(CheckpointStoreGrain, "fp16-group")
    snap = await store.read(st.run, st.checkpoints[-1], [n for n in evaluator_names if "weight" in n or "bias" in n], [])
    assert snap.scaler and snap.scaler["scale"] < 2.0**24, snap.scaler


def test_the_loss_scale_survives_a_snapshot_round_trip():
    spec = TrainingJob(**SPEC, trainers=1, steps=10)
    a = TrainerCore(spec, "cpu")
    a.runner.scaler.scale, a.runner.scaler.growth_tracker = 1024.0, 2  # type: ignore[union-attr]
    a.fresh(0)
    snap = a.snapshot()
    assert snap.scaler == {"scale": 1024.0, "growth_tracker": 2.0}
    again = extract([snap], list(snap.params), list(snap.buffers))  # how any mode reads it back
    b = TrainerCore(spec, "cpu")
    b.load(again, 0)
    assert b.runner.state_dict() == a.runner.state_dict()
