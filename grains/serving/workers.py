"""``redgrain serve --workers N``: N front processes answering on one port.

One Python process parses as many HTTP requests as one core allows. With
``--workers N`` the parent deploys the model once, then starts N children
(``python -m grains.serving.workers``), each with its own ``ClusterClient``
and uvicorn on a socket bound with ``SO_REUSEPORT`` to the same address; the
kernel spreads new connections over them (by the connection's address hash,
so a keep-alive connection stays with one worker). Each child's
``/metrics`` counts its own requests and names its pid
(``redgrain_front_process``).

The parent only watches: SIGTERM or SIGINT to it stops every child; a child
that exits stops the rest and the parent exits 1, rather than serving on at
a fraction of its capacity unseen. A child reads its settings as one JSON
line on stdin (the cluster secret stays off the command line) and stops when
its stdin closes, so children do not outlive a parent that was killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any

from grains.serving.command import front_settings
from grains.serving.settings import FrontSettings
from silo import errors


async def serve_workers(args: argparse.Namespace, redis_url: str | None, cluster: str | None, settings: Any) -> int:
    """Run ``args.workers`` front processes on ``args.host:args.port`` until SIGTERM; their exit code."""
    secret = getattr(settings, "cluster_secret", None)
    config = {"redis_url": redis_url, "cluster": cluster, "secret": secret.get_secret_value() if secret else None,
              "host": args.host, "port": args.port, "timeout": args.timeout, "role": args.role,
              "grpc_port": getattr(args, "grpc_port", 0), "in_flight": getattr(args, "in_flight", None),
              "front": front_settings(args).model_dump(mode="json")}  # fmt: skip
    children = []
    for _ in range(args.workers):
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "grains.serving.workers", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        assert p.stdin is not None
        p.stdin.write(json.dumps(config).encode() + b"\n")
        children.append(p)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for p in children:
            assert p.stdout is not None
            if (await p.stdout.readline()).strip() != b"ready":
                raise errors.ConfigError(f"a front worker exited before serving (exit {await p.wait()})")
        waits = [asyncio.ensure_future(p.wait()) for p in children]
        stopped = asyncio.ensure_future(stop.wait())
        print(f"{len(children)} front processes on port {args.port}: pids {' '.join(str(p.pid) for p in children)}", flush=True)
        done, _ = await asyncio.wait([*waits, stopped], return_when=asyncio.FIRST_COMPLETED)
        failed = stopped not in done
    finally:
        for p in children:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
        await asyncio.gather(*(p.wait() for p in children))
    return 1 if failed else 0


async def _child(config: dict[str, Any]) -> None:
    import contextlib

    from grains.serving.client import grain_for
    from grains.serving.front import Front
    from grains.serving.http import create_app, make_server
    from silo.settings import ClientSettings

    settings = ClientSettings(cluster_secret=config["secret"]) if config["secret"] else None
    fronts = FrontSettings.model_validate(config.get("front", {}))
    # One front for both wires; its client is connected by the HTTP app's lifespan.
    front = Front(grain=grain_for(config["role"]), timeout_s=config["timeout"], in_flight=config.get("in_flight"))
    server = make_server(create_app(redis_url=config["redis_url"], cluster=config["cluster"], client_settings=settings,
                                    front=front),
                         host=config["host"], port=config["port"], reuse_port=True, limits=fronts.http,
                         tls=fronts.tls)  # fmt: skip
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    # The parent holds our stdin: its end closing (the parent gone) stops this worker.
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    task = asyncio.ensure_future(server.serve(sockets=[server.socket]))
    while not server.started:
        if task.done():
            return await task  # type: ignore[no-any-return]
        await asyncio.sleep(0.02)
    async with contextlib.AsyncExitStack() as stack:
        if config.get("grpc_port"):
            # SO_REUSEPORT: every worker listens on the gRPC port too, as on the HTTP one.
            from grains.serving.grpc_front import serve_grpc

            await stack.enter_async_context(serve_grpc(front, config["host"], config["grpc_port"], reuse_port=True,
                                                       limits=fronts.grpc, tls=fronts.tls))  # fmt: skip
        print("ready", flush=True)
        eof = asyncio.ensure_future(reader.read())
        await asyncio.wait([task, eof], return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        eof.cancel()
        await task


def main() -> int:
    from silo.process import run_async

    config = json.loads(sys.stdin.readline())
    run_async(_child(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
