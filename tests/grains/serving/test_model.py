"""ModelGrain end to end in one process: deploy a trained job, predict, batching, bad input."""

from __future__ import annotations

import asyncio

import pytest
import torch

from grains.serving import ModelGrain, Predictor, ServeSpec, TensorSpec, deploy
from grains.serving.errors import BadInputError, ModelNotFoundError, RequestTooLargeError
from tests.grains.serving.conftest import GRAINS, replicas, train_digits
from tests.grains.serving.models import FORWARD_ROWS


async def test_served_job_predicts_the_test_split_like_the_job_scored_it(cluster, client, digits_test):
    await cluster(1, grains=GRAINS)
    st = await train_digits(client)
    await deploy(client, "digits", ServeSpec(job="digits"))
    model = client.get_grain(ModelGrain, "digits")
    info = await model.metadata()
    assert (info.inputs[0].shape, info.outputs[0].shape, info.step) == ([-1, 64], [-1, 10], st.step)
    x, y = digits_test
    # One request per row, all at once: the replica merges them into batches.
    rows = await asyncio.gather(*(model.predict(x[i : i + 1]) for i in range(len(y))))
    acc = float((torch.cat(rows).argmax(1) == y).float().mean())
    assert acc >= 0.95 and abs(acc - st.accuracy) < 1e-6, (acc, st.accuracy)
    whole = await model.predict(x)
    assert torch.allclose(whole, torch.cat(rows), atol=1e-5)


async def test_bad_requests_are_refused_without_harming_the_replica(cluster, client, digits_test):
    await cluster(1, grains=GRAINS)
    await train_digits(client, steps=10)
    await deploy(client, "digits", ServeSpec(job="digits", max_request_rows=100))
    p = Predictor(client, "digits")
    x, _ = digits_test
    with pytest.raises(BadInputError, match=r"expected \[-1, 64\]"):
        await p.predict(torch.zeros(2, 63))
    with pytest.raises(BadInputError, match="expected FP32"):
        await p.predict(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(RequestTooLargeError):
        await p.predict(torch.zeros(101, 64))
    with pytest.raises(ModelNotFoundError):
        await Predictor(client, "nope").predict(x[:1])
    good = asyncio.gather(*(p.predict(x[i : i + 1]) for i in range(50)))
    bad = asyncio.gather(*(p.predict(torch.zeros(1, 3)) for i in range(50)), return_exceptions=True)
    ok, refused = await asyncio.gather(good, bad)
    assert len(ok) == 50 and all(isinstance(e, BadInputError) for e in refused)
    assert await p.ready()


async def test_requests_of_two_shapes_go_in_batches_of_one_shape_and_no_forward_fails(cluster, client, tmp_path):
    await cluster(1, grains=GRAINS)
    weights = tmp_path / "rowsum.pt"
    torch.save({"scale": torch.tensor([2.0])}, weights)
    spec = ServeSpec(model="tests.grains.serving.models:RowSum", weights=str(weights), reload_poll_s=0.2,
                     inputs=[TensorSpec(name="input", shape=[-1, -1])], inline_below_ms=0)  # fmt: skip
    await deploy(client, "rowsum", spec)
    model = client.get_grain(ModelGrain, "rowsum")
    xs = [torch.full((1 + i % 3, 3 if i % 2 else 5), float(i)) for i in range(64)]
    outs = await asyncio.gather(*(model.predict(x) for x in xs))
    for x, y in zip(xs, outs, strict=True):
        assert torch.equal(y, x.sum(1, keepdim=True) * 2)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not (live := await replicas(client)) or live[0].requests < 64:
        assert loop.time() < deadline, live
        await asyncio.sleep(0.1)
    (rec,) = live
    # Merged (fewer batches than requests), and each batch ran once: a batch mixing the two
    # shapes fails its torch.cat and runs again request by request (passes > batches).
    assert rec.batches < 64 and rec.passes == rec.batches, rec


async def test_a_request_larger_than_max_batch_size_runs_as_passes_of_at_most_that_many_rows(cluster, client, tmp_path):
    await cluster(1, grains=GRAINS)
    weights = tmp_path / "w.pt"
    torch.save({"scale": torch.tensor([2.0])}, weights)
    spec = ServeSpec(model="tests.grains.serving.models:Meeting", model_args={"tag": "split"}, weights=str(weights),
                     inputs=[TensorSpec(name="input", shape=[-1, 3])], max_batch_size=16, max_request_rows=1000)  # fmt: skip
    await deploy(client, "split", spec)
    x = torch.arange(1, 301, dtype=torch.float32).reshape(100, 3)
    FORWARD_ROWS.pop("split", None)
    got = await client.get_grain(ModelGrain, "split").infer(x)
    assert torch.equal(got.outputs, x.sum(1, keepdim=True) * 2)  # the whole batch's answer, rows in order
    assert max(FORWARD_ROWS["split"]) <= 16 and sum(FORWARD_ROWS["split"]) == 100, FORWARD_ROWS
    assert (got.version, got.step) == ("w.pt @ " + f"{weights.stat().st_mtime:.3f}", 0)
    # Through a Predictor (a request at the limit goes alone, uncoalesced), the same.
    FORWARD_ROWS.pop("split")
    assert torch.equal(await Predictor(client, "split").predict(x), x.sum(1, keepdim=True) * 2)
    assert max(FORWARD_ROWS["split"]) <= 16 and sum(FORWARD_ROWS["split"]) == 100, FORWARD_ROWS
