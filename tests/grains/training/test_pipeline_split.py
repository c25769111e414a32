"""Pipeline mode beyond an nn.Sequential: cuts at named split points (torch.fx), the user's loss on
the last stage, stages built on the meta device, and stage placement by free memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.models import build_model
from grains.training.strategies.pipeline.partition import cut, stage_module
from grains.training.strategies.pipeline.placement import place_stages
from grains.training.submit import check_job
from silo import errors
from silo.records.membership import MemberRow, SiloLoad
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job
from tests.grains.training.test_own_step import global_batches
from tests.grains.training.test_pipeline import plain_loop


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))  # residual: not a chain of children


class ResNet(nn.Module):
    """A residual MLP whose forward loops over its blocks and scales by a bare parameter."""

    def __init__(self, features: int = 64, width: int = 32, blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.gain = nn.Parameter(torch.ones(width))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h * self.gain)


class Branchy(ResNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if h.sum() > 0:  # control flow on a tensor value: torch.fx cannot trace it
            h = h * 2
        return self.head(h)


seen_devices: list[str] = []


def resnet(**kw: Any) -> nn.Module:
    seen_devices.append(str(torch.empty(0).device))  # which device the factory builds on
    return ResNet(**kw)


def branchy() -> nn.Module:
    return Branchy()


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    loss = F.mse_loss(output, target)
    return loss, {"mae": float((output.detach() - target).abs().mean())}


def regression_metrics(model: nn.Module, batch: Any) -> dict[str, float]:
    x, y = batch
    return {"mse": float(F.mse_loss(model(x), y))}


RESNET = {"model": f"{__name__}:resnet", "mode": "pipeline", "trainers": 1}


async def test_a_residual_net_cut_at_split_points_equals_the_single_process_loop(cluster, client):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(**RESNET, split_points=["blocks.1"], microbatches=4, batch_size=32, steps=24,
                       optimizer="momentum", lr=0.05, weight_decay=1e-4, clip_grad_norm=1.0, checkpoint_every=10,
                       seed=4)  # fmt: skip
    assert spec.stages == 2
    st = await run_job(client, "split-resnet", spec, timeout_s=120)
    assert st.status == "completed", st
    assert len(set(st.trainer_silos)) == 2, st
    # Each stage holds only its part, under the whole model's names.
    model = build_model(spec)
    first = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith(("embed", "blocks.0")))
    assert [g.param_bytes for g in st.stages] == [first, sum(p.numel() * 4 for p in model.parameters()) - first], st.stages
    got = await client.get_grain(CoordinatorGrain, "split-resnet").state_dict()
    want = plain_loop(spec, 24)
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-5), (k, (got[k] - v).abs().max())


async def test_a_regression_pipeline_with_the_users_loss_equals_the_single_process_loop(cluster, client):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(model="grains.training.models:regressor", dataset="grains.training.datasets:regression",
                       loss=f"{__name__}:mse_loss", evaluate=f"{__name__}:regression_metrics", mode="pipeline",
                       trainers=1, stages=2, microbatches=4, batch_size=32, steps=40, optimizer="adam", lr=0.01,
                       checkpoint_every=20, eval_every=40)  # fmt: skip
    st = await run_job(client, "split-mse", spec, timeout_s=120)
    assert st.status == "completed", st
    assert set(st.metrics) == {"mae"} and set(st.eval_metrics) == {"mse"}, st
    model = build_model(spec)
    batches = global_batches(spec, 1, 40)
    with torch.no_grad():
        first = float(F.mse_loss(model(batches[0][0]), batches[0][1]))
    assert st.loss is not None and st.loss < 0.5 * first, (first, st.loss)  # the user's loss fell
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    got = await client.get_grain(CoordinatorGrain, "split-mse").state_dict()
    for k, v in model.state_dict().items():
        assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-5), (k, (got[k] - v).abs().max())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"split_points": ["blocks.7"]}, "no submodule"),
        ({"split_points": ["head", "blocks.1"]}, "order the forward"),
        ({"split_points": ["blocks", "blocks.0"]}, "more stages than layers"),
        ({"split_points": ["blocks.1.fc"]}, "2 values cross"),
        ({"model": f"{__name__}:branchy", "split_points": ["head"]}, "cannot trace"),
        ({"split_points": []}, "names no split_points"),
    ],
)
def test_split_points_that_cannot_cut_the_model_fail_at_submit(change, match):
    spec = TrainingJob(**{**RESNET, "split_points": ["blocks.1"], "steps": 1, **change})
    with pytest.raises(errors.ConfigError, match=match):
        check_job(spec)


def test_pipeline_hooks_and_split_points_are_validated_with_the_spec():
    with pytest.raises(Exception, match="loss = 'pkg.module:fn'"):
        TrainingJob(mode="pipeline", trainers=1, step="grains.training.steps:classification_step2")
    with pytest.raises(Exception, match="not stages=3"):
        TrainingJob(**RESNET, split_points=["blocks.1"], stages=3)
    with pytest.raises(Exception, match="pipeline mode's hook"):
        TrainingJob(mode="sync", loss=f"{__name__}:mse_loss")
    with pytest.raises(Exception, match="cut a pipeline"):
        TrainingJob(mode="sync", split_points=["head"])
    assert TrainingJob(**RESNET, split_points=["blocks.0", "head"]).stages == 3


def test_a_stage_restoring_a_checkpoint_builds_the_model_on_the_meta_device_only():
    spec = TrainingJob(**RESNET, split_points=["blocks.2"], steps=1)
    layers, sizes = cut(build_model(spec), spec)
    seen_devices.clear()
    module = stage_module(spec, 1, layers[1], "cpu", from_checkpoint=True)
    assert seen_devices == ["meta"]  # the whole model never had storage here
    assert sorted(n for n, _ in module.named_parameters()) == sorted(
        ["blocks.2.norm.weight", "blocks.2.norm.bias", "blocks.2.fc.weight", "blocks.2.fc.bias", "gain", "head.weight", "head.bias"]
    )
    assert all(p.device.type == "cpu" for p in module.parameters())
    assert sum(t.numel() * t.element_size() for t in module.state_dict().values()) == sizes[1]
    # A Sequential's slice keeps the whole model's names too.
    seq = TrainingJob(mode="pipeline", trainers=1, stages=2, model_args={"hidden": [64, 64]})
    assert [n for n, _ in stage_module(seq, 1, (4, 6), "cpu", True).named_parameters()] == ["5.weight", "5.bias"]


def _row(port: int, free: int, roles: tuple[str, ...] = ()) -> MemberRow:
    return MemberRow(address=f"127.0.0.1:{port}@1", host="127.0.0.1", port=port, generation=1, roles=list(roles),
                     load=SiloLoad(memory_available_bytes=free))  # fmt: skip


def test_stages_go_to_silos_with_room_for_them_one_a_silo():
    big, small = _row(1, 10_000), _row(2, 1_000)
    # Stage 0 needs more than the small silo has: it goes to the big one, stage 1 to the small one.
    assert [r.port for r in place_stages([small, big], [5_000, 500]).rows] == [1, 2]
    # In pipeline order, one stage a silo, when all have room (or report nothing).
    unknown = [_row(1, 0), _row(2, 0)]
    assert [r.port for r in place_stages(unknown, [1, 1, 1]).rows] == [1, 2, 1]
    # What an earlier stage took counts: two big stages do not both fit on the big silo.
    assert [r.port for r in place_stages([big, small, _row(3, 6_000)], [5_000, 5_000]).rows] == [1, 3]
    # Sharing a silo beats a silo without room.
    assert [r.port for r in place_stages([big, small], [4_000, 4_000]).rows] == [1, 1]
    # No room anywhere: where the most is left, and the placement says so.
    placed = place_stages([big, small], [20_000])
    assert [r.port for r in placed.rows] == [1] and placed.short == [0]
