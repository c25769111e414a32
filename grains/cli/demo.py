"""``redgrain demo``: a whole training cluster on one machine, with a silo killed half-way.

Starts an embedded Redis (append-only, in ./.redgrain/), N silo processes, the
dashboard, and a digits training job (2 trainers, 2 parameter shards); shows
live progress; half-way through SIGKILLs a silo that hosts a trainer and shows
the job carrying on; ends with the final accuracy and where the checkpoints
are. Ctrl-C or SIGTERM stops everything it started (silos, dashboard, Redis);
if the demo itself is SIGKILLed, its silos and Redis notice that their
launcher is gone and stop too (see ``silo/testing/local.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from grains.ids import GrainId
from silo.testing.embedded import free_port

console = Console()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--silos", type=int, default=3, help="silo processes to start (default 3)")
    p.add_argument("--steps", type=int, default=300, help="global training steps (default 300)")
    p.add_argument("--no-chaos", action="store_true", help="do not kill a silo half-way")
    p.add_argument("--keep-running", action="store_true", help="keep cluster and dashboard up after the job (Ctrl-C stops)")
    p.add_argument("--exit", action="store_true", help="exit as soon as the job ends (the default unless --keep-running)")
    p.add_argument("--dashboard-port", type=int, default=None, help="dashboard port (default: a free one)")
    p.add_argument("--data-dir", default=".redgrain", help="where the embedded Redis keeps its append-only file")


def run(args: argparse.Namespace) -> int:
    from dashboard.server import DashboardThread
    from silo.testing.local import LocalCluster

    if args.silos < 2:
        console.print("[red]the demo needs at least 2 silos (one is killed half-way)[/red]")
        return 2
    data_dir = Path(args.data_dir).resolve()
    console.print(f"[bold]redgrain demo[/bold]: starting an embedded Redis (data in {data_dir}) and {args.silos} silos …")
    cluster = LocalCluster(grains="grains.training", silos=args.silos, cluster="demo", data_dir=data_dir)
    dash = None
    # SIGTERM would end the process without running the cleanup below: make it a Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start()
        for s in cluster.silos:
            console.print(f"  silo {s.name}: {s.address}  (pid {s.proc.pid if s.proc else '?'})")
        port = args.dashboard_port or free_port()
        dash = DashboardThread(cluster.redis_url, cluster.cluster, port=port).start()
        console.print(f"  dashboard: [link={dash.url}]{dash.url}[/link]  (Redis at {cluster.redis_url})")
        ok = asyncio.run(_drive(cluster, args))
        if args.keep_running and not args.exit:
            console.print("cluster and dashboard keep running; press Ctrl-C to stop")
            while True:
                time.sleep(3600)
        return 0 if ok else 1
    except KeyboardInterrupt:
        console.print("\nstopping …")
        return 130
    finally:
        # The cleanup is bounded (each silo is killed if it lingers); a second signal
        # must not cut it short and leave the rest running.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if dash is not None:
                dash.stop()
            cluster.stop()
            console.print("stopped: silos, dashboard and Redis are gone")
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


async def _drive(cluster: Any, args: argparse.Namespace) -> bool:
    from grains.training import CoordinatorGrain, TrainingJob
    from grains.training.console import metric_text
    from silo.client import ClusterClient

    job_id = f"digits-{time.strftime('%Y%m%d-%H%M%S')}"
    spec = TrainingJob(
        model="grains.training.models:mlp",
        dataset="grains.training.datasets:digits",
        trainers=2,
        shards=2,
        steps=args.steps,
        batch_size=64,
        optimizer="adam",
        lr=0.01,
        mode="sync",
        checkpoint_every=max(10, args.steps // 10),
        eval_every=max(10, args.steps // 10),
    )
    async with await ClusterClient.connect(cluster.redis_url, cluster=cluster.cluster, types=[CoordinatorGrain]) as client:
        earlier = await client.redis.scard(client.keys.jobs)
        if earlier:
            console.print(f"  found {earlier} earlier job(s) and their checkpoints in this Redis")
        coord = client.get_grain(CoordinatorGrain, job_id)
        console.print(
            f"training job [bold]{job_id}[/bold]: MLP on 8×8 digits, {spec.trainers} trainers, "
            f"{spec.shards} parameter shards, {spec.mode} mode, Adam, {spec.steps} steps"
        )
        status = await coord.start(spec)
        killed: str | None = None
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed:>4.0f}/{task.total:.0f}"),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("training", total=max(1, status.total_steps or spec.steps or 1), metrics="")
            while True:
                status = await _status(coord)
                if status is not None:
                    progress.update(
                        task,
                        completed=status.step,
                        total=max(1, status.total_steps),
                        metrics=_metrics(status),
                    )
                    if status.status in ("completed", "failed", "cancelled"):
                        break
                    if (
                        not args.no_chaos
                        and killed is None
                        and status.total_steps
                        and status.step >= status.total_steps // 2
                    ):
                        killed = await _kill_a_trainer_silo(cluster, client, job_id, status, progress)
                await asyncio.sleep(0.25)
        final = status
        assert final is not None
        if final.status != "completed":
            console.print(f"[red]job ended {final.status}: {final.error}[/red]")
            return False
        evaluation = escape(", ".join(f"{k} {metric_text(k, v)}" for k, v in final.eval_metrics.items()) or "none")
        train_loss = "-" if final.loss is None else metric_text("loss", final.loss)
        console.print(
            f"[bold green]done[/bold green]: {final.step} steps, evaluation on the test split: "
            f"[bold]{evaluation}[/bold]; training loss {train_loss}, {final.samples_per_s:,.0f} samples/s, "
            f"{final.bytes_per_step / 1e3:,.1f} kB on the wire per step"
        )
        if killed:
            console.print(
                f"survived the SIGKILL of silo {killed} (trainer restarts: {final.restarts}, "
                f"checkpoint rollbacks: {final.rollbacks})"
            )
        ckpts = ", ".join(str(s) for s in final.checkpoints) or "none"
        console.print(
            f"checkpoints (steps {ckpts}) are in Redis under rg:{{{cluster.cluster}}}:ckpt:{job_id}…, "
            f"persisted in {Path(args.data_dir).resolve() / 'redis'}"
        )
        return True


async def _status(coord: Any) -> Any:
    from silo import errors

    try:
        return await coord.with_timeout(5).status()
    except (errors.SiloError, errors.GrainCallError, errors.StorageError) as exc:
        console.print(f"  [yellow](status call failed: {type(exc).__name__}; the cluster is recovering)[/yellow]")
        return None


def _metrics(status: Any) -> str:
    from grains.training.console import metrics_text

    text = metrics_text(status)
    parts = [escape(text)] if text else []
    parts.append(f"{status.samples_per_s:,.0f} samples/s")
    return "  ".join(parts)


async def _kill_a_trainer_silo(cluster: Any, client: Any, job_id: str, status: Any, progress: Any) -> str | None:
    """SIGKILL a silo that hosts a trainer but not the coordinator (the job must go on)."""
    entry = await client.directory.lookup(GrainId("CoordinatorGrain", job_id))
    coord_endpoint = entry.silo.endpoint if entry is not None else None
    trainer_endpoints = {s.rpartition("@")[0] if "@" in s else s for s in status.trainer_silos}
    candidates = [
        s
        for s in cluster.silos
        if s.alive() and s.address is not None and s.address.endpoint != coord_endpoint
    ]
    preferred = [s for s in candidates if s.address.endpoint in trainer_endpoints] or candidates
    if not preferred:
        return None
    victim = preferred[0]
    victim.kill()
    progress.console.print(
        f"[bold red]chaos[/bold red]: SIGKILL silo {victim.name} at {victim.address} (it hosted a trainer) "
        f"at step {status.step}; the cluster declares it dead and the job carries on …"
    )
    return str(victim.address)
