"""A redeploy reaches a running replica whole: batching settings, poll period, and refresh() that waits."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import torch

from grains.serving import ModelGrain, ServeSpec, TensorSpec, deploy
from tests.grains.serving.conftest import GRAINS
from tests.grains.serving.models import GATES, MEETINGS

ROWS = [TensorSpec(name="input", shape=[-1, -1])]


def save_weights(path: Path, scale: float, mtime: float) -> None:
    torch.save({"scale": torch.tensor([scale])}, path)
    os.utime(path, (mtime, mtime))  # a newer file is a newer version: never the same second twice


async def test_a_redeploy_raising_max_concurrent_batches_lets_that_many_forward_passes_overlap(cluster, client, tmp_path):
    await cluster(1, grains=GRAINS)
    weights = tmp_path / "w.pt"
    save_weights(weights, 2.0, 1_000_000)
    spec = ServeSpec(model="tests.grains.serving.models:Meeting", model_args={"tag": "slots"}, weights=str(weights),
                     inputs=ROWS, max_batch_size=1, inline_below_ms=0, reload_poll_s=60)  # fmt: skip
    await deploy(client, "slots", spec)
    model = client.get_grain(ModelGrain, "slots")
    await model.metadata()  # the replica runs, one pass at a time
    await deploy(client, "slots", spec.model_copy(update={"max_concurrent_batches": 2}))
    await model.refresh()
    # Two one-row requests are two batches; each pass waits for the other (the silo has two
    # executor threads): they finish only if the replica now runs two passes at once.
    MEETINGS["slots"] = threading.Barrier(2, timeout=10)
    try:
        outs = await asyncio.gather(model.predict(torch.ones(1, 3)), model.predict(torch.ones(1, 4)))
    finally:
        MEETINGS.pop("slots").abort()
    assert [float(y) for y in outs] == [6.0, 8.0]


async def test_a_redeploy_changing_reload_poll_s_changes_how_soon_new_weights_are_served(cluster, client, tmp_path):
    await cluster(1, grains=GRAINS)
    weights = tmp_path / "w.pt"
    save_weights(weights, 2.0, 1_000_000)
    spec = ServeSpec(model="tests.grains.serving.models:RowSum", weights=str(weights), inputs=ROWS, reload_poll_s=600)
    await deploy(client, "poll", spec)
    model = client.get_grain(ModelGrain, "poll")
    x = torch.ones(1, 3)
    assert float(await model.predict(x)) == 6.0
    await deploy(client, "poll", spec.model_copy(update={"reload_poll_s": 0.05}))
    await model.refresh()  # the replica reads the new spec now rather than in 600 s
    save_weights(weights, 3.0, 1_000_010)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while float(await model.predict(x)) != 9.0:  # the replica's own poll finds the new file
        assert loop.time() < deadline, "the replica still polls every 600 s"
        await asyncio.sleep(0.05)



async def test_refresh_during_a_poll_answers_with_weights_at_least_as_new_as_the_call(cluster, client, tmp_path):
    await cluster(1, grains=GRAINS)
    weights = tmp_path / "w.pt"
    save_weights(weights, 2.0, 1_000_000)
    spec = ServeSpec(model="tests.grains.serving.models:held_rowsum", model_args={"tag": "refresh"},
                     weights=str(weights), inputs=ROWS, reload_poll_s=600)  # fmt: skip
    await deploy(client, "held", spec)
    model = client.get_grain(ModelGrain, "held")
    old = await model.metadata()
    entered, open_ = GATES["refresh"] = (threading.Event(), threading.Event())
    try:
        save_weights(weights, 3.0, 1_000_010)
        polling = asyncio.ensure_future(model.refresh())  # finds the new file; its load waits at the gate
        assert await asyncio.to_thread(entered.wait, 10)
        asked = asyncio.ensure_future(model.refresh())  # while that poll is in flight
        await model.ready()  # sent after `asked` to the same replica: `asked` has begun
        open_.set()
        polled, got = await polling, await asked
    finally:
        GATES.pop("refresh")[1].set()
    assert polled.version != old.version
    assert got.version == polled.version
    assert float(await model.predict(torch.ones(1, 3))) == 9.0
