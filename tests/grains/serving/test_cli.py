"""``redgrain serve`` as its users run it: a weights file and its factory, served over V2 REST."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest
import torch

from grains.training.models import mlp
from tests.grains.serving.conftest import GRAINS
from tests.helpers import REPO, free_port


@pytest.mark.slow
async def test_redgrain_serve_answers_for_a_saved_state_dict(cluster, redis_url, cluster_name, tmp_path):
    await cluster(1, grains=GRAINS)
    torch.manual_seed(1)
    model = mlp().eval()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once; the test awaits its HTTP port, not the process
        [sys.executable, "-m", "grains.cli", "serve", "--redis", redis_url, "--cluster", cluster_name,
         "--model", "grains.training.models:mlp", "--weights", str(tmp_path / "m.pt"),
         "--input", "input:FP32:-1,64", "--name", "m", "--port", str(port)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        x = torch.rand(3, 64)
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 64], "data": x.flatten().tolist()}]}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while True:  # the process starts, deploys and binds its port
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                try:
                    if (await http.get("/v2/models/m/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert loop.time() < deadline
                await asyncio.sleep(0.2)
            r = await http.post("/v2/models/m/infer", json=body)
            assert r.status_code == 200, r.text
            out = r.json()["outputs"][0]
            with torch.inference_mode():
                want = model(x)
            assert out["shape"] == [3, 10]
            assert torch.allclose(torch.tensor(out["data"]).reshape(3, 10), want, atol=1e-5)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0, proc.stdout.read() if proc.stdout else ""


@pytest.mark.slow
async def test_serve_with_two_workers_answers_from_two_processes_and_sigterm_stops_both(
    cluster, redis_url, cluster_name, tmp_path
):
    import re

    import psutil

    await cluster(1, grains=GRAINS)
    torch.manual_seed(1)
    torch.save(mlp().state_dict(), tmp_path / "m.pt")
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once; the test awaits its HTTP port, not the process
        [sys.executable, "-m", "grains.cli", "serve", "--redis", redis_url, "--cluster", cluster_name,
         "--model", "grains.training.models:mlp", "--weights", str(tmp_path / "m.pt"),
         "--input", "input:FP32:-1,64", "--name", "m", "--port", str(port), "--workers", "2",
         "--grpc-port", str(grpc_port)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert "2 front processes" in line, line + (proc.stdout.read() if proc.poll() is not None else "")
        children = {c.pid for c in psutil.Process(proc.pid).children()}
        assert len(children) == 2
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.1] * 64}]}
        answered: set[int] = set()
        for _ in range(40):  # a new connection each: the kernel picks a worker per connection
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                assert (await http.post("/v2/models/m/infer", json=body)).status_code == 200
                metrics = (await http.get("/metrics")).text
            answered |= {int(p) for p in re.findall(r'redgrain_front_process\{pid="(\d+)"\}', metrics)}
            if len(answered) == 2:
                break
        assert answered == children
        # Each worker serves gRPC on the shared port as well (tritonclient's asyncio client: see
        # test_grpc.py for why not its synchronous one in this process).
        import numpy as np
        import tritonclient.grpc as tg
        import tritonclient.grpc.aio as tga

        async with tga.InferenceServerClient(f"127.0.0.1:{grpc_port}") as c:
            inp = tg.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(np.full((1, 64), 0.1, dtype=np.float32))
            assert (await c.infer("m", [inp])).as_numpy("output").shape == (1, 10)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0, proc.stdout.read() if proc.stdout else ""
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
