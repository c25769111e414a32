"""``redgrain jobs``: list the cluster's training jobs; ``redgrain jobs forget JOB`` deletes one.

Listing reads only the progress records coordinators publish (no torch import,
no cluster connection). Forgetting asks the job's coordinator grain, which
owns the job: it refuses while the job runs, then deletes the checkpoints of
every run, the records and its own state (``CoordinatorGrain.forget``). An
ended job is also forgotten on its own ``ttl_after_finished_s`` after it ended.
"""

from __future__ import annotations

import argparse
import time

from silo.process import add_connection_arguments, add_secret_argument, settings_kwargs


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    add_secret_argument(p)
    p.add_argument("action", nargs="?", choices=["list", "forget"], default="list")
    p.add_argument("job", nargs="?", help="the job id (for forget)")


async def run(args: argparse.Namespace) -> int:
    if args.action == "forget":
        if not args.job:
            raise SystemExit("usage: redgrain jobs forget JOB")
        return await _forget(args)
    return await _list(args)


async def _list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from grains.training.api.records import read_jobs
    from silo.keys import Keys
    from silo.redis_url import redact
    from silo.redis_util import open_redis

    kw = settings_kwargs(args)
    keys = Keys(kw.get("cluster", "default"))
    url = kw.get("redis_url", "redis://127.0.0.1:6379/0")
    redis = await open_redis(url, f"connect to {redact(url)}")
    try:
        jobs = await read_jobs(redis, keys)
    finally:
        await redis.aclose()
    table = Table(title=f"cluster {keys.cluster}: {len(jobs)} training job(s)")
    for col in ("job", "status", "mode", "step", "loss", "evaluation", "updated"):
        table.add_column(col)
    now = time.time()
    for j in jobs:
        evaluation = ", ".join(f"{k} {v:.4g}" for k, v in j.eval_metrics.items()) or "-"
        table.add_row(
            j.job, j.status, j.mode, f"{j.step}/{j.total_steps}" if j.total_steps else str(j.step),
            "-" if j.loss is None else f"{j.loss:.4g}", evaluation,
            f"{now - j.updated_at:.0f}s ago" if j.updated_at else "-",
        )  # fmt: skip
    Console().print(table)
    return 0


async def _forget(args: argparse.Namespace) -> int:
    from grains.training import CoordinatorGrain
    from silo.client import ClusterClient
    from silo.settings import ClientSettings

    kw = settings_kwargs(args)
    settings = ClientSettings(cluster_secret=kw["cluster_secret"]) if "cluster_secret" in kw else None
    async with await ClusterClient.connect(
        kw.get("redis_url"), cluster=kw.get("cluster"), settings=settings
    ) as client:
        coord = client.get_grain(CoordinatorGrain, args.job)
        await coord.with_timeout(120.0).forget()
    print(f"job {args.job} forgotten: its checkpoints, records and state are deleted")
    return 0
