"""A replica's silo SIGKILLed under load: requests in flight go to the other replica, none hangs."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from grains.serving import ServeSpec, deploy
from grains.serving.http import create_app, make_server
from tests.grains.serving.conftest import replicas, train_digits
from tests.helpers import free_port

DEADLINE_S = 5.0


@pytest.mark.slow
async def test_sigkill_of_a_replicas_silo_under_load_hangs_no_request(silo_processes, client, digits_test):
    procs = silo_processes(2, grains="grains.training,grains.serving")
    await client.refresh()
    await train_digits(client, steps=20)
    await deploy(client, "digits", ServeSpec(job="digits"))
    port = free_port()
    server = make_server(create_app(client, timeout_s=DEADLINE_S), port=port)
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    x, _ = digits_test
    rows = [{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": x[i].tolist()}]} for i in range(64)]
    statuses: list[int] = []
    slowest = [0.0]
    stop = asyncio.Event()

    async def caller(http: httpx.AsyncClient, k: int) -> None:
        i = k
        while not stop.is_set():
            t0 = time.monotonic()
            # The guard turns a hung request into a failure; the front's own deadline is DEADLINE_S.
            r = await asyncio.wait_for(http.post("/v2/models/digits/infer", json=rows[i % 64]), DEADLINE_S + 5)
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            statuses.append(r.status_code)
            i += 16

    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S + 10) as http:
            callers = [asyncio.ensure_future(caller(http, k)) for k in range(16)]
            # Both replicas up and answering (their published records say so), the victim's among them.
            while len(statuses) < 300 or {r.silo for r in await replicas(client)} != {str(p.address) for p in procs}:
                await asyncio.sleep(0.05)
            procs[1].kill()
            killed_at = len(statuses)
            while len(statuses) < killed_at + 500:  # the survivor carries on alone
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.gather(*callers)
    finally:
        server.should_exit = True
        await serving
    # Requests in flight on the killed silo were sent again to the survivor: none failed.
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    assert slowest[0] < DEADLINE_S + 5
    assert procs[0].alive()
