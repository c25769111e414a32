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
from silo.process import (
    add_connection_arguments,
    add_secret_argument,
    add_silo_arguments,
    run_async,
    run_silo,
    settings_kwargs,
)

log = logging.getLogger("redgrain.cli")

EXAMPLES = """\
examples:
  redgrain silo --redis redis://127.0.0.1:6379 --cluster dev --grains samples.hello
  redgrain silo --embedded-redis --grains samples.hello --port 11111
  redgrain call --redis redis://127.0.0.1:6379 --cluster dev Greeter alice hello '"bob"'
  redgrain status --redis redis://127.0.0.1:6379 --cluster dev
  redgrain drain --redis redis://127.0.0.1:6379 --cluster dev 127.0.0.1:11111@3
  redgrain train samples/digits.toml --redis redis://127.0.0.1:6379 --cluster dev
  redgrain train --status digits --redis redis://127.0.0.1:6379 --cluster dev
  redgrain train samples/digits.toml --save digits.pt     # the trained model, for torch.load
  redgrain jobs --redis redis://127.0.0.1:6379 --cluster dev                      # list training jobs
  redgrain jobs forget digits --redis redis://127.0.0.1:6379 --cluster dev        # delete one from Redis
  redgrain dashboard --redis redis://127.0.0.1:6379 --cluster dev --port 8080
  redgrain serve --redis redis://127.0.0.1:6379 --cluster dev --job digits --name digits --port 8000
  redgrain demo --steps 200 --exit
"""


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
    add_silo_arguments(p)
    p.add_argument("--dashboard", type=int, default=None, metavar="PORT", help="also serve the dashboard on PORT")

    p = sub.add_parser("call", help="call a grain method (redgrain call TYPE KEY METHOD [JSON_ARG ...])")
    add_connection_arguments(p)
    add_secret_argument(p)
    p.add_argument("type")
    p.add_argument("key")
    p.add_argument("method")
    p.add_argument("args", nargs="*", help="arguments as JSON")
    p.add_argument("--timeout", type=float, default=30.0)

    p = sub.add_parser(
        "demo",
        help="a training cluster on this machine, a silo killed half-way (e.g. redgrain demo --steps 200 --exit)",
    )
    from grains.cli.demo import add_arguments

    add_arguments(p)

    p = sub.add_parser(
        "status", help="print members, their status, load and activations (redgrain status --cluster dev)"
    )
    add_connection_arguments(p)

    p = sub.add_parser(
        "drain", help="hand a silo's activations off and stop it (also: redgrain silo drain ADDRESS)"
    )
    add_connection_arguments(p)
    p.add_argument("address", help="silo address as `redgrain status` prints it (host:port@generation)")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait until it is Dead (0: do not wait)")

    p = sub.add_parser("train", help="run a training job with a live progress bar (redgrain train job.toml)")
    add_connection_arguments(p)
    add_secret_argument(p)
    # Defined here rather than next to grains.training.console's run(): importing that
    # package imports torch, which would add seconds to every `redgrain silo` start.
    p.add_argument("job_file", nargs="?", help="job spec (TOML: TrainingJob fields, plus an optional `job` id)")
    p.add_argument("--job", default=None, help="job id (default: the file's `job`, else its file name)")
    p.add_argument("--status", metavar="JOB", default=None, help="print a job's status and exit")
    p.add_argument("--cancel", metavar="JOB", default=None, help="cancel a running job")
    p.add_argument("--detach", action="store_true", help="start the job and exit without watching it")
    p.add_argument("--timeout", type=float, default=None, help="give up watching after this many seconds")
    p.add_argument(
        "--save", metavar="PATH", default=None,
        help="when the job completes, write the trained model's state_dict there (torch.save; load it with "
        "model.load_state_dict(torch.load(PATH, weights_only=True)), which loads tensors only); with --status, a finished job's",
    )  # fmt: skip
    p.add_argument(
        "--save-best", metavar="PATH", default=None,
        help="when the job ends (completed or stopped early), write the state_dict of its best checkpoint there "
        "(the job needs keep_best = 'eval.<metric>:max|min'); with --status, a finished job's",
    )  # fmt: skip

    p = sub.add_parser("jobs", help="list training jobs; `redgrain jobs forget JOB` deletes one from Redis")
    from grains.cli import jobs

    jobs.add_arguments(p)

    p = sub.add_parser("dashboard", help="serve the web dashboard (redgrain dashboard --port 8080)")
    add_connection_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    p.add_argument("--admin-token", default=os.environ.get("REDGRAIN_DASHBOARD_TOKEN"),
                   help="enable admin actions (drain, cancel) for requests bearing this token "
                        "(default: $REDGRAIN_DASHBOARD_TOKEN; none: read-only)")  # fmt: skip

    p = sub.add_parser("serve", help="serve a trained model over the Open Inference Protocol (redgrain serve --job JOB)")
    add_connection_arguments(p)
    add_secret_argument(p)
    from grains.serving.command import add_arguments as add_serve_arguments

    add_serve_arguments(p)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["silo", "drain"]:  # `redgrain silo drain ADDRESS` reads better; same command
        argv = argv[1:]
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        # The demo drives subprocesses and its own loops; it runs outside run_async.
        from grains.cli.demo import run as run_demo

        try:
            return run_demo(args)
        except (errors.RedgrainError, OSError) as exc:
            if args.debug:
                raise
            print(f"redgrain: error: {exc}", file=sys.stderr)
            return 1
    handlers: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] = {
        "silo": cmd_silo,
        "call": cmd_call,
        "status": cmd_status,
        "drain": cmd_drain,
        "dashboard": cmd_dashboard,
        "train": cmd_train,
        "jobs": cmd_jobs,
        "serve": cmd_serve,
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


async def cmd_silo(args: argparse.Namespace) -> int:
    async def with_dashboard(silo: Any) -> Callable[[], Coroutine[Any, Any, None]] | None:
        if args.dashboard is None:
            return None
        from dashboard.server import make_server, serve

        board = make_server(silo.settings.redis_url, silo.settings.cluster, port=args.dashboard)
        task = asyncio.ensure_future(serve(board))
        print(f"dashboard at http://127.0.0.1:{args.dashboard}/", flush=True)

        async def stop_board() -> None:
            board.should_exit = True
            await task

        return stop_board

    return await run_silo(args, on_active=with_dashboard)


async def cmd_call(args: argparse.Namespace) -> int:
    from silo.client import ClusterClient
    from silo.settings import ClientSettings

    kw = settings_kwargs(args)
    values = []
    for a in args.args:
        try:
            values.append(json.loads(a))
        except json.JSONDecodeError as exc:
            raise errors.ConfigError(f"argument {a!r} is not JSON: {exc}") from exc
    settings = ClientSettings(cluster_secret=kw["cluster_secret"]) if "cluster_secret" in kw else None
    async with await ClusterClient.connect(kw.get("redis_url"), cluster=kw.get("cluster"), settings=settings) as client:
        # A by-name reference looks a method it does not know up when called (the call raises
        # UnknownGrainError / UnknownMethodError); only names never remote are refused here.
        fn = getattr(client.get_grain(args.type, args.key).with_timeout(args.timeout), args.method, None)
        if fn is None:
            raise errors.UnknownMethodError(args.type, args.method)
        result = await fn(*values)
    print(json.dumps(result, default=str, indent=2))
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from silo.cluster.membership import RedisMembershipTable
    from silo.keys import Keys
    from silo.redis_url import redact
    from silo.redis_util import open_redis

    kw = settings_kwargs(args)
    url = kw.get("redis_url", "redis://127.0.0.1:6379/0")
    redis = await open_redis(url, f"connect to {redact(url)}")
    keys = Keys(kw.get("cluster", "default"))
    try:
        version, rows = await RedisMembershipTable(redis, keys).read_all()
        leader = await redis.get(keys.leader("rebalancer"))
    finally:
        await redis.aclose()
    leader_text = leader.decode() if isinstance(leader, bytes) else str(leader or "none")
    active = sum(r.status.value == "Active" for r in rows.values())
    title = (
        f"cluster {keys.cluster}: {active} active of {len(rows)} "
        f"(membership version {version}, rebalancer {leader_text})"
    )
    table = Table(title=title)
    for col in ("silo", "status", "heartbeat", "roles", "cpu %", "mem %", "activations", "grain types"):
        table.add_column(col)
    import time

    now = time.time()
    for row in sorted(rows.values(), key=lambda r: (r.status.value != "Active", r.address)):
        table.add_row(
            row.address,
            row.status.value,
            f"{now - row.heartbeat:.1f}s ago" if row.status.value != "Dead" else "-",
            ",".join(row.roles),
            f"{row.load.cpu_percent:.0f}",
            f"{row.load.memory_percent:.1f}",
            str(row.load.activations),
            ",".join(t if row.version_of(t) == 1 else f"{t}@{row.version_of(t)}" for t in row.grain_types),
        )
    Console().print(table)
    return 0


async def cmd_train(args: argparse.Namespace) -> int:
    from grains.training.console import run
    from silo.settings import ClientSettings

    kw = settings_kwargs(args)
    settings = ClientSettings(cluster_secret=kw["cluster_secret"]) if "cluster_secret" in kw else None
    return await run(args, kw.get("redis_url"), kw.get("cluster"), settings)


async def cmd_serve(args: argparse.Namespace) -> int:
    from grains.serving.command import run
    from silo.settings import ClientSettings

    kw = settings_kwargs(args)
    settings = ClientSettings(cluster_secret=kw["cluster_secret"]) if "cluster_secret" in kw else None
    return await run(args, kw.get("redis_url"), kw.get("cluster"), settings)


async def cmd_jobs(args: argparse.Namespace) -> int:
    from grains.cli import jobs

    return await jobs.run(args)


async def cmd_dashboard(args: argparse.Namespace) -> int:
    from dashboard.server import make_server, serve

    kw = settings_kwargs(args)
    url, cluster = kw.get("redis_url", "redis://127.0.0.1:6379/0"), kw.get("cluster", "default")
    server = make_server(url, cluster, host=args.host, port=args.port, admin_token=args.admin_token)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    mode = "admin actions enabled" if args.admin_token else "read-only"
    print(f"dashboard for cluster {cluster} at http://{args.host}:{args.port}/ ({mode})", flush=True)
    await serve(server)
    return 0


async def cmd_drain(args: argparse.Namespace) -> int:
    """Push a drain command to the silo's control list, then wait until it is Dead."""
    import time

    from grains.ids import SiloAddress
    from silo.cluster.membership import RedisMembershipTable
    from silo.keys import Keys
    from silo.records.control import request_drain
    from silo.records.membership import SiloStatus
    from silo.redis_url import redact
    from silo.redis_util import open_redis

    kw = settings_kwargs(args)
    keys = Keys(kw.get("cluster", "default"))
    try:
        address = str(SiloAddress.parse(args.address))
    except ValueError as exc:
        raise errors.ConfigError(str(exc)) from exc
    url = kw.get("redis_url", "redis://127.0.0.1:6379/0")
    redis = await open_redis(url, f"connect to {redact(url)}")
    try:
        table = RedisMembershipTable(redis, keys)
        _, rows = await table.read_all()
        row = rows.get(address)
        if row is None or row.status is SiloStatus.DEAD:
            raise errors.MembershipError(f"silo {address} is not a live member of cluster {keys.cluster}")
        await request_drain(redis, keys, address, by="redgrain drain")
        print(f"drain requested for {address}", flush=True)
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            _, rows = await table.read_all()
            if rows[address].status is SiloStatus.DEAD:
                print(f"{address} drained and stopped")
                return 0
            await asyncio.sleep(0.2)
        if args.wait:
            print(f"{address} still {rows[address].status.value} after {args.wait:.0f}s", file=sys.stderr)
            return 1
        return 0
    finally:
        await redis.aclose()


if __name__ == "__main__":
    sys.exit(main())
