"""The gRPC front, called by tritonclient.grpc (a V2 client nobody here wrote) and by the generated stub."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from grains.serving import ServeSpec, deploy
from grains.serving.errors import BadInputError
from grains.serving.front import Front
from grains.serving.grpc_codec import decode_request, encode_response
from grains.serving.grpc_front import serve_grpc
from grains.serving.proto import grpc_predict_v2_pb2 as pb
from grains.serving.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from grains.training.models import mlp
from tests.grains.serving.conftest import GRAINS, train_digits
from tests.helpers import REPO, free_port


@pytest.fixture
async def front(client: Any) -> AsyncIterator[str]:
    """The gRPC front on a free port, on this test's loop; its address as host:port."""
    async with serve_grpc(Front(client), port=0) as port:
        yield f"127.0.0.1:{port}"


# tritonclient's asyncio client (tritonclient.grpc.aio), not its synchronous one: the synchronous
# client's channels, used from threads of the test process, left grpc state behind after which a
# later test's subprocesses (tests/netns, in the same pytest process) stalled past their timeout.
def triton(url: str) -> Any:
    import tritonclient.grpc.aio as tga

    return tga.InferenceServerClient(url=url)


async def infer(url: str, x: np.ndarray, outputs: list[str] | None = None, request_id: str = "") -> Any:
    import tritonclient.grpc as tg

    async with triton(url) as c:
        inp = tg.InferInput("input", list(x.shape), "FP32" if x.dtype == np.float32 else "FP64")
        inp.set_data_from_numpy(x)  # raw_input_contents, as tritonclient always sends
        wanted = None if outputs is None else [tg.InferRequestedOutput(n) for n in outputs]
        return await c.infer("digits", [inp], outputs=wanted, request_id=request_id, client_timeout=30)


async def metadata_and_ready(url: str) -> tuple[Any, Any, bool, bool, bool]:
    async with triton(url) as c:
        return (await c.get_model_metadata("digits"), await c.get_server_metadata(), await c.is_model_ready("digits"),
                await c.is_server_ready(), await c.is_server_live())  # fmt: skip


async def classes_from_tasks(url: str, xs: np.ndarray, clients: int = 8) -> np.ndarray:
    """Each row's predicted class, one row a request, ``clients`` requests in flight."""
    got = np.zeros(len(xs), dtype=np.int64)

    async def score(k: int) -> None:
        for i in range(k, len(xs), clients):
            got[i] = int((await infer(url, xs[i : i + 1])).as_numpy("output").argmax(1)[0])

    await asyncio.gather(*(score(k) for k in range(clients)))
    return got


async def test_tritonclient_grpc_reads_metadata_and_scores_the_test_split(cluster, client, front, digits_test):
    await cluster(1, grains=GRAINS)
    await train_digits(client)
    await deploy(client, "digits", ServeSpec(job="digits"))
    meta, server, model_ready, server_ready, live = await metadata_and_ready(front)
    assert (model_ready, server_ready, live) == (True, True, True)
    assert server.name == "redgrain" and list(server.extensions) == ["binary_tensor_data"]
    assert meta.name == "digits" and list(meta.versions) == ["digits step 150"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("input", "FP32", [-1, 64])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("output", "FP32", [-1, 10])]
    x, y = digits_test
    xs = x.numpy()
    # The test split in single-row requests, 8 in flight, raw tensors both ways.
    got = await classes_from_tasks(front, xs)
    assert (got == y.numpy()).mean() >= 0.95
    whole = await infer(front, xs[:32], ["output"], "req-7")
    answer = whole.get_response()
    assert (answer.id, answer.model_name, answer.model_version) == ("req-7", "digits", "digits step 150")
    assert [o.name for o in answer.outputs] == ["output"] and len(answer.raw_output_contents) == 1
    assert (whole.as_numpy("output").argmax(1) == got[:32]).all()

    import tritonclient.utils as tu

    with pytest.raises(tu.InferenceServerException) as bad:
        await infer(front, xs[:2, :60].copy())
    assert bad.value.status() == "StatusCode.INVALID_ARGUMENT" and "expected [-1, 64]" in bad.value.message()
    with pytest.raises(tu.InferenceServerException) as no_output:
        await infer(front, xs[:2], ["logits"])
    assert no_output.value.status() == "StatusCode.INVALID_ARGUMENT" and "'logits'" in no_output.value.message()
    with pytest.raises(tu.InferenceServerException) as missing:
        async with triton(front) as c:
            await c.get_model_metadata("nope")
    assert missing.value.status() == "StatusCode.NOT_FOUND" and "'nope'" in missing.value.message()


