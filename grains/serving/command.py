"""``redgrain serve``: deploy a model (a job's, or a weights file with its factory) and answer V2 REST (and gRPC).

::

    redgrain serve --redis redis://127.0.0.1:6379 --cluster dev --job digits --name digits --port 8000
    redgrain serve ... --job digits --name digits --port 8000 --grpc-port 8001   # gRPC too
    redgrain serve ... --model grains.training.models:mlp --weights digits.pt --input input:FP32:-1,64 --name digits

Without ``--job`` or ``--weights`` it deploys nothing and serves whatever is
deployed already (another front, or a Python ``deploy``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from typing import Any

from grains.serving.settings import FrontSettings, TlsSettings
from grains.serving.spec import ServeSpec, TensorSpec
from silo import errors


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=None, help="the model's name in /v2/models/NAME (default: the job id)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--job", default=None, help="serve this training job's weights (newer checkpoints swap in)")
    src.add_argument("--weights", default=None, help="a torch.save'd state_dict (with --model and --input)")
    p.add_argument("--model", default=None, help="model factory pkg.module:callable (with --weights)")
    p.add_argument("--model-args", default="{}", help="its keyword arguments as JSON")
    p.add_argument("--input", action="append", default=[], metavar="NAME:DATATYPE:SHAPE",
                   help="an input, e.g. input:FP32:-1,64 (repeat for several; default for a job: its rows)")  # fmt: skip
    p.add_argument("--preprocess", default=None, help="pkg.module:fn applied to each merged batch")
    p.add_argument("--postprocess", default=None, help="pkg.module:fn applied to each batch's outputs")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-delay-ms", type=float, default=0.0)
    p.add_argument("--max-request-rows", type=int, default=1024)
    p.add_argument("--role", default=None, help="place replicas only on silos with this role (gpu)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC port, beside HTTP (default 0: no gRPC front)")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline of one inference request, seconds")
    p.add_argument("--in-flight", type=int, default=None,
                   help="merged grain calls per model out at once from a front process (default: one per silo"
                        " hosting replicas)")  # fmt: skip
    p.add_argument("--workers", type=int, default=1,
                   help="front processes sharing the port (SO_REUSEPORT; each parses HTTP on a core of its own)")  # fmt: skip
    p.add_argument("--tls-cert", default=None, help="serve both fronts over TLS with this certificate chain (PEM)")
    p.add_argument("--tls-key", default=None, help="the certificate's private key (PEM), with --tls-cert")
    p.add_argument("--tls-ca", default=None,
                   help="require client certificates signed by this CA (PEM), with --tls-cert")  # fmt: skip


def front_settings(args: argparse.Namespace) -> FrontSettings:
    """The fronts' settings: limits from the environment (REDGRAIN_FRONT__...), TLS from the flags."""
    cert, key, ca = getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None)
    try:
        settings = FrontSettings()
        if cert is None and key is None and ca is None:
            return settings
        if cert is None or key is None:
            raise errors.ConfigError("--tls-cert and --tls-key go together (and --tls-ca needs both)")
        return settings.model_copy(update={"tls": TlsSettings(cert_file=cert, key_file=key, ca_file=ca)})
    except ValueError as exc:
        raise errors.ConfigError(f"bad front settings: {exc}") from None


_FIRST_LOAD_S = 120.0
"""How long ``serve --job`` waits for a replica's first load before serving anyway."""


def _inputs(texts: list[str]) -> list[TensorSpec] | None:
    out = []
    for t in texts:
        try:
            name, datatype, shape = t.split(":")
            out.append(TensorSpec.model_validate({"name": name, "datatype": datatype,
                                                  "shape": [int(d) for d in shape.split(",")]}))  # fmt: skip
        except ValueError as exc:
            raise errors.ConfigError(f"--input {t!r}: want NAME:DATATYPE:SHAPE such as input:FP32:-1,64 ({exc})") from None
    return out or None


def spec_from(args: argparse.Namespace) -> ServeSpec | None:
    if args.job is None and args.weights is None:
        return None
    try:
        return ServeSpec(
            job=args.job, weights=args.weights, model=args.model, model_args=json.loads(args.model_args),
            inputs=_inputs(args.input), preprocess=args.preprocess, postprocess=args.postprocess,
            max_batch_size=args.max_batch_size, max_delay_ms=args.max_delay_ms, max_request_rows=args.max_request_rows,
        )  # fmt: skip
    except ValueError as exc:
        raise errors.ConfigError(f"bad serve arguments: {exc}") from None


async def _servable(client: Any, grain: type[Any], name: str) -> None:
    """Stop at start, not at every request, when a job's model cannot be served as deployed
    (its inputs not readable from the job's data: the message names ``--input``). A job with
    no weights yet, or a replica slow to load, is not a reason to stop: the front serves once
    they come, and ``/ready`` says so meanwhile."""
    from grains.serving.errors import ModelUnservableError, from_remote

    try:
        await client.get_grain(grain, name).with_timeout(_FIRST_LOAD_S).refresh()
    except errors.RedgrainError as exc:
        got = from_remote(exc)
        if isinstance(got, ModelUnservableError):
            raise errors.ConfigError(str(got)) from None


async def run(args: argparse.Namespace, redis_url: str | None, cluster: str | None, settings: Any) -> int:
    from grains.serving.client import deploy, grain_for
    from grains.serving.front import Front
    from grains.serving.http import create_app, make_server
    from silo.client import ClusterClient

    spec = spec_from(args)
    if args.in_flight is not None and args.in_flight < 1:
        raise errors.ConfigError(f"--in-flight {args.in_flight}: at least 1")
    name = args.name or args.job
    if spec is not None and not name:
        raise errors.ConfigError("--name is needed with --weights")
    grain = grain_for(args.role)
    fronts_settings = front_settings(args)
    async with await ClusterClient.connect(redis_url, cluster=cluster, settings=settings) as client:
        if spec is not None:
            await deploy(client, name, spec)
            if spec.job is not None and not spec.inputs:
                await _servable(client, grain, name)
        if args.workers > 1:
            from grains.serving.workers import serve_workers

            return await serve_workers(args, redis_url, cluster, settings)
        front = Front(client, grain=grain, timeout_s=args.timeout, in_flight=args.in_flight)
        tls = fronts_settings.tls
        server = make_server(create_app(client, front=front), host=args.host, port=args.port,
                             limits=fronts_settings.http, tls=tls)  # fmt: skip
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        what = f"model {name}" if spec is not None else "the deployed models"
        async with contextlib.AsyncExitStack() as fronts:
            if args.grpc_port:  # stops (gracefully) when the HTTP server does: on SIGTERM
                from grains.serving.grpc_front import serve_grpc

                await fronts.enter_async_context(serve_grpc(front, args.host, args.grpc_port,
                                                            limits=fronts_settings.grpc, tls=tls))  # fmt: skip
                print(f"serving {what} (Open Inference Protocol, gRPC{' over TLS' if tls else ''}) at "
                      f"{args.host}:{args.grpc_port}", flush=True)  # fmt: skip
            scheme = "https" if tls else "http"
            print(f"serving {what} (Open Inference Protocol) at {scheme}://{args.host}:{args.port}/v2", flush=True)
            await server.serve()
    return 0
