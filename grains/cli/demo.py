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
import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from grains.ids import GrainId
from silo.shutdown import raise_if_cancelled
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
    stop = _HardStop(cluster)
    # SIGTERM would end the process without running the cleanup below: make it a Ctrl-C, as
    # SIGINT is; either also arms the hard stop, which bounds the whole cleanup.
    previous = signal.signal(signal.SIGTERM, stop.interrupt)
    signal.signal(signal.SIGINT, stop.interrupt)
    try:
        cluster.start()
        for s in cluster.silos:
            console.print(f"  silo {s.name}: {s.address}  (pid {s.proc.pid if s.proc else '?'})")
        port = args.dashboard_port or free_port()
        dash = DashboardThread(cluster.redis_url, cluster.cluster, port=port).start()
        console.print(f"  dashboard: [link={dash.url}]{dash.url}[/link]  (Redis at {cluster.redis_url})")
        try:
            ok = asyncio.run(_drive(cluster, args, stop))
        except asyncio.CancelledError:
            if not stop.armed:
                raise
            raise KeyboardInterrupt from None
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
                stop.stage = "stopping the dashboard"
                dash.stop()
            stop.stage = "stopping the silos and Redis"
            cluster.stop()
            stop.disarm()
            console.print("stopped: silos, dashboard and Redis are gone")
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, signal.default_int_handler)


HARD_STOP_S = 45.0
"""Longest the cleanup after Ctrl-C or SIGTERM may take before what is left is SIGKILLed.

The cleanup's own steps are bounded (dashboard 10 s, each silo's drain 15 s, then SIGKILL); this
also bounds the rest (the training client's cancellation, the event loop's shutdown)."""


class _HardStop:
    """What SIGINT and SIGTERM do: stop the demo, within :data:`HARD_STOP_S`.

    While the training client runs, a signal cancels its task (:meth:`cancel`, installed with
    ``loop.add_signal_handler``): the cancellation arrives at an await, so the client closes as
    it does on any error. Outside it (starting the cluster, ``--keep-running``) the signal
    raises KeyboardInterrupt (:meth:`interrupt`). A KeyboardInterrupt raised inside the event
    loop could land anywhere, between a lock's acquire and its ``with``, in the middle of a
    transport's bookkeeping, and leave the loop's shutdown waiting forever: seen once in about
    40 runs under load. Either way the first signal starts a timer. If the cleanup has not
    finished when it fires, every silo and Redis are SIGKILLed and the process exits, saying
    which step hung."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.stage = "ending the training client"
        self._timer: threading.Timer | None = None

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(HARD_STOP_S, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def interrupt(self, signum: int, frame: Any) -> None:
        self._arm()
        raise KeyboardInterrupt

    def cancel_task(self, task: asyncio.Task[Any]) -> None:
        self._arm()
        task.cancel()

    def install(self) -> None:
        """In the training client's task: a signal cancels it."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.cancel_task, task)

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)  # it restores the default: put ours back
            signal.signal(sig, self.interrupt)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        console.print(f"[red]cleanup still {self.stage} after {HARD_STOP_S:.0f} s: killing what is left[/red]")
        for silo in self.cluster.silos:
            with contextlib.suppress(Exception):
                silo.kill()
        if self.cluster.redis is not None:
            with contextlib.suppress(Exception):
                self.cluster.redis.kill()
        os._exit(130)


async def _drive(cluster: Any, args: argparse.Namespace, stop: _HardStop) -> bool:
    stop.install()
    try:
        return await _train(cluster, args)
    finally:
        stop.uninstall()


async def _train(cluster: Any, args: argparse.Namespace) -> bool:
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
                raise_if_cancelled()  # Ctrl-C during a poll: _status answers None for any error
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
                # Until the kill, look often: digits trains hundreds of steps a second here, so
                # at 4 looks a second the whole second half could pass between two of them.
                chaos_pending = not args.no_chaos and killed is None
                await asyncio.sleep(0.01 if chaos_pending else 0.25)
        final = status
        assert final is not None
        if not args.no_chaos and killed is None:
            console.print("[yellow]the job ended before the half-way SIGKILL could land (no silo was killed)[/yellow]")
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
