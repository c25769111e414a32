"""The baseline of the over-the-wire rows: a no-op V2 endpoint on the same HTTP stack as the front.

``python -m benchmarks.noop_front --port 8001 [--grpc-port 8002]`` prints
``ready`` once bound. With ``--grpc-port``, a no-op ``GRPCInferenceService``
too (the front's gRPC server on the same loop, its generated messages):
ModelInfer returns a fixed raw answer, the gRPC stack's own cost for the gRPC rows.
A Starlette route that reads the body and returns a fixed answer (binary
when the request carries the binary header, as tritonclient's does; V2 JSON
otherwise), served by uvicorn as configured by default (httptools when installed,
uvloop): what the HTTP stack alone costs, so ``front / no-op`` is the share
of it the front keeps (issue 29's baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

HEADER = "Inference-Header-Content-Length"


def app(outputs: int = 10) -> Starlette:
    blob = bytes(4 * outputs)
    head = json.dumps({"model_name": "digits", "model_version": "1", "outputs": [
        {"name": "output", "datatype": "FP32", "shape": [1, outputs], "parameters": {"binary_data_size": len(blob)}}]}).encode()  # fmt: skip
    binary = head + blob
    plain = json.dumps({"model_name": "digits", "model_version": "1", "outputs": [
        {"name": "output", "datatype": "FP32", "shape": [1, outputs], "data": [0.0] * outputs}]}).encode()  # fmt: skip

    async def infer(request: Request) -> Response:
        await request.body()
        if HEADER in request.headers:
            return Response(binary, media_type="application/octet-stream", headers={HEADER: str(len(head))})
        return Response(plain, media_type="application/json")

    return Starlette(routes=[Route("/v2/models/{name}/infer", infer, methods=["POST"])])


def grpc_server(outputs: int = 10) -> object:
    from grains.serving.grpc_front import MAX_MESSAGE_BYTES, SERVICE
    from grains.serving.grpc_server import Call, GrpcServer, Method
    from grains.serving.proto import grpc_predict_v2_pb2 as pb

    answer = pb.ModelInferResponse(model_name="digits", model_version="1", raw_output_contents=[bytes(4 * outputs)],
                                   outputs=[pb.ModelInferResponse.InferOutputTensor(name="output", datatype="FP32",
                                                                                    shape=[1, outputs])])  # fmt: skip

    async def infer(request: pb.ModelInferRequest, call: Call) -> pb.ModelInferResponse:
        return answer

    methods = {f"/{SERVICE}/ModelInfer": Method(pb.ModelInferRequest, infer)}
    return GrpcServer(methods, max_receive=MAX_MESSAGE_BYTES, max_send=MAX_MESSAGE_BYTES)


async def serve(host: str, port: int, grpc_port: int = 0) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app(), host=host, port=port, log_level="warning", access_log=False))
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if grpc_port:
        g: Any = grpc_server()
        await g.start(host, grpc_port)
    print("ready", flush=True)
    await task


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, default=0)
    a = p.parse_args()
    from silo.process import run_async

    run_async(serve(a.host, a.port, a.grpc_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
