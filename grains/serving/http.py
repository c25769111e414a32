"""The Open Inference Protocol front: an ASGI app that turns V2 REST requests into predict calls.

The front is a client of the cluster (a :class:`~silo.client.ClusterClient`),
not a grain: it holds no model, so any number of fronts can run anywhere
(beside a load balancer, on each silo host) and scale apart from the
replicas; an HTTP request costs one grain call. It keeps one
:class:`~grains.serving.client.Predictor` per model, whose retries carry a
request over a replica lost mid-call.

Statuses: bad shape, datatype or body 400 (naming what is expected); unknown
model 404; more rows than the model takes, or a body over ``max_body_bytes``,
413; deployed but not loaded 503; past the request's deadline 504; the
cluster unreachable 503. Errors are ``{"error": "..."}``, as Triton answers.
``/metrics`` gives this front's HTTP counts and, from the replicas'
published records, each model's requests, errors, batch sizes and queue,
compute and total latency histograms (the dashboard's ``/metrics`` has the
latter too).

Infer requests go to :class:`~grains.serving.http_infer.InferRoute`, a bare
ASGI handler; FastAPI answers the rest (metadata, health, ``/metrics``, the
OpenAPI page at ``/docs``), where a few hundred microseconds a request do not
matter. ``make_server`` runs uvicorn with httptools and, with
``reuse_port``, on a ``SO_REUSEPORT`` socket that ``redgrain serve
--workers N`` shares between processes (:mod:`grains.serving.workers`).
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from grains.serving import oip
from grains.serving.front import EXTENSIONS, SERVER_NAME, Front, failure, server_version
from grains.serving.http_infer import InferRoute, Receive, Scope, Send, model_of
from grains.serving.model import ModelGrain
from grains.serving.records import ModelSummary, read_models
from grains.serving.settings import HttpLimits, TlsSettings
from silo import errors

MAX_BODY_BYTES = 64 << 20


class _FrontCollector(Collector):
    def __init__(self) -> None:
        self.http: dict[tuple[str, str], int] = {}
        self.models: list[ModelSummary] = []

    def collect(self) -> Iterator[Metric]:
        from dashboard.metrics import model_families

        fam = CounterMetricFamily("redgrain_inference_http_requests", "Inference requests this front answered, by HTTP status.",
                                  labels=["model", "code"])  # fmt: skip
        for (model, code), n in sorted(self.http.items()):
            fam.add_metric([model, code], n)
        yield fam
        # Which process answered: with --workers N, each front process has its own counts.
        info = GaugeMetricFamily("redgrain_front_process", "This front process (1), by pid.", labels=["pid"])
        info.add_metric([str(os.getpid())], 1)
        yield info
        yield from model_families(self.models)


class V2App:
    """The front's ASGI app: infer requests to ``infer``, everything else to the FastAPI ``api``."""

    def __init__(self, api: FastAPI, infer: InferRoute) -> None:
        self.api = api
        self.infer = infer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            model = model_of(scope["path"])
            if model is not None:
                await self.infer(scope, receive, send, model)
                return
        await self.api(scope, receive, send)