async def test_typed_contents_in_give_typed_contents_out_unless_raw_is_asked(cluster, client, front):
    await cluster(1, grains=GRAINS)
    await train_digits(client, steps=10)
    await deploy(client, "digits", ServeSpec(job="digits", max_request_rows=8))
    x = torch.rand(3, 64)
    req = pb.ModelInferRequest(model_name="digits", id="typed")
    req.inputs.add(name="input", datatype="FP32", shape=[3, 64]).contents.fp32_contents.extend(x.flatten().tolist())
    async with grpc.aio.insecure_channel(front) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        typed = await stub.ModelInfer(req)
        req.parameters["binary_data_output"].bool_param = True
        raw = await stub.ModelInfer(req)
        nine = pb.ModelInferRequest(model_name="digits", raw_input_contents=[torch.zeros(9, 64).numpy().tobytes()])
        nine.inputs.add(name="input", datatype="FP32", shape=[9, 64])
        with pytest.raises(grpc.aio.AioRpcError) as too_many:
            await stub.ModelInfer(nine)
        ready = await stub.ModelReady(pb.ModelReadyRequest(name="digits"))
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.ModelReady(pb.ModelReadyRequest(name="nope"))
    assert typed.id == "typed" and not typed.raw_output_contents
    (out,) = typed.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("output", "FP32", [3, 10])
    from_typed = torch.tensor(out.contents.fp32_contents).reshape(3, 10)
    from_raw = torch.frombuffer(bytearray(raw.raw_output_contents[0]), dtype=torch.float32).reshape(3, 10)
    assert not raw.outputs[0].contents.fp32_contents and torch.equal(from_typed, from_raw)
    assert too_many.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 8" in (too_many.value.details() or "")
    assert ready.ready and unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_message_over_the_limit_is_refused_before_it_reaches_a_model():
    # No cluster: gRPC refuses the message before the front sees it.
    async with serve_grpc(Front(None), port=0, max_message_bytes=1024) as port:
        req = pb.ModelInferRequest(model_name="digits", raw_input_contents=[bytes(4 * 512)])
        req.inputs.add(name="input", datatype="FP32", shape=[8, 64])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as big:
                await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req)
    assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# --- the codec alone -----------------------------------------------------------------------------


def test_half_precision_travels_raw_and_its_answer_is_raw_even_to_a_typed_request():
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    req = pb.ModelInferRequest(model_name="m", raw_input_contents=[x.view(torch.int16).numpy().tobytes()])
    req.inputs.add(name="x", datatype="BF16", shape=[2, 3])
    (got,) = decode_request(req).values()
    assert got.dtype == torch.bfloat16 and torch.equal(got, x)
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="x", datatype="FP16", shape=[1])
    with pytest.raises(BadInputError, match="only in raw_input_contents"):
        decode_request(typed)
    # Typed inputs ask for typed outputs, but an FP16 output has no typed field: the whole answer is raw.
    resp = encode_response(pb.ModelInferRequest(model_name="m"), "v1",
                           {"a": torch.tensor([1.5], dtype=torch.float16), "b": torch.tensor([2], dtype=torch.int64)})  # fmt: skip
    assert [o.datatype for o in resp.outputs] == ["FP16", "INT64"] and len(resp.raw_output_contents) == 2
    assert not resp.outputs[1].contents.int64_contents and resp.model_version == "v1"


