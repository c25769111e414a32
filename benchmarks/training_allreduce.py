"""The training benchmark's all-reduce parts: torchrun + DDP rows and recovery from SIGKILL.

Used by ``bench_training``. The baseline is torchrun (``--standalone
--nproc-per-node 2 --max-restarts 1``, its default 0.1 s monitor interval)
running ``benchmarks/ddp_worker.py``: DDP over gloo on the same model, data
and batch schedule as a redgrain job. Recovery is measured the same way for
both: SIGKILL one worker's process (torchrun) or one trainer's silo (redgrain)
mid-run, then the wall time from the kill to the next committed step. torchrun
restarts every worker and resumes from the last checkpoint; redgrain re-forms
the group with the survivor, which holds the newest state.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import FIXED_THREADS, REPO, BenchCluster
from benchmarks.training_recovery import kill_and_measure

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"


def _torchrun() -> list[str]:
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _read_events(path: Path) -> tuple[list[tuple[int, float, int]], float | None, float | None]:
    steps: list[tuple[int, float, int]] = []
    done_at = accuracy = None
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 3:
                continue  # a line being written
            if parts[0] == "done":
                done_at, accuracy = float(parts[1]), float(parts[2])
            else:
                steps.append((int(parts[0]), float(parts[1]), int(parts[2])))
    return steps, done_at, accuracy


def torchrun_ddp(
    spec: dict[str, Any],
    *,
    kill_at_step: int | None = None,
    ckpt_every: int = 0,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run torchrun with 2 DDP workers; with ``kill_at_step``, SIGKILL rank 1 once rank 0 passed it."""
    return torchrun_ddp_phases([{"spec": spec, "kill_at_step": kill_at_step, "ckpt_every": ckpt_every}], timeout_s)[0]


def torchrun_ddp_phases(phases: list[dict[str, Any]], timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Run several jobs in turn in one torchrun with 2 DDP workers (one start for all); each phase
    is ``{"spec", "kill_at_step" (optional), "ckpt_every" (optional)}``. A phase with
    ``kill_at_step`` has rank 1 SIGKILLed once rank 0 passed that step (at most one phase: torchrun
    restarts once); the restarted workers skip the phases done and resume that one from its
    checkpoint. One result per phase, as :func:`torchrun_ddp` gives."""
    tmp = Path(tempfile.mkdtemp(prefix="redgrain-ddp-"))
    pids = tmp / "pids"
    plan = [
        {"spec": p["spec"], "events": str(tmp / f"events-{i}.txt"), "ckpt": str(tmp / f"ckpt-{i}.pt"),
         "ckpt_every": int(p.get("ckpt_every") or 0)}
        for i, p in enumerate(phases)
    ]  # fmt: skip
    kills = [i for i, p in enumerate(phases) if p.get("kill_at_step") is not None]
    if len(kills) > 1:
        raise ValueError("torchrun restarts once here (--max-restarts 1): one phase may be killed")
    victim = kills[0] if kills else None
    cmd = [
        *_torchrun(), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(WORKER),
        "--phases", json.dumps(plan), "--pids", str(pids),
    ]  # fmt: skip
    env = {**os.environ, **FIXED_THREADS, "PYTHONPATH": str(REPO)}
    log = tmp / "torchrun.log"
    killed_at: float | None = None
    killed_step = 0
    read: list[tuple[list[tuple[int, float, int]], float | None, float | None]] = []
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(
                    f"torchrun did not finish in {timeout_s}s:\n{log.read_text()[-3000:]}"
                )
            if victim is not None and killed_at is None:
                steps, _, _ = _read_events(Path(plan[victim]["events"]))
                if steps and steps[-1][0] >= phases[victim]["kill_at_step"]:
                    os.kill(int((pids / "rank1").read_text()), signal.SIGKILL)
                    killed_at, killed_step = time.time(), steps[-1][0]
            time.sleep(0.01)  # another process's file: nothing to await
        failure = None
        if proc.returncode != 0:
            failure = f"torchrun exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            if victim is None:
                raise RuntimeError(failure)
            # After a kill, torchrun's restarted group can fail too (seen: a gloo "Connection
            # reset by peer" once its one restart was spent); the recovery it made is on record.
        read = [_read_events(Path(p["events"])) for p in plan]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = []
    for i, (phase, (steps, done_at, accuracy)) in enumerate(zip(phases, read)):
        if i != victim and done_at is None:
            # Only the killed phase may be cut short (by a failed restart, recorded as its error).
            raise RuntimeError(f"torchrun phase {i} did not finish: {failure or 'no done line'}")
        results.append(_phase_result(phase["spec"], steps, accuracy))
        if i == victim:
            if failure is not None:
                results[-1]["error"] = failure.splitlines()[0]
            if killed_at is not None:
                after = [s for s in steps if s[2] >= 1]
                results[-1]["recovery_s"] = after[0][1] - killed_at if after else None
                results[-1]["lost_steps"] = killed_step + 1 - after[0][0] if after else None
    return results


def _phase_result(spec: dict[str, Any], steps: list[tuple[int, float, int]], accuracy: float | None) -> dict[str, Any]:
    """Samples/s and ms/step of the first attempt, from 20% of the steps on."""
    first = [s for s in steps if s[2] == 0]
    total = spec["steps"]
    warm = max(1, total // 5)
    out: dict[str, Any] = {"accuracy": accuracy, "bytes_per_step": 0}
    timed = [s for s in first if s[0] >= warm]
    if len(timed) > 1:
        span = timed[-1][1] - timed[0][1]
        out["samples_per_s"] = (len(timed) - 1) * spec["batch_size"] * 2 / span
        out["step_ms"] = 1000 * span / (len(timed) - 1)
    else:
        out["samples_per_s"], out["step_ms"] = 0.0, 0.0
    return out


async def redgrain_recovery(
    client: Any, bc: BenchCluster, spec: dict[str, Any], kill_at_step: int
) -> dict[str, Any]:
    """An allreduce job on the cluster's 2 silos; SIGKILL the silo hosting only a trainer mid-run;
    time from the kill to the next committed step. The cluster is down a silo afterwards."""
    from grains.training import CoordinatorGrain, TrainingJob
    from grains.training.strategies.cluster import key_on

    await client.refresh()
    rows = sorted(client.view.hosting("CoordinatorGrain"), key=lambda r: r.address)
    if len(rows) != 2:
        raise RuntimeError(f"recovery needs 2 live silos, the view has {rows}")
    keeper = next(s for s in bc.silos if str(s.address) == rows[0].address)
    victim = next(s for s in bc.silos if s is not keeper and s.alive())
    coord = client.get_grain(
        CoordinatorGrain, key_on("CoordinatorGrain", "recovery", rows[0].silo, rows)
    )
    await coord.start(TrainingJob(**spec))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 300
    while True:
        st = await coord.status()
        if st.status == "running" and st.step >= kill_at_step and st.trainers == 2:
            break
        if st.status not in ("running", "starting") or loop.time() > deadline:
            raise RuntimeError(f"job did not reach step {kill_at_step} with 2 trainers: {st}")
        await asyncio.sleep(0.01)
    return await kill_and_measure(coord, victim, st, deadline)