def create_app(
    client: Any = None,
    *,
    redis_url: str | None = None,
    cluster: str | None = None,
    client_settings: Any = None,
    grain: type[ModelGrain] = ModelGrain,
    timeout_s: float = 10.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    front: Front | None = None,
) -> V2App:
    """The app; with ``client`` None it connects its own ClusterClient on the server's loop.

    ``front``: one shared with another wire (``redgrain serve --grpc-port``); it then
    decides ``grain`` and ``timeout_s``.
    """
    collector = _FrontCollector()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    if front is None:
        front = Front(client, grain=grain, timeout_s=timeout_s)
    grain = front.grain
    route = InferRoute(front, collector.http, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if client is not None:
            app.state.client = client
            yield
            return
        from silo.client import ClusterClient

        own = await ClusterClient.connect(redis_url, cluster=cluster, settings=client_settings)
        app.state.client = front.client = own
        try:
            yield
        finally:
            await own.close()

    app = FastAPI(title="redgrain inference", version="1", lifespan=lifespan,
                  description="The Open Inference Protocol (KServe V2 REST) over redgrain's model grains.")  # fmt: skip

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    def answer(exc: Exception) -> JSONResponse:
        f = failure(exc)
        if f is None:
            raise exc
        return error(f.status, f.message)

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready", response_model=None)
    async def ready() -> dict[str, bool] | JSONResponse:
        if not front.serving():
            return JSONResponse({"ready": False, "error": f"no silo hosts {grain.__name__}"}, status_code=503)
        return {"ready": True}

    @app.get("/v2")
    async def server_metadata() -> oip.ServerMetadata:
        return oip.ServerMetadata(name=SERVER_NAME, version=server_version(), extensions=EXTENSIONS)

    @app.get("/v2/models/{name}", response_model=None)
    @app.get("/v2/models/{name}/versions/{version}", response_model=None)
    async def model_metadata(name: str, version: str | None = None) -> oip.ModelMetadata | JSONResponse:
        try:
            info = await front.model_info(name)
        except Exception as exc:  # noqa: BLE001 - answer() re-raises what it does not map
            return answer(exc)
        def tensors(specs: Any) -> list[oip.MetadataTensor]:
            return [oip.MetadataTensor(name=s.name, datatype=s.datatype, shape=s.shape) for s in specs]
        return oip.ModelMetadata(name=name, versions=[info.version], platform=info.platform,
                                 inputs=tensors(info.inputs), outputs=tensors(info.outputs),
                                 parameters={"step": info.step, "max_batch_size": info.max_batch_size,
                                             "max_request_rows": info.max_request_rows})  # fmt: skip

    @app.get("/v2/models/{name}/ready", response_model=None)
    @app.get("/v2/models/{name}/versions/{version}/ready", response_model=None)
    async def model_ready(name: str, version: str | None = None) -> dict[str, Any] | JSONResponse:
        try:
            ok = await front.ready(name)
        except Exception as exc:  # noqa: BLE001
            return answer(exc)
        if not ok:
            return error(503, f"model {name} is not ready")
        return {"name": name, "ready": True}

    @app.post("/v2/models/{name}/infer", response_class=Response,
              openapi_extra={"requestBody": {"content": {oip.JSON_TYPE: {"schema": oip.InferenceRequest.model_json_schema()}}}})
    @app.post("/v2/models/{name}/versions/{version}/infer", response_class=Response, include_in_schema=False)
    async def infer(name: str, request: Request, version: str | None = None) -> Response:
        """Documents the route for /docs; V2App sends these requests to InferRoute before FastAPI."""
        sent: list[Any] = []

        async def keep(message: Any) -> None:
            sent.append(message)

        await route(request.scope, request.receive, keep, name)
        return Response(sent[1]["body"], status_code=sent[0]["status"], headers={k.decode(): v.decode() for k, v in sent[0]["headers"]})

    @app.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        c = request.app.state.client
        try:
            collector.models = await read_models(c.redis, c.keys.rendezvous("serving", 0), now=time.time())
        except errors.StorageError:
            collector.models = []
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return V2App(app, route)


def make_server(
    app: Any, host: str = "127.0.0.1", port: int = 8000, *, reuse_port: bool = False,
    limits: HttpLimits | None = None, tls: TlsSettings | None = None,
) -> Any:  # fmt: skip
    """A uvicorn server for ``app`` that leaves signals to its caller (``redgrain serve``, tests).

    httptools when installed (it parses a request in C; h11 is pure Python),
    each response sent in one write, read deadlines for a request's head and
    body and a connection cap (:mod:`grains.serving.http_protocol`, ``limits``),
    keep-alive for ``limits.keep_alive_s``; over TLS with ``tls`` (client
    certificates required when it names a CA). With
    ``reuse_port``, ``server.serve(sockets=[server.socket])`` runs it on a socket
    bound with ``SO_REUSEPORT``, which other processes bind too and the kernel
    spreads connections over.
    """
    import contextlib

    import uvicorn

    class _Server(uvicorn.Server):
        socket: socket.socket | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    from grains.serving.http_protocol import protocol_class

    limits = limits or HttpLimits()
    ssl_args: dict[str, Any] = {}
    if tls is not None:
        ssl_args = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)}
        if tls.ca_file is not None:
            ssl_args |= {"ssl_ca_certs": str(tls.ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            http=protocol_class(limits), proxy_headers=False, server_header=False,
                            timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float serves
                            **ssl_args)  # fmt: skip
    server = _Server(config)
    if reuse_port:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
        server.socket = sock
    return server
