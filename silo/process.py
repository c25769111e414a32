"""One silo as a process: ``python -m silo --grains pkg.mod`` (and ``redgrain silo``).

Runs a silo until SIGTERM/SIGINT (graceful stop: activations handed off) or
until the cluster declares it dead (exit code 3 at once: a zombie may not
linger). ``--ready-file`` gets the silo's address once it is Active, which is
how launchers (``silo.testing.local.LocalCluster``) wait for it. The faces add
their own options (``redgrain silo --dashboard``) through ``on_active``.

``--parent-fd FD`` names the read end of a pipe whose write end only the
launcher holds: when it closes (the launcher exited, however: SIGKILL too)
the silo stops as on SIGTERM, and exits within ``ORPHAN_GRACE_S`` whatever
its stop does, so no silo outlives the script that started it. A pipe, not
``PR_SET_PDEATHSIG``: see ``silo/testing/reaper.py``. Whatever this process
started itself (an ``--embedded-redis`` server, the dashboard's server, the
loaders' forkserver) ends with it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from silo import errors

ORPHAN_GRACE_S = 30.0
"""Once its launcher is gone, a silo exits this long after it started stopping, done or not."""

OnActive = Callable[[Any], Awaitable[Callable[[], Awaitable[None]] | None]]
"""Called with the started Silo; may return an async cleanup run before the silo stops."""


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", default=os.environ.get("REDGRAIN_REDIS_URL"), help="Redis URL (default: $REDGRAIN_REDIS_URL or redis://127.0.0.1:6379/0)")
    p.add_argument("--cluster", default=os.environ.get("REDGRAIN_CLUSTER"), help="cluster name (default: $REDGRAIN_CLUSTER or 'default')")


def add_secret_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        metavar="PATH",
        help="read the cluster secret from PATH (safer than $REDGRAIN_CLUSTER_SECRET in a process list)",
    )


def add_silo_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    add_secret_argument(p)
    p.add_argument("--grains", required=True, help="comma-separated modules whose Grain classes this silo hosts")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--advertise-host", default=None, help="address peers should use, if not --host")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: a free one)")
    p.add_argument("--role", action="append", default=[], help="role label for @silo_role placement (repeatable)")
    p.add_argument("--device", default=None, help="auto, cpu or cuda")
    p.add_argument(
        "--incoming-filter", action="append", default=[], metavar="PKG.MOD:NAME",
        help="incoming call filter by import path, run around every call to this silo's grains"
        " (repeatable, in order; replaces $REDGRAIN_INCOMING_FILTERS)",
    )  # fmt: skip
    p.add_argument(
        "--outgoing-filter", action="append", default=[], metavar="PKG.MOD:NAME",
        help="outgoing call filter by import path, run on every call this silo's grains make"
        " (repeatable, in order; replaces $REDGRAIN_OUTGOING_FILTERS)",
    )  # fmt: skip
    p.add_argument("--embedded-redis", action="store_true", help="start a private redis-server (data in ./.redgrain)")
    p.add_argument("--ready-file", default=None, help="write the silo address here once Active (for scripts)")
    p.add_argument(
        "--parent-fd", type=int, default=None, metavar="FD",
        help="an inherited pipe's read end: stop (as on SIGTERM) when it closes, i.e. when the launcher is gone",
    )  # fmt: skip


def settings_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Redis URL, cluster and secret from the common options (what every command shares)."""
    kw: dict[str, Any] = {}
    if args.redis:
        kw["redis_url"] = args.redis
    if args.cluster:
        kw["cluster"] = args.cluster
    path = getattr(args, "cluster_secret_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise errors.ConfigError(f"cannot read --cluster-secret-file {path!r}: {exc}") from exc
        if not secret:
            raise errors.ConfigError(f"--cluster-secret-file {path!r} is empty")
        kw["cluster_secret"] = secret
    return kw


def run_async(main: Coroutine[Any, Any, Any]) -> Any:
    """Run on uvloop when it is installed (faster sockets), else plain asyncio."""
    try:
        import uvloop

        return uvloop.run(main)
    except ImportError:
        return asyncio.run(main)


async def run_silo(args: argparse.Namespace, *, on_active: OnActive | None = None) -> int:
    """Run one silo with the options of :func:`add_silo_arguments` until told to stop."""
    from silo.messaging.frame import retain_freed_memory
    from silo.settings import SiloSettings
    from silo.silo import Silo

    kw = settings_kwargs(args)
    kw["grains"] = tuple(m.strip() for m in args.grains.split(",") if m.strip())
    for name in ("host", "advertise_host", "port", "device"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.role:
        kw["roles"] = tuple(args.role)
    if args.incoming_filter:
        kw["incoming_filters"] = tuple(args.incoming_filter)
    if args.outgoing_filter:
        kw["outgoing_filters"] = tuple(args.outgoing_filter)
    embedded = None
    if args.embedded_redis:
        if args.redis:
            raise errors.ConfigError("--embedded-redis and --redis exclude each other")
        from silo.testing.embedded import RedisServer

        embedded = RedisServer(data_dir=".redgrain", appendonly=True).start()
        kw["redis_url"] = embedded.url
        print(f"embedded Redis at {embedded.url}", flush=True)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    retain_freed_memory()
    silo = Silo(SiloSettings(**kw))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.parent_fd is not None:
        watch_parent(loop, args.parent_fd, stop)
    try:
        await silo.start()
        # Everything imported so far (torch above all) lives as long as the
        # process: freezing it keeps the collector from rescanning it during
        # call bursts, which held the loop for hundreds of ms.
        gc.collect()
        gc.freeze()
        print(f"silo {silo.address} active; grains: {', '.join(silo.types.names())}", flush=True)
        cleanup = await on_active(silo) if on_active is not None else None
        if args.ready_file:
            # Written once at start-up, before any call is served: blocking is harmless.
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(str(silo.address))
            os.replace(tmp, args.ready_file)
        waiter = asyncio.ensure_future(stop.wait())
        dead = asyncio.ensure_future(silo.stopped.wait())
        await asyncio.wait([waiter, dead], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        dead.cancel()
        if cleanup is not None:
            await cleanup()
        if silo.declared_dead:
            print("silo was declared dead by the cluster; exiting", file=sys.stderr, flush=True)
            if embedded is not None:
                embedded.stop()
            # A zombie must not linger: no waiting on tasks that may not end.
            sys.stdout.flush()
            os._exit(3)
        await silo.stop(graceful=True)
        return 0
    finally:
        if embedded is not None:
            embedded.stop()


def watch_parent(loop: asyncio.AbstractEventLoop, fd: int, stop: asyncio.Event) -> None:
    """Set ``stop`` when the pipe ``fd`` closes (the launcher is gone), and exit soon after regardless."""
    try:
        os.fstat(fd)
    except OSError:
        # Not inherited (a launcher prefix that closes descriptors): run unwatched rather than not at all.
        print(f"--parent-fd {fd} is not open; not watching the launcher", file=sys.stderr, flush=True)
        return

    def readable() -> None:
        try:
            data = os.read(fd, 64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return  # nothing is ever written; only the close matters
        loop.remove_reader(fd)
        os.close(fd)
        print("the process that started this silo is gone; stopping", file=sys.stderr, flush=True)
        stop.set()
        # A thread, not the loop: the stop may be what hangs.
        timer = threading.Timer(ORPHAN_GRACE_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    parser = argparse.ArgumentParser(prog="python -m silo", description="Run one redgrain silo.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    add_silo_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(run_async(run_silo(args)) or 0)
    except KeyboardInterrupt:
        return 130
    except (errors.RedgrainError, OSError) as exc:
        if args.debug:
            raise
        print(f"redgrain silo: error: {exc}", file=sys.stderr)
        return 1