def test_typed_contents_of_each_width_and_what_they_refuse():
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="i8", datatype="INT8", shape=[2]).contents.int_contents.extend([-3, 7])
    req.inputs.add(name="u8", datatype="UINT8", shape=[1, 2]).contents.uint_contents.extend([0, 255])
    req.inputs.add(name="b", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    got = decode_request(req)
    assert got["i8"].dtype == torch.int8 and got["i8"].tolist() == [-3, 7]
    assert got["u8"].dtype == torch.uint8 and got["u8"].tolist() == [[0, 255]]
    assert got["b"].tolist() == [True]
    resp = encode_response(req, "v", {"y": got["u8"]})
    assert list(resp.outputs[0].contents.uint_contents) == [0, 255] and not resp.raw_output_contents
    req.inputs[0].contents.int_contents[0] = 300
    with pytest.raises(BadInputError, match="is not INT8"):
        decode_request(req)
    short = pb.ModelInferRequest(model_name="m", raw_input_contents=[bytes(12)])
    short.inputs.add(name="x", datatype="FP32", shape=[2, 2])
    with pytest.raises(BadInputError, match="12 raw bytes for shape \\[2, 2\\] of FP32 \\(16 bytes\\)"):
        decode_request(short)
    both = pb.ModelInferRequest(model_name="m", raw_input_contents=[bytes(4)])
    both.inputs.add(name="x", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    with pytest.raises(BadInputError, match="one or the other"):
        decode_request(both)


def test_every_message_matches_tritonclients_definition_field_by_field():
    import tritonclient.grpc.service_pb2 as triton_pb

    def fields(d: Any) -> dict[str, tuple[int, int, str]]:
        out = {f.name: (f.number, f.type, f.message_type.full_name if f.message_type else "") for f in d.fields}
        for nested in d.nested_types:
            out.update({f"{nested.name}.{k}": v for k, v in fields(nested).items()})
        return out

    ours = pb.DESCRIPTOR.message_types_by_name
    assert len(ours) == 14
    for name, d in ours.items():
        assert fields(d) == fields(triton_pb.DESCRIPTOR.message_types_by_name[name]), name
    theirs = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        twin = theirs.methods_by_name[m.name]
        assert (m.full_name, m.input_type.full_name, m.output_type.full_name) == (
            twin.full_name, twin.input_type.full_name, twin.output_type.full_name)  # fmt: skip


# --- the command ---------------------------------------------------------------------------------


@pytest.mark.slow
async def test_redgrain_serve_answers_grpc_beside_http(cluster, redis_url, cluster_name, tmp_path):
    await cluster(1, grains=GRAINS)
    torch.manual_seed(1)
    model = mlp().eval()
    torch.save(model.state_dict(), tmp_path / "m.pt")
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once; the test awaits its gRPC port, not the process
        [sys.executable, "-m", "grains.cli", "serve", "--redis", redis_url, "--cluster", cluster_name,
         "--model", "grains.training.models:mlp", "--weights", str(tmp_path / "m.pt"),
         "--input", "input:FP32:-1,64", "--name", "m", "--port", str(port), "--grpc-port", str(grpc_port)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        x = torch.rand(3, 64)
        req = pb.ModelInferRequest(model_name="m", raw_input_contents=[x.numpy().tobytes()])
        req.inputs.add(name="input", datatype="FP32", shape=[3, 64])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while True:  # the process starts, deploys and binds its ports
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                try:
                    if (await stub.ModelReady(pb.ModelReadyRequest(name="m"), timeout=5)).ready:
                        break
                except grpc.aio.AioRpcError:
                    pass
                assert loop.time() < deadline
                await asyncio.sleep(0.2)
            resp = await stub.ModelInfer(req, timeout=30)
        got = torch.frombuffer(bytearray(resp.raw_output_contents[0]), dtype=torch.float32).reshape(3, 10)
        with torch.inference_mode():
            want = model(x)
        assert list(resp.outputs[0].shape) == [3, 10] and torch.allclose(got, want, atol=1e-5)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0, proc.stdout.read() if proc.stdout else ""
