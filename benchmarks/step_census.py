"""What a training step costs in counts, not seconds (issue 38's fixed per-step cost).

``python -m benchmarks training --census``. Timing figures on a loaded
machine move with the load; counts do not. This runs one silo in this
process (plain asyncio, so the loop's callbacks are Python and can be
counted) on a private Redis, and runs the small MLP (digits, batch 64,
momentum SGD) as a 1-trainer, 1-shard sync job twice, ``steps`` and
``3 * steps`` steps long. Whatever a job costs once (placing, building the
model, the final checkpoint) is in both runs; the difference, divided by the
steps between them, is what each step costs. Per step:

- **Python calls** and **C calls**: profile events (``sys.setprofile`` on every
  thread: the loop's, the executor's), split by what the event loop was
  running when they happened: the task's name (the trainer's loop, the
  coordinator's ticks, a grain call's dispatch) or the callback's function;
- **loop callbacks**: handles the event loop ran (``Handle._run``);
- **executor jobs**: pieces of work handed to a thread and back (two thread
  wake-ups each);
- **Redis commands**, all of them and the history's ``XADD`` (``INFO
  commandstats``, everything this cluster sent: heartbeats too).

The coordinator ticks every 0.2 s, not every step: under the profiler a step
is several times slower than without it, so a tick's fixed part falls on
fewer steps here than in a real run; the tick count is printed beside, and
what a tick costs for each step it reports (a history point, an XADD)
counts in full. The plain loop (the same batches, torch's optimizer) is
counted the same way, for the floor.
"""

from __future__ import annotations

import asyncio
import collections
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from benchmarks.training_cost import SMALL

_HANDLE_RUN = asyncio.events.Handle._run.__code__
_DIGITS = re.compile(r"[0-9a-f]{6,}|\d+")
_JOB = re.compile(r"census-\w+")


class Census:
    """Counts profile events, each charged to what its thread was running at the time."""

    def __init__(self) -> None:
        self.py: collections.Counter[str] = collections.Counter()
        self.c: collections.Counter[str] = collections.Counter()
        self.functions: collections.Counter[str] = collections.Counter()
        """Python calls by (what they are charged to, function): where to look next."""
        self.callbacks = 0
        self.executor_jobs = 0
        self.executor_by: collections.Counter[str] = collections.Counter()
        """Executor jobs by the function each ran: the step path's own (none when it runs inline)
        apart from the clock-driven ones of the process, whose count a step grows with its time."""
        self._root: dict[int, tuple[FrameType, str]] = {}
        self._work_item: Any = None

    @contextmanager
    def counting(self) -> Iterator[Census]:
        from concurrent.futures import thread

        self._work_item = thread._WorkItem.run.__code__
        threading.setprofile(self._event)
        sys.setprofile(self._event)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        ident = threading.get_ident()
        root = self._root.get(ident)
        if event == "call":
            if root is None:
                label = self._label(frame)
                if label is not None:
                    self._root[ident] = root = (frame, label)
            label = root[1] if root else "(loop itself)"
            self.py[label] += 1
            self.functions[f"{label} | {frame.f_code.co_qualname}"] += 1
        elif event == "c_call":
            label = root[1] if root else "(loop itself)"
            self.c[label] += 1
            self.functions[f"{label} | C {getattr(arg, '__qualname__', '?')}"] += 1
        elif event == "return" and root is not None and frame is root[0]:
            del self._root[ident]

    def _label(self, frame: FrameType) -> str | None:
        """What a frame the loop (or a thread) called directly stands for; None: not such a frame."""
        code = frame.f_code
        if code is self._work_item:
            self.executor_jobs += 1
            fn = getattr(frame.f_locals.get("self"), "fn", None)
            fn = getattr(fn, "func", fn)  # functools.partial
            self.executor_by[str(getattr(fn, "__qualname__", fn))] += 1
            return f"executor: {getattr(fn, '__qualname__', fn)}"
        back = frame.f_back
        if back is None:
            return f"thread {threading.current_thread().name}: {code.co_qualname}"
        if back.f_code is not _HANDLE_RUN:
            return None
        self.callbacks += 1
        task = asyncio.current_task() if code.co_flags & 0x380 else None  # a coroutine resumed
        if task is not None:
            return "task " + _DIGITS.sub("N", _JOB.sub("JOB", task.get_name()))
        return "callback " + code.co_qualname

    def snapshot(self) -> dict[str, Any]:
        return {"py": collections.Counter(self.py), "c": collections.Counter(self.c),
                "functions": collections.Counter(self.functions), "callbacks": self.callbacks, "executor_jobs": self.executor_jobs,
                "executor_by": collections.Counter(self.executor_by)}  # fmt: skip


