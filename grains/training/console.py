"""``redgrain train``: submit a job from a TOML file and watch it, or ask about / cancel one.

::

    redgrain train samples/digits.toml            # start, live progress bar, exit 0 when completed
    redgrain train --status digits               # one status table
    redgrain train --cancel digits
    redgrain train samples/digits.toml --save model.pt   # and write the trained state_dict
    redgrain train job.toml --save-best best.pt          # the best checkpoint's (keep_best)

It ends with one line saying what became of the job: completed, stopped early
at step N (with the best step), failed at step N with the cause, or cancelled.
Without a terminal (a CI log, a pipe) progress is a plain line per interval,
never cut to a width.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from silo import errors

_TERMINAL = ("completed", "failed", "cancelled")


def _job_id(args: argparse.Namespace, from_file: str | None) -> str:
    if args.job:
        return str(args.job)
    if from_file:
        return from_file
    return os.path.splitext(os.path.basename(args.job_file))[0]


async def run(args: argparse.Namespace, redis_url: str | None, cluster: str | None, settings: Any = None) -> int:
    from grains.training import CoordinatorGrain, load_job_file
    from silo.client import ClusterClient

    if not (args.job_file or args.status or args.cancel):
        raise errors.ConfigError("give a job file, --status JOB or --cancel JOB")
    spec = None
    job = args.status or args.cancel
    if args.job_file:
        file_id, spec = load_job_file(args.job_file)
        job = _job_id(args, file_id)
    assert job is not None
    async with await ClusterClient.connect(redis_url, cluster=cluster, settings=settings) as client:
        coord = client.get_grain(CoordinatorGrain, job)
        if args.cancel:
            _print_table(await coord.cancel())
            return 0
        if args.status:
            st = await coord.status()
            _print_table(st)
            print(outcome(st))
            if st.status == "completed":
                await _save(coord, args)
            return 0 if st.status != "failed" else 1
        assert spec is not None
        st = await coord.start(spec)
        if args.detach:
            _print_table(st)
            return 0
        st = await watch(coord, args.timeout)
        _print_table(st)
        print(outcome(st), flush=True)
        if st.status != "completed":
            return 1
        await _save(coord, args)
        return 0


def outcome(st: Any) -> str:
    """The line a run ends with: what became of the job, in words a log keeps whole."""
    at = f"step {st.step}/{st.total_steps}"
    if st.status == "failed":
        return f"job {st.job} failed at {at}: {st.error or 'no cause reported'}"
    if st.status == "cancelled":
        return f"job {st.job} cancelled at {at}"
    if st.status != "completed":
        return f"job {st.job} {st.status} at {at}"
    best = ""
    if st.best_step is not None:
        value = "" if st.best_value is None else f", {st.best_metric or 'metric'} {metric_text(st.best_metric, st.best_value)}"
        best = f" (best step {st.best_step}{value})"
    skipped = f"; {st.skipped} steps skipped" if st.skipped else ""
    if st.stopped_early:
        return f"job {st.job} stopped early at step {st.step}{best}: {st.stopped_early}{skipped}"
    return f"job {st.job} completed at {at}{best}{skipped}"


async def _save(coord: Any, args: argparse.Namespace) -> None:
    if getattr(args, "save", None):
        await save_model(coord, args.save)
    if getattr(args, "save_best", None):
        await save_model(coord, args.save_best, best=True)


async def save_model(coord: Any, path: str, *, best: bool = False) -> None:
    """Write the job's trained ``state_dict`` (``best``: its best checkpoint's) to ``path`` with
    ``torch.save`` (atomically)."""
    import torch

    sd = await coord.with_timeout(300.0).state_dict(best=best)
    if not sd:
        raise errors.ConfigError(f"job {coord.key} has no trained weights to save")
    tmp = f"{path}.partial"
    await asyncio.to_thread(torch.save, sd, tmp)
    os.replace(tmp, path)
    print(f"saved {len(sd)} tensors of {coord.key}{' (best checkpoint)' if best else ''} to {path}")


PLAIN_INTERVAL_S = 5.0
"""Without a terminal: the most often a progress line is written (and once when the job ends)."""


async def watch(coord: Any, timeout_s: float | None, *, interval_s: float = PLAIN_INTERVAL_S) -> Any:
    """A live progress bar until the job ends (Ctrl-C leaves the job running); without a
    terminal, a plain line per ``interval_s`` while the step moves."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    if not sys.stdout.isatty():
        return await _watch_plain(coord, deadline, timeout_s, interval_s)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, refresh_per_second=4) as bar:
        task = bar.add_task(coord.key, total=None, info="starting")
        while True:
            st = await coord.status()
            bar.update(task, completed=st.step, total=st.total_steps or None, info=_info(st))
            if st.status in _TERMINAL:
                return st
            if deadline is not None and loop.time() > deadline:
                raise errors.GrainTimeoutError(coord.key, "train", timeout_s or 0.0)
            await asyncio.sleep(0.25)


