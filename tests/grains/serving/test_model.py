"""ModelGrain end to end in one process: deploy a trained job, predict, batching, bad input."""

from __future__ import annotations

import asyncio

import pytest
import torch

from grains.serving import ModelGrain, Predictor, ServeSpec, deploy
from grains.serving.errors import BadInputError, ModelNotFoundError, RequestTooLargeError
from tests.grains.serving.conftest import GRAINS, train_digits


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
