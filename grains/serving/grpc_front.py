"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService`` on ``grpc.aio``.

The gRPC twin of :mod:`grains.serving.http`, over the same
:class:`~grains.serving.front.Front`: both turn their wire's messages into
tensors and hand them to one predictor per model, so the two answer alike
(and ``redgrain serve --grpc-port`` runs both on one ``Front``). It runs on
``grpc.aio`` so that it shares the asyncio loop of the cluster client it
calls through; a request costs one grain call, no thread hop.

The six RPCs every V2 server answers: ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata, ModelInfer (tensors: :mod:`grpc_codec`). A
failure is the call's status: :func:`~grains.serving.front.failure` gives
the HTTP front's status and its gRPC code (400 INVALID_ARGUMENT, 404
NOT_FOUND, 413 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED),
its message the details. A message over ``max_message_bytes`` (64 MiB, the
HTTP front's body limit) is refused by gRPC itself, RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NoReturn

import grpc
from grpc.aio import ServicerContext as _Context

from grains.serving.front import EXTENSIONS, SERVER_NAME, Front, failure, server_version
from grains.serving.grpc_codec import decode_request, encode_response
from grains.serving.proto import grpc_predict_v2_pb2 as pb
from grains.serving.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from grains.serving.spec import TensorSpec

MAX_MESSAGE_BYTES = 64 << 20
GRACE_S = 5.0


async def _abort(context: _Context, exc: Exception) -> NoReturn:
    f = failure(exc)
    if f is None:  # a bug, not the request's failure: gRPC answers UNKNOWN and logs it
        raise exc
    await context.abort(grpc.StatusCode[f.grpc_code], f.message)
    raise AssertionError("unreachable: abort raises")


def _tensors(specs: list[TensorSpec]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
    return [pb.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape) for s in specs]


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The service's RPCs, answered by ``front``."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def ServerLive(self, request: pb.ServerLiveRequest, context: _Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: _Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.front.serving())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: _Context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=server_version(), extensions=EXTENSIONS)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: _Context) -> pb.ModelReadyResponse:
        try:
            return pb.ModelReadyResponse(ready=await self.front.ready(request.name))
        except Exception as exc:  # noqa: BLE001 - _abort re-raises what failure() does not map
            await _abort(context, exc)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: _Context) -> pb.ModelMetadataResponse:
        try:
            info = await self.front.model_info(request.name)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
        return pb.ModelMetadataResponse(name=request.name, versions=[info.version], platform=info.platform,
                                        inputs=_tensors(info.inputs), outputs=_tensors(info.outputs))  # fmt: skip

    async def ModelInfer(self, request: pb.ModelInferRequest, context: _Context) -> pb.ModelInferResponse:
        try:
            # The client's deadline, where it set one, bounds the grain call (a call past it is
            # cancelled on the replica too, not left to run for nobody).
            got = await self.front.infer(request.model_name, decode_request(request), context.time_remaining())
            return encode_response(request, got.version, got.outputs)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)


def make_grpc_server(
    front: Front, host: str = "127.0.0.1", port: int = 8001, *, max_message_bytes: int = MAX_MESSAGE_BYTES
) -> tuple[grpc.aio.Server, int]:
    """The server (not started) and the port it bound: a free one when ``port`` is 0.

    Call it on the loop that will run the server (``grpc.aio`` takes the running loop).
    """
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", max_message_bytes)])  # fmt: skip
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(front), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    return server, bound


@asynccontextmanager
async def serve_grpc(
    front: Front, host: str = "127.0.0.1", port: int = 8001, *,
    max_message_bytes: int = MAX_MESSAGE_BYTES, grace_s: float = GRACE_S,
) -> AsyncIterator[int]:  # fmt: skip
    """The gRPC front serving while the block runs; yields its port.

    On exit it stops gracefully: new calls are refused at once, calls under
    way get ``grace_s`` to finish, then are cancelled.
    """
    server, bound = make_grpc_server(front, host, port, max_message_bytes=max_message_bytes)
    await server.start()
    try:
        yield bound
    finally:
        await server.stop(grace_s)