async def _watch_plain(coord: Any, deadline: float | None, timeout_s: float | None, interval_s: float) -> Any:
    """One whole line per interval (a CI log keeps it; rich cut it to 80 columns)."""
    loop = asyncio.get_running_loop()
    last_step, last_at = -1, 0.0
    while True:
        st = await coord.status()
        now = time.monotonic()
        if st.step != last_step and (now - last_at >= interval_s or st.status in _TERMINAL):
            print(f"{coord.key} step {st.step}/{st.total_steps or '?'} epoch {st.epoch:.2f}  {_info(st, markup=False)}", flush=True)
            last_step, last_at = st.step, now
        if st.status in _TERMINAL:
            return st
        if deadline is not None and loop.time() > deadline:
            raise errors.GrainTimeoutError(coord.key, "train", timeout_s or 0.0)
        await asyncio.sleep(0.25)


def metric_text(name: str, value: float) -> str:
    """One metric's value: a percentage for an accuracy (a name containing "acc", value in
    0..1), else 4 significant digits."""
    if "acc" in name.lower() and 0.0 <= value <= 1.0:
        return f"{value:.1%}"
    return f"{float(f'{value:.4g}'):g}"


def metrics_text(st: Any) -> str:
    """Training loss and metrics, then the latest evaluation's, each by name:
    ``loss 0.31 acc 91.0% | eval loss 0.28 accuracy 96.1%``."""
    train = [] if st.loss is None else [f"loss {metric_text('loss', st.loss)}"]
    train += [f"{k} {metric_text(k, v)}" for k, v in st.metrics.items()]
    evals = [f"{k} {metric_text(k, v)}" for k, v in st.eval_metrics.items()]
    parts = [" ".join(train)] if train else []
    if evals:
        parts.append("eval " + " ".join(evals))
    return " | ".join(parts)


def _info(st: Any, *, markup: bool = True) -> str:
    from rich.markup import escape  # metric names are the user's: "[x]" is not markup

    parts = [st.status]
    if text := metrics_text(st):
        parts.append(escape(text) if markup else text)
    parts.append(f"{st.samples_per_s:,.0f} samples/s")
    parts.append(f"{_size(st.bytes_per_step)}/step")
    if st.rollbacks or st.restarts:
        parts.append(f"restarts {st.restarts} rollbacks {st.rollbacks}")
    if st.skipped:
        parts.append(f"skipped {st.skipped}")
    return "  ".join(parts)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _print_table(st: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"job {st.job}", show_header=False)
    rows: list[tuple[str, str]] = [
        ("status", st.status + (f" ({st.error})" if st.error else "")),
        ("step", f"{st.step} / {st.total_steps}"),
        ("epoch", f"{st.epoch:.2f}"),
        ("train loss", "-" if st.loss is None else metric_text("loss", st.loss)),
        *((f"train {k}", metric_text(k, v)) for k, v in st.metrics.items()),
        *((f"eval {k}", metric_text(k, v)) for k, v in st.eval_metrics.items()),
    ]
    if st.eval_metrics and st.eval_step is not None:
        rows.append(("evaluated at", f"step {st.eval_step} (test split)"))
    if st.mode in ("async", "ssp"):
        rows.append(("max staleness", f"{st.max_staleness} steps"))
    if st.mode == "ssp":
        rows.append(("max gap", f"{st.max_gap} steps"))
    rows += [
        ("samples/s", f"{st.samples_per_s:,.0f}"),
        ("bytes/step", _size(st.bytes_per_step)),
        ("trainers / shards", f"{st.trainers} / {st.shards}"),
        ("checkpoints", ", ".join(map(str, st.checkpoints)) or "-"),
        ("restarts / rollbacks", f"{st.restarts} / {st.rollbacks}"),
        ("elapsed", f"{st.elapsed_s:.1f} s"),
    ]
    if st.changes:
        c = st.changes[-1]
        after = f"; first step {c.first_step_at - c.at:.2f} s after" if c.first_step_at else "; no step since"
        rows.append(("last recovery", f"from step {c.start_step}: {c.reason[:160]}{after}"))
    rows += [("warning", w[:200]) for w in st.warnings[-3:]]
    from rich.markup import escape

    for k, v in rows:
        table.add_row(escape(k), escape(v))
    Console().print(table)
