"""The front's core (grains/serving/front.py) over a stand-in replica: how many merged calls it keeps out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from grains.serving.front import Front
from grains.serving.tensors import Inference


class _Replica:
    """A model grain reference that doubles its input and holds every call until ``gate`` opens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.first = asyncio.Event()
        self.active = 0
        self.most = 0
        self.calls: list[int] = []

    def with_timeout(self, _: float) -> _Replica:
        return self

    async def metadata(self) -> Any:
        return SimpleNamespace(max_batch_size=64)

    async def infer(self, inputs: dict[str, torch.Tensor], requests: int = 1) -> Inference:
        self.active += 1
        self.most = max(self.most, self.active)
        self.calls.append(requests)
        self.first.set()
        try:
            await self.gate.wait()
        finally:
            self.active -= 1
        return Inference({"output": inputs["input"] * 2}, "v1", 1)


class _Client:
    def __init__(self, replica: _Replica, silos: int = 1) -> None:
        self.replica = replica
        self.view = SimpleNamespace(hosting=lambda type_name: [object()] * silos)

    def get_grain(self, grain: Any, name: str) -> _Replica:
        return self.replica


async def _six_requests(in_flight: int | None, silos: int = 1) -> tuple[_Replica, list[torch.Tensor]]:
    replica = _Replica()
    front = Front(_Client(replica, silos), in_flight=in_flight)
    rows = [torch.full((1, 4), float(k)) for k in range(6)]
    tasks = [asyncio.ensure_future(front.infer("m", {"input": r})) for r in rows]
    await replica.first.wait()  # the first request left alone; the other five queue behind it
    replica.gate.set()
    answers = await asyncio.gather(*tasks)
    return replica, [a.outputs["output"] for a in answers]


@pytest.mark.parametrize("in_flight", [1, 2])
async def test_a_front_keeps_at_most_in_flight_merged_calls_out_and_each_caller_gets_its_rows(in_flight):
    replica, outs = await _six_requests(in_flight)
    assert replica.most == in_flight
    assert sum(replica.calls) == 6 and len(replica.calls) < 6  # merged: fewer calls than requests
    for k, out in enumerate(outs):
        assert torch.equal(out, torch.full((1, 4), 2.0 * k))


@pytest.mark.parametrize("silos", [1, 2, 3])
async def test_by_default_a_front_keeps_one_call_out_per_silo_that_hosts_replicas(silos):
    replica, outs = await _six_requests(None, silos)
    assert replica.most == silos
    for k, out in enumerate(outs):
        assert torch.equal(out, torch.full((1, 4), 2.0 * k))


def test_a_front_refuses_no_call_in_flight():
    with pytest.raises(ValueError, match="in_flight"):
        Front(None, in_flight=0)


async def test_serve_refuses_in_flight_below_one_before_connecting():
    import argparse

    from grains.serving import command
    from silo import errors

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    with pytest.raises(errors.ConfigError, match="--in-flight 0"):
        await command.run(p.parse_args(["--in-flight", "0"]), None, None, None)
