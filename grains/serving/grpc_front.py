"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService``.

The gRPC twin of :mod:`grains.serving.http`, over the same
:class:`~grains.serving.front.Front`: both turn their wire's messages into
tensors and hand them to one predictor per model, so the two answer alike
(and ``redgrain serve --grpc-port`` runs both on one ``Front``). It runs on
:mod:`grains.serving.grpc_server`, on the asyncio loop of the cluster client
it calls through; a request costs one grain call, no thread hop.

The six RPCs every V2 server answers: ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata, ModelInfer (tensors: :mod:`grpc_codec`). A
failure is the call's status: :func:`~grains.serving.front.failure` gives
the HTTP front's status and its gRPC code (400 INVALID_ARGUMENT, 404
NOT_FOUND, 413 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED),
its message the details. A message over ``max_message_bytes`` (32 MiB; grpc's
own default is 4 MiB) is refused before it is parsed, RESOURCE_EXHAUSTED. A
connection may buffer one whole message, so this bound is also what one
hostile client can make the front hold (docs/security.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NoReturn

from grains.serving.front import EXTENSIONS, SERVER_NAME, Front, failure, server_version
from grains.serving.grpc_codec import decode_request, encode_response
from grains.serving.grpc_server import Abort, Call, GrpcServer, Method, Status
from grains.serving.proto import grpc_predict_v2_pb2 as pb
from grains.serving.settings import GrpcLimits, TlsSettings
from grains.serving.spec import TensorSpec

SERVICE = "inference.GRPCInferenceService"

MAX_MESSAGE_BYTES = GrpcLimits().max_message_bytes
GRACE_S = 5.0


def _abort(exc: Exception) -> NoReturn:
    f = failure(exc)
    if f is None:  # a bug, not the request's failure: the server answers UNKNOWN and logs it
        raise exc
    raise Abort(Status[f.grpc_code], f.message) from exc


def _tensors(specs: list[TensorSpec]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
    return [pb.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape) for s in specs]


class InferenceServicer:
    """The service's RPCs, answered by ``front``."""

    def __init__(self, front: Front) -> None:
        self.front = front

    def methods(self) -> dict[str, Method[Any, Any]]:
        """Each RPC by its path, as :class:`GrpcServer` takes them."""
        return {f"/{SERVICE}/{name}": Method(getattr(pb, f"{name}Request"), getattr(self, name))
                for name in ("ServerLive", "ServerReady", "ServerMetadata", "ModelReady", "ModelMetadata", "ModelInfer")}  # fmt: skip

    async def ServerLive(self, request: pb.ServerLiveRequest, call: Call) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, call: Call) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.front.serving())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, call: Call) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=server_version(), extensions=EXTENSIONS)

    async def ModelReady(self, request: pb.ModelReadyRequest, call: Call) -> pb.ModelReadyResponse:
        try:
            return pb.ModelReadyResponse(ready=await self.front.ready(request.name))
        except Exception as exc:  # noqa: BLE001 - _abort re-raises what failure() does not map
            _abort(exc)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, call: Call) -> pb.ModelMetadataResponse:
        try:
            info = await self.front.model_info(request.name)
        except Exception as exc:  # noqa: BLE001
            _abort(exc)
        return pb.ModelMetadataResponse(name=request.name, versions=[info.version], platform=info.platform,
                                        inputs=_tensors(info.inputs), outputs=_tensors(info.outputs))  # fmt: skip

    async def ModelInfer(self, request: pb.ModelInferRequest, call: Call) -> pb.ModelInferResponse:
        try:
            # The client's deadline, where it set one, bounds the grain call (a call past it is
            # cancelled on the replica too, not left to run for nobody).
            got = await self.front.infer(request.model_name, decode_request(request), call.time_remaining())
            return encode_response(request, got.version, got.outputs)
        except Exception as exc:  # noqa: BLE001
            _abort(exc)


def make_grpc_server(
    front: Front, *, max_message_bytes: int | None = None, limits: GrpcLimits | None = None,
    tls: TlsSettings | None = None,
) -> GrpcServer:  # fmt: skip
    """The service as a server, not yet listening (:meth:`GrpcServer.start` binds its port).

    ``max_message_bytes``: overrides ``limits.max_message_bytes``.
    ``tls``: served over TLS, ``h2`` negotiated by ALPN (as gRPC clients ask)."""
    limits = limits or GrpcLimits()
    if max_message_bytes is None:
        max_message_bytes = limits.max_message_bytes
    if limits.max_buffered_bytes < max_message_bytes + 5:  # room for one whole message, at least
        limits = limits.model_copy(update={"max_buffered_bytes": max_message_bytes + (8 << 20)})
    return GrpcServer(InferenceServicer(front).methods(), max_receive=max_message_bytes, max_send=max_message_bytes,
                      limits=limits, tls=tls.context(alpn=["h2"]) if tls is not None else None)  # fmt: skip


@asynccontextmanager
async def serve_grpc(
    front: Front, host: str = "127.0.0.1", port: int = 8001, *,
    max_message_bytes: int | None = None, grace_s: float = GRACE_S, reuse_port: bool = False,
    limits: GrpcLimits | None = None, tls: TlsSettings | None = None,
) -> AsyncIterator[int]:  # fmt: skip
    """The gRPC front serving while the block runs; yields its port (a free one when ``port`` is 0).

    ``reuse_port``: several processes listen on one port (``--workers``). On
    exit it stops gracefully: new calls are refused at once, calls under way
    get ``grace_s`` to finish, then are cancelled.
    """
    server = make_grpc_server(front, max_message_bytes=max_message_bytes, limits=limits, tls=tls)
    bound = await server.start(host, port, reuse_port=reuse_port)
    try:
        yield bound
    finally:
        await server.stop(grace_s)
