"""The ``redgrain`` command: silo, call, status, train, dashboard, demo.

Errors print as one clear line (exit code 1) unless ``--debug`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from silo import errors

log = logging.getLogger("redgrain.cli")

EXAMPLES = """\
examples:
  redgrain silo --redis redis://127.0.0.1:6379 --cluster dev --grains samples.hello
  redgrain silo --embedded-redis --grains samples.hello --port 11111
  redgrain call --redis redis://127.0.0.1:6379 --cluster dev Greeter alice hello '"bob"'
  redgrain status --redis redis://127.0.0.1:6379 --cluster dev
  redgrain demo --steps 200 --exit
"""


def run_async(main: Coroutine[Any, Any, Any]) -> Any:
    """Run on uvloop when it is installed (faster sockets), else plain asyncio."""
    try:
        import uvloop

        return uvloop.run(main)
    except ImportError:
        return asyncio.run(main)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", default=os.environ.get("REDGRAIN_REDIS_URL"), help="Redis URL (default: $REDGRAIN_REDIS_URL or redis://127.0.0.1:6379/0)")
    p.add_argument("--cluster", default=os.environ.get("REDGRAIN_CLUSTER"), help="cluster name (default: $REDGRAIN_CLUSTER or 'default')")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="redgrain",
        description="Orleans-style virtual actors for Python on Redis.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("silo", help="run a silo (e.g. redgrain silo --grains samples.hello)")
    _common(p)
    p.add_argument("--grains", required=True, help="comma-separated modules whose Grain classes this silo hosts")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--advertise-host", default=None, help="address peers should use, if not --host")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: a free one)")
    p.add_argument("--role", action="append", default=[], help="role label for @silo_role placement (repeatable)")
    p.add_argument("--device", default=None, help="auto, cpu or cuda")
    p.add_argument("--embedded-redis", action="store_true", help="start a private redis-server (data in ./.redgrain)")
    p.add_argument("--ready-file", default=None, help="write the silo address here once Active (for scripts)")
    p.add_argument("--dashboard", type=int, default=None, metavar="PORT", help="also serve the dashboard on PORT")

    p = sub.add_parser("call", help="call a grain method (redgrain call TYPE KEY METHOD [JSON_ARG ...])")
    _common(p)
    p.add_argument("type")
    p.add_argument("key")
    p.add_argument("method")
    p.add_argument("args", nargs="*", help="arguments as JSON")
    p.add_argument("--timeout", type=float, default=30.0)

    p = sub.add_parser("status", help="print members, their status, load and activations")
    _common(p)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    handlers: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] = {
        "silo": cmd_silo,
        "call": cmd_call,
        "status": cmd_status,
    }
    try:
        return int(run_async(handlers[args.command](args)) or 0)
    except KeyboardInterrupt:
        return 130
    except (errors.RedgrainError, OSError) as exc:
        if args.debug:
            raise
        print(f"redgrain: error: {exc}", file=sys.stderr)
        return 1


def _settings_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if args.redis:
        kw["redis_url"] = args.redis
    if args.cluster:
        kw["cluster"] = args.cluster
    return kw


async def cmd_silo(args: argparse.Namespace) -> int:
    from silo.settings import SiloSettings
    from silo.silo import Silo

    kw = _settings_kwargs(args)
    kw["grains"] = tuple(m.strip() for m in args.grains.split(",") if m.strip())
    for name in ("host", "advertise_host", "port", "device"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.role:
        kw["roles"] = tuple(args.role)
    embedded = None
    if args.embedded_redis:
        if args.redis:
            raise errors.ConfigError("--embedded-redis and --redis exclude each other")
        from silo.embedded import RedisServer

        embedded = RedisServer(data_dir=".redgrain", appendonly=True).start()
        kw["redis_url"] = embedded.url
        print(f"embedded Redis at {embedded.url}", flush=True)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from silo.transport import retain_freed_memory

    retain_freed_memory()
    silo = Silo(SiloSettings(**kw))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await silo.start()
        print(f"silo {silo.address} active; grains: {', '.join(silo.types.names())}", flush=True)
        if args.ready_file:
            with open(args.ready_file + ".tmp", "w") as f:
                f.write(str(silo.address))
            os.replace(args.ready_file + ".tmp", args.ready_file)
        waiter = asyncio.ensure_future(stop.wait())
        dead = asyncio.ensure_future(silo.stopped.wait())
        await asyncio.wait([waiter, dead], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        dead.cancel()
        if silo.status == "dead":
            print("silo was declared dead by the cluster; exiting", file=sys.stderr, flush=True)
            return 3
        await silo.stop(graceful=True)
        return 0
    finally:
        if embedded is not None:
            embedded.stop()


async def cmd_call(args: argparse.Namespace) -> int:
    from silo.client import ClusterClient

    kw = _settings_kwargs(args)
    values = []
    for a in args.args:
        try:
            values.append(json.loads(a))
        except json.JSONDecodeError as exc:
            raise errors.ConfigError(f"argument {a!r} is not JSON: {exc}") from exc
    async with await ClusterClient.connect(kw.get("redis_url"), cluster=kw.get("cluster")) as client:
        ref = client.get_grain(args.type, args.key)
        fn = getattr(ref, args.method, None)
        if fn is None:
            raise errors.UnknownMethodError(args.type, args.method)
        result = await ref.with_timeout(args.timeout).__getattribute__(args.method)(*values)
    print(json.dumps(result, default=str, indent=2))
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from silo.keys import Keys
    from silo.membership import RedisMembershipTable
    from silo.redis_util import connect_redis

    kw = _settings_kwargs(args)
    redis = connect_redis(kw.get("redis_url", "redis://127.0.0.1:6379/0"))
    try:
        version, rows = await RedisMembershipTable(redis, Keys(kw.get("cluster", "default"))).read_all()
    finally:
        await redis.aclose()
    table = Table(title=f"cluster {kw.get('cluster', 'default')} (membership version {version})")
    for col in ("silo", "status", "roles", "cpu %", "mem %", "activations", "grain types"):
        table.add_column(col)
    for row in sorted(rows.values(), key=lambda r: (r.status.value != "Active", r.address)):
        table.add_row(
            row.address,
            row.status.value,
            ",".join(row.roles),
            f"{row.load.cpu_percent:.0f}",
            f"{row.load.memory_percent:.1f}",
            str(row.load.activations),
            ",".join(row.grain_types),
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