def _minus(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in a.items():
        out[k] = v - b[k] if isinstance(v, (int, float)) else collections.Counter({n: v[n] - b[k][n] for n in v})
    return out


def _commands(url: str) -> dict[str, int]:
    import redis

    with redis.Redis.from_url(url) as r:
        stats = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


async def _job(client: Any, name: str, steps: int, census: Census, url: str) -> dict[str, Any]:
    from grains.training import CoordinatorGrain, TrainingJob

    coord = client.get_grain(CoordinatorGrain, name)
    spec = TrainingJob(**{**SMALL, "steps": steps, "trainers": 1, "shards": 1})
    before, cmds, ticks = census.snapshot(), _commands(url), _TICKS[0]
    t0 = time.perf_counter()
    with census.counting():
        await coord.start(spec)
        while (st := await coord.status()).status not in ("completed", "failed", "cancelled"):
            await asyncio.sleep(0.1)
    wall = time.perf_counter() - t0
    if st.status != "completed":
        raise RuntimeError(f"census job {name} {st.status}: {st.error}")
    after = _commands(url)
    out = _minus(census.snapshot(), before)
    out["redis"] = {k: n - cmds.get(k, 0) for k, n in after.items() if n - cmds.get(k, 0)}
    out["ticks"], out["wall_s"], out["steps"] = _TICKS[0] - ticks, wall, steps
    return out


_TICKS = [0]


def _always_inline() -> None:
    """The MLP's step and update run on the loop after the first (inline.py), as on an idle
    machine; under the profiler they take longer than the budget, and whether a piece went
    to a thread would depend on the machine's load. Every budget, the shard's own (4 ms,
    passed explicitly) too: under load its update passed 4 ms now and then, and the next
    went to a thread (0.07 executor jobs a step)."""
    from grains.training.strategies.ps import inline

    init = inline.InlineWhenCheap.__init__

    def unbounded(self: Any, run_in_thread: Any, budget_s: float = inline.BUDGET_S) -> None:
        init(self, run_in_thread, float("inf"))

    inline.InlineWhenCheap.__init__ = unbounded  # type: ignore[method-assign]


def _count_ticks() -> None:
    """Count the coordinator's ticks (a sync job's driver)."""
    from grains.training.strategies.ps.driver import ParameterServerDriver

    tick: Callable[..., Any] = ParameterServerDriver.tick

    async def counted(self: Any) -> Any:
        _TICKS[0] += 1
        return await tick(self)

    ParameterServerDriver.tick = counted  # type: ignore[method-assign]


def _plain(steps: int, census: Census) -> dict[str, Any]:
    from benchmarks.bench_training import plain_loop

    before = census.snapshot()
    with census.counting():
        plain_loop({k: SMALL[k] for k in ("model", "dataset", "batch_size")}, steps)
    return {**_minus(census.snapshot(), before), "redis": {}, "ticks": 0, "wall_s": 0.0, "steps": steps}


def per_step(short: dict[str, Any], long: dict[str, Any]) -> dict[str, Any]:
    """(long - short) / the steps between them."""
    n = long["steps"] - short["steps"]
    fields = ("py", "c", "functions", "callbacks", "executor_jobs", "executor_by")
    d = _minus({k: long[k] for k in fields}, {k: short[k] for k in fields})
    redis = {k: (long["redis"].get(k, 0) - short["redis"].get(k, 0)) / n for k in long["redis"] | short["redis"]}
    return {
        "python_calls": sum(d["py"].values()) / n,
        "c_calls": sum(d["c"].values()) / n,
        "by_what": {k: (d["py"][k] + d["c"][k]) / n for k in d["py"] | d["c"]},
        "functions": {k: v / n for k, v in d["functions"].items() if v / n >= 0.5},
        "loop_callbacks": d["callbacks"] / n,
        "executor_jobs": d["executor_jobs"] / n,
        "executor_jobs_by": {k: v / n for k, v in d["executor_by"].items() if v},
        "redis_commands": sum(redis.values()),
        "redis": redis,
        "ticks": (long["ticks"] - short["ticks"]) / n,
        "step_ms_under_census": 1000 * (long["wall_s"] - short["wall_s"]) / n,
    }


async def _jobs(steps: int) -> dict[str, Any]:
    from silo.client import ClusterClient
    from silo.settings import SiloSettings
    from silo.silo import Silo
    from silo.testing.embedded import RedisServer

    census = Census()
    _count_ticks()
    _always_inline()
    with RedisServer() as server:
        silo = await Silo(SiloSettings(redis_url=server.url, cluster="census", grains=("grains.training",))).start()
        try:
            async with await ClusterClient.connect(server.url, cluster="census") as client:
                await _job(client, "census-warm", steps, census, server.url)  # imports, first activations
                short = await _job(client, "census-short", steps, census, server.url)
                long = await _job(client, "census-long", 3 * steps, census, server.url)
        finally:
            await silo.stop()
    return per_step(short, long)


def measure(steps: int = 200) -> dict[str, Any]:
    from benchmarks.common import fix_torch_threads

    fix_torch_threads()
    job = asyncio.run(_jobs(steps))  # plain asyncio: its callbacks are Python, so counted
    census = Census()
    _plain(steps, census)  # warm
    plain = per_step(_plain(steps, census), _plain(3 * steps, census))
    return {"job": job, "plain": plain}


def print_census(rows: dict[str, Any], top: int = 12) -> None:
    from benchmarks.common import print_table

    job, plain = rows["job"], rows["plain"]
    print("\n## per-step census, small MLP (digits, batch 64): 1 trainer, 1 shard, 1 silo, sync")
    keys = ["python_calls", "c_calls", "loop_callbacks", "executor_jobs", "redis_commands", "ticks"]
    print_table(["per step", "plain loop", "1 trainer", "difference"],
                [[k, f"{plain[k]:.1f}", f"{job[k]:.2f}", f"{job[k] - plain[k]:.2f}"] for k in keys])  # fmt: skip
    print(f"redis commands per step: {', '.join(f'{k} {v:.2f}' for k, v in sorted(job['redis'].items()) if v >= 0.005)}")
    if job["executor_jobs_by"]:
        print(f"executor jobs per step by function: {', '.join(f'{k} {v:.2f}' for k, v in sorted(job['executor_jobs_by'].items()))}")
    print(f"step under the census: {job['step_ms_under_census']:.2f} ms (profiled, not a timing figure)")
    by = sorted(job["by_what"].items(), key=lambda kv: -kv[1])[:top]
    print_table(["calls per step (python + C), charged to", "count"], [[k, f"{v:.1f}"] for k, v in by])


def main(quick: bool) -> dict[str, Any]:
    rows = measure(100 if quick else 300)
    print_census(rows)
    return rows
