"""The Open Inference Protocol front, called by tritonclient (a V2 client nobody here wrote)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from grains.serving import ServeSpec, deploy
from grains.serving.http import create_app, make_server
from tests.grains.serving.conftest import GRAINS, classes_from_threads, train_digits
from tests.helpers import free_port


@pytest.fixture
async def front(client: Any) -> AsyncIterator[str]:
    """The front on a free port, on this test's loop; its address as host:port."""
    port = free_port()
    server = make_server(create_app(client), port=port)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), task
        await asyncio.sleep(0.02)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    await task


def triton(url: str) -> Any:
    import tritonclient.http as th

    return th.InferenceServerClient(url=url, connection_timeout=10, network_timeout=10)


def infer(url: str, x: np.ndarray, binary: bool = True) -> Any:
    import tritonclient.http as th

    c = triton(url)
    try:
        inp = th.InferInput("input", list(x.shape), "FP32" if x.dtype == np.float32 else "FP64")
        inp.set_data_from_numpy(x, binary_data=binary)
        return c.infer("digits", [inp], outputs=[th.InferRequestedOutput("output", binary_data=binary)])
    finally:
        c.close()


def metadata_and_ready(url: str) -> tuple[dict[str, Any], bool, bool, bool]:
    c = triton(url)
    try:
        return c.get_model_metadata("digits"), c.is_model_ready("digits"), c.is_server_ready(), c.is_server_live()
    finally:
        c.close()


async def test_tritonclient_reads_metadata_and_scores_the_test_split(cluster, client, front, digits_test):
    await cluster(1, grains=GRAINS)
    await train_digits(client)
    await deploy(client, "digits", ServeSpec(job="digits"))
    meta, model_ready, server_ready, live = await asyncio.to_thread(metadata_and_ready, front)
    assert (model_ready, server_ready, live) == (True, True, True)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]
    x, y = digits_test
    xs = x.numpy()
    # The test split in single-row requests from 8 threads, binary tensors (tritonclient's default).
    got = await classes_from_threads(lambda i: int(infer(front, xs[i : i + 1]).as_numpy("output").argmax(1)[0]), len(y))
    assert (got == y.numpy()).mean() >= 0.95
    # JSON tensors too, a whole batch in one request.
    whole = await asyncio.to_thread(infer, front, xs[:32], False)
    assert (whole.as_numpy("output").argmax(1) == got[:32]).all()

    import tritonclient.utils as tu

    with pytest.raises(tu.InferenceServerException) as bad:
        await asyncio.to_thread(infer, front, xs[:2, :60].copy())
    assert bad.value.status() == "400" and "expected [-1, 64]" in bad.value.message()
    with pytest.raises(tu.InferenceServerException) as wrong_type:
        await asyncio.to_thread(infer, front, xs[:2].astype(np.float64))
    assert wrong_type.value.status() == "400" and "expected FP32" in wrong_type.value.message()
    _, still_ready, _, _ = await asyncio.to_thread(metadata_and_ready, front)
    assert still_ready


async def test_statuses_for_unknown_model_oversized_request_and_bad_body(cluster, client, front):
    await cluster(1, grains=GRAINS)
    await train_digits(client, steps=10)
    await deploy(client, "digits", ServeSpec(job="digits", max_request_rows=8))
    async with httpx.AsyncClient(base_url=f"http://{front}") as http:
        assert (await http.get("/v2/health/live")).status_code == 200
        assert (await http.get("/v2")).json()["extensions"] == ["binary_tensor_data"]
        assert (await http.get("/v2/models/nope")).status_code == 404
        assert (await http.get("/v2/models/nope/ready")).status_code == 404
        row = {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}
        r = await http.post("/v2/models/nope/infer", json={"inputs": [row]})
        assert r.status_code == 404 and "nope" in r.json()["error"]
        nine = {**row, "shape": [9, 64], "data": [0.0] * 9 * 64}
        assert (await http.post("/v2/models/digits/infer", json={"inputs": [nine]})).status_code == 413
        assert (await http.post("/v2/models/digits/infer", content=b"{not json")).status_code == 400
        short = {**row, "data": [0.0] * 10}
        r = await http.post("/v2/models/digits/infer", json={"inputs": [short]})
        assert r.status_code == 400 and "10 values" in r.json()["error"]
        r = await http.post("/v2/models/digits/infer", json={"id": "a", "inputs": [row]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "a" and body["outputs"][0]["shape"] == [1, 10] and len(body["outputs"][0]["data"]) == 10
        metrics = (await http.get("/metrics")).text
        assert 'redgrain_inference_http_requests_total{code="413",model="digits"} 1.0' in metrics
        assert json.loads((await http.get("/v2/models/digits")).text)["name"] == "digits"


async def _deploy_saved_mlp(client: Any, path: Any) -> Any:
    import torch

    from grains.training.models import mlp

    torch.manual_seed(3)
    model = mlp().eval()
    torch.save(model.state_dict(), path)
    spec = ServeSpec(model="grains.training.models:mlp", weights=str(path), inputs=[{"name": "input", "shape": [-1, 64]}])
    await deploy(client, "digits", spec)
    return model


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status_line = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(status_line.split()[1]), headers, await reader.readexactly(int(headers["content-length"]))


async def test_pipelined_requests_on_one_connection_are_answered_in_order(cluster, client, front, tmp_path):
    import torch

    await cluster(1, grains=GRAINS)
    model = await _deploy_saved_mlp(client, tmp_path / "m.pt")
    xs = torch.rand(6, 64)
    wire = b""
    for k in range(6):  # every request written before any answer is read
        payload = json.dumps({"id": str(k), "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": xs[k].tolist()}]}).encode()  # fmt: skip
        wire += (f"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload  # fmt: skip
    host, port = front.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(wire)
        answers = [await _read_response(reader) for _ in range(6)]
        # The connection stays open for more (keep-alive): a malformed one gets its 400 on it.
        writer.write(b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n{")
        status, _, error = await _read_response(reader)
    finally:
        writer.close()
    with torch.inference_mode():
        want = model(xs)
    for k, (code, _, raw) in enumerate(answers):
        got = json.loads(raw)
        assert code == 200 and got["id"] == str(k)
        assert torch.allclose(torch.tensor(got["outputs"][0]["data"]), want[k], atol=1e-5)
    assert status == 400 and "not JSON" in json.loads(error)["error"]


async def test_infer_route_is_documented_and_answers_under_versions_too(cluster, client, front, tmp_path):
    await cluster(1, grains=GRAINS)
    await _deploy_saved_mlp(client, tmp_path / "m.pt")
    row = {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}
    async with httpx.AsyncClient(base_url=f"http://{front}") as http:
        schema = (await http.get("/openapi.json")).json()
        assert "/v2/models/{name}/infer" in schema["paths"]
        r = await http.post("/v2/models/digits/versions/1/infer", json={"inputs": [row]})
        assert r.status_code == 200 and r.json()["model_name"] == "digits"
        assert (await http.post("/v2/models/digits/infer", json={"inputs": [row], "id": 3})).status_code == 400
        assert (await http.post("/v2/models/digits/infer", content=b"{}",
                                headers={"Inference-Header-Content-Length": "x"})).status_code == 400  # fmt: skip
