"""Client-side coalescing: concurrent predicts from one process leave as one grain call."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from grains.serving import ModelGrain, Predictor, ServeSpec, deploy
from grains.serving.coalescer import Coalescer, signature
from grains.serving.errors import BadInputError, ModelNotReadyError
from grains.serving.tensors import Inference
from tests.grains.serving.conftest import GRAINS, replicas, train_digits


class Wire:
    """Stands in for the grain call: doubles its input; each call waits for the gate."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[Any, int]] = []
        self.gate = asyncio.Event()
        self.fail = fail

    async def send(self, inputs: Any, requests: int, deadline: float) -> Any:
        self.calls.append((inputs, requests))
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        if isinstance(inputs, dict):
            if (inputs["a"] < 0).any():
                raise BadInputError("negative")
            return {k: v * 2 for k, v in inputs.items()}
        if (inputs < 0).any():
            raise BadInputError("negative")
        return inputs * 2


def submit(c: Coalescer, x: Any) -> asyncio.Future[Any]:
    sig = signature(x)
    assert sig is not None
    return asyncio.ensure_future(c.submit(x, sig[0], sig[1], asyncio.get_running_loop().time() + 5))


async def test_a_lone_request_leaves_at_once_and_unchanged():
    wire = Wire()
    wire.gate.set()
    c = Coalescer(wire.send, max_rows=64)
    x = torch.ones(2, 3)
    assert torch.equal(await submit(c, x), x * 2)
    assert len(wire.calls) == 1 and wire.calls[0][0] is x and wire.calls[0][1] == 1


async def test_requests_waiting_behind_a_call_leave_merged_and_get_their_own_rows():
    wire = Wire()
    c = Coalescer(wire.send, max_rows=10, in_flight=1)
    first = submit(c, torch.zeros(1, 3))
    await asyncio.sleep(0)
    rows = [torch.full((1 + i % 2, 3), float(i)) for i in range(8)]  # 12 rows: 10 merge, 2 follow
    waiting = [submit(c, r) for r in rows]
    await asyncio.sleep(0)
    wire.gate.set()
    outs = await asyncio.gather(first, *waiting)
    for r, out in zip(rows, outs[1:], strict=True):
        assert torch.equal(out, r * 2)
    assert [req for _, req in wire.calls] == [1, 7, 1]
    assert [x.shape[0] for x, _ in wire.calls] == [1, 10, 2]
    assert c.calls == 3


async def test_only_requests_of_one_signature_merge():
    wire = Wire()
    c = Coalescer(wire.send, max_rows=64, in_flight=1)
    first = submit(c, torch.zeros(1, 3))
    await asyncio.sleep(0)
    xs = [torch.ones(1, 3), torch.ones(1, 4), torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3), torch.ones(1, 4)]
    waiting = [submit(c, x) for x in xs]
    await asyncio.sleep(0)
    wire.gate.set()
    outs = await asyncio.gather(first, *waiting)
    for x, out in zip(xs, outs[1:], strict=True):
        assert out.dtype == x.dtype and torch.equal(out, x * 2)
    assert sorted((tuple(x.shape), req) for x, req in wire.calls[1:]) == [((1, 3), 1), ((2, 3), 2), ((2, 4), 2)]


async def test_named_inputs_merge_by_name():
    wire = Wire()
    c = Coalescer(wire.send, max_rows=64, in_flight=1)
    first = submit(c, {"a": torch.zeros(1, 2), "b": torch.zeros(1)})
    await asyncio.sleep(0)
    xs = [{"a": torch.full((1, 2), float(i)), "b": torch.full((1,), float(i))} for i in range(3)]
    waiting = [submit(c, x) for x in xs]
    await asyncio.sleep(0)
    wire.gate.set()
    outs = await asyncio.gather(first, *waiting)
    for x, out in zip(xs, outs[1:], strict=True):
        assert set(out) == {"a", "b"} and torch.equal(out["a"], x["a"] * 2) and torch.equal(out["b"], x["b"] * 2)
    assert wire.calls[1][0]["a"].shape == (3, 2) and wire.calls[1][1] == 3


async def test_a_bad_request_in_a_merged_call_fails_alone():
    wire = Wire()
    c = Coalescer(wire.send, max_rows=64, in_flight=1)
    first = submit(c, torch.zeros(1, 3))
    await asyncio.sleep(0)
    xs = [torch.ones(1, 3), -torch.ones(1, 3), torch.ones(1, 3) * 3]
    waiting = [submit(c, x) for x in xs]
    await asyncio.sleep(0)
    wire.gate.set()
    outs = await asyncio.gather(first, *waiting, return_exceptions=True)
    assert torch.equal(outs[1], xs[0] * 2) and torch.equal(outs[3], xs[2] * 2)
    assert isinstance(outs[2], BadInputError)
    assert [req for _, req in wire.calls] == [1, 3, 1, 1, 1]  # the merged call, then each again


async def test_any_other_failure_is_every_members_answer_from_one_call():
    wire = Wire(fail=ModelNotReadyError("loading"))
    c = Coalescer(wire.send, max_rows=64, in_flight=1)
    first = submit(c, torch.zeros(1, 3))
    await asyncio.sleep(0)
    waiting = [submit(c, torch.ones(1, 3)) for _ in range(5)]
    await asyncio.sleep(0)
    wire.gate.set()
    outs = await asyncio.gather(first, *waiting, return_exceptions=True)
    assert all(isinstance(e, ModelNotReadyError) for e in outs)
    assert [req for _, req in wire.calls] == [1, 5]


def test_signature_refuses_what_cannot_merge():
    assert signature(torch.tensor(1.0)) is None
    assert signature(torch.zeros(0, 3)) is None
    assert signature({"a": torch.zeros(2, 1), "b": torch.zeros(3, 1)}) is None
    assert signature([1, 2]) is None
    assert signature(torch.zeros(2, 3)) == (2, ("", torch.float32, (3,)))


async def test_predictor_merges_64_concurrent_requests_into_few_calls(cluster, client, digits_test):
    await cluster(1, grains=GRAINS)
    await train_digits(client, steps=10)
    await deploy(client, "digits", ServeSpec(job="digits", max_batch_size=16, reload_poll_s=0.2))
    x, _ = digits_test
    want = [await client.get_grain(ModelGrain, "digits").predict(x[i : i + 1]) for i in range(64)]
    p = Predictor(client, "digits")
    got = await asyncio.gather(*(p.predict(x[i : i + 1]) for i in range(64)))
    for a, b in zip(got, want, strict=True):
        assert a.shape == (1, 10) and torch.allclose(a, b, atol=1e-5)
    assert p.calls is not None and p.calls < 64 / 4, p.calls  # merged, at most 16 rows a call
    # The replica counts requests, not calls: 64 sent one by one above, 64 merged here.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while sum(r.requests for r in await replicas(client)) != 128:
        assert loop.time() < deadline, await replicas(client)
        await asyncio.sleep(0.1)
    with pytest.raises(BadInputError):  # alone or merged, a bad request gets its own error
        await asyncio.gather(p.predict(x[:1]), p.predict(torch.zeros(1, 63)))


async def test_a_caller_that_gives_up_while_queued_is_left_out_of_the_merged_call():
    wire = Wire()
    c = Coalescer(wire.send, max_rows=64, in_flight=1)
    first = submit(c, torch.zeros(1, 3))
    await asyncio.sleep(0)
    keep = [submit(c, torch.ones(1, 3)) for _ in range(3)]
    gone = submit(c, torch.ones(1, 3) * 5)
    await asyncio.sleep(0)
    gone.cancel()  # its caller's deadline passed (asyncio.timeout cancels the same way)
    await asyncio.sleep(0)
    wire.gate.set()
    await asyncio.gather(first, *keep)
    assert gone.cancelled()
    assert [(x.shape[0], req) for x, req in wire.calls] == [(1, 1), (3, 3)]


async def test_merged_inferences_give_each_caller_its_rows_and_the_weights_of_its_own_call():
    steps = iter([40, 60])

    async def send(inputs: Any, requests: int, deadline: float) -> Inference:
        step = next(steps)  # the replica swapped weights between the two calls
        await gate.wait()
        return Inference(inputs * step, f"job step {step}", step)

    gate = asyncio.Event()
    c = Coalescer(send, max_rows=64, in_flight=1, split=Inference.split)
    first = submit(c, torch.ones(1, 3))
    await asyncio.sleep(0)
    xs = [torch.full((1 + i % 2, 3), float(i)) for i in range(4)]
    waiting = [submit(c, x) for x in xs]
    await asyncio.sleep(0)
    gate.set()
    alone, *merged = await asyncio.gather(first, *waiting)
    assert (alone.step, alone.version) == (40, "job step 40") and torch.equal(alone.outputs, torch.ones(1, 3) * 40)
    for x, got in zip(xs, merged, strict=True):
        assert (got.step, got.version) == (60, "job step 60") and torch.equal(got.outputs, x * 60)
