"""The training benchmarks' recovery rows: SIGKILL of a trainer's, a shard's or a pipeline stage's silo.

Used by ``bench_training`` (parameter server) and ``bench_pipeline`` (a stage:
:func:`pipeline_recovery`, the same figures, so ``bench_training`` can add it
as a row of its table). A sync job (2 trainers, 2 shards, checkpoints at
the job's interval) runs on 3 silos placed so that one silo hosts only a
trainer and another only a shard; one of them is SIGKILLed mid-run. Measured:
the wall time from the kill to the next committed step (the coordinator's
record of the recovery: when every restarted trainer committed its first
step), and the steps redone (a lost shard rolls every trainer back to the
last complete checkpoint; a lost trainer resumes where it stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

from benchmarks.common import BenchCluster
from silo import errors


async def wait_for_view(client: Any, bc: BenchCluster, timeout_s: float = 30.0) -> list[Any]:
    """The client's view of training silos once it matches the live processes (a killed
    silo declared dead, a new one joined); sorted by address, as the coordinator sorts."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    alive = {str(s.address) for s in bc.silos if s.alive()}
    while True:
        await client.refresh()
        rows = sorted(client.view.hosting("CoordinatorGrain"), key=lambda r: r.address)
        if {r.address for r in rows} == alive:
            return rows
        if loop.time() > deadline:
            raise RuntimeError(f"the membership view {rows} never matched the live silos {alive}")
        await asyncio.sleep(0.05)


async def ps_recovery(client: Any, bc: BenchCluster, spec: dict[str, Any], victim: str, kill_at_step: int) -> dict[str, Any]:
    """Kill the silo hosting only the ``victim`` ("trainer" or "shard") of a sync job on 3 silos.

    Trainers go on the first two silos (by address), shard i on silo i+1, and the
    coordinator on the middle one: the first silo then hosts only trainer 0, the
    last only shard 1. The cluster is one silo down afterwards.
    """
    from grains.training import CoordinatorGrain, TrainingJob
    from grains.training.strategies.cluster import key_on

    rows = await wait_for_view(client, bc)
    if len(rows) != 3:
        raise RuntimeError(f"parameter-server recovery needs 3 live silos, the view has {rows}")
    coord = client.get_grain(CoordinatorGrain, key_on("CoordinatorGrain", f"recovery-{victim}", rows[1].silo, rows))
    job = TrainingJob(**{**spec, "mode": "sync", "trainers": 2, "shards": 2})
    await coord.start(job)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 300
    while True:
        st = await coord.status()
        if st.status == "running" and st.step >= kill_at_step and st.checkpoints:
            break
        if st.status not in ("running", "starting") or loop.time() > deadline:
            raise RuntimeError(f"job did not reach step {kill_at_step}: {st}")
        await asyncio.sleep(0.01)
    busy = {"trainer": set(st.trainer_silos), "shard": set(st.shard_silos), "coordinator": {st.coordinator_silo}}
    alone = busy[victim] - set().union(*(v for k, v in busy.items() if k != victim))
    target = next((s for s in bc.silos if str(s.address) in alone and s.alive()), None)
    if target is None:
        raise RuntimeError(f"no silo hosts only a {victim}: {busy}")
    return await kill_and_measure(coord, target, st, deadline)


async def pipeline_recovery(client: Any, bc: BenchCluster, spec: dict[str, Any], kill_at_step: int) -> dict[str, Any]:
    """Kill the silo of one stage of a 2-stage pipeline job on 3 silos, mid-run.

    The stages go on two silos and the coordinator is asked for the third (by address); the
    victim is a stage silo that hosts neither the other stage nor the coordinator (stage 1's
    unless the coordinator landed there). The job rolls every stage back to its last committed
    checkpoint (the lost stage re-activates on a survivor) and replays from there;
    measured: the kill to the pipeline's next committed step, and the steps redone. The cluster is
    one silo down afterwards.
    """
    from grains.training import CoordinatorGrain, TrainingJob
    from grains.training.strategies.cluster import key_on

    rows = await wait_for_view(client, bc)
    if len(rows) != 3:
        raise RuntimeError(f"pipeline recovery needs 3 live silos, the view has {rows}")
    job = TrainingJob(**{**spec, "mode": "pipeline", "trainers": 1, "stages": 2, "shards": 1})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 300
    # The coordinator reads membership fresh before it places the stages, so they land on two silos.
    coord = client.get_grain(CoordinatorGrain, key_on("CoordinatorGrain", "recovery-stage", rows[2].silo, rows))
    await coord.start(job)
    while True:
        st = await coord.status()
        if st.status == "running" and len(st.trainer_silos) == 2:
            break
        if st.status not in ("running", "starting") or loop.time() > deadline:
            raise RuntimeError(f"job did not start: {st}")
        await asyncio.sleep(0.01)
    # The victim: a stage silo that is not the coordinator's (the coordinator's silo order is not by address).
    victim = next((s for s in reversed(st.trainer_silos) if s != st.coordinator_silo), None)
    if victim is None or st.trainer_silos[0] == st.trainer_silos[1]:
        raise RuntimeError(f"the stages were not placed on two silos apart from the coordinator: {st}")
    while True:
        st = await coord.status()
        if st.status == "running" and st.step >= kill_at_step and any(c > 0 for c in st.checkpoints):
            break
        if st.status not in ("running", "starting") or loop.time() > deadline:
            raise RuntimeError(f"job did not reach step {kill_at_step}: {st}")
        await asyncio.sleep(0.01)
    target = next((s for s in bc.silos if str(s.address) == victim and s.alive()), None)
    if target is None:
        raise RuntimeError(f"no live silo at {victim}")
    out = await kill_and_measure(coord, target, st, deadline)
    out["stage"] = st.trainer_silos.index(victim)
    return out


async def kill_and_measure(coord: Any, victim: Any, st: Any, deadline: float) -> dict[str, Any]:
    """SIGKILL ``victim`` (a BenchCluster silo) while the job runs at status ``st``, wait until
    the job ends (by ``deadline``, loop time), and read its record of the recovery."""
    loop = asyncio.get_running_loop()
    victim.send_signal(signal.SIGKILL)
    killed_at, killed_step = time.time(), st.step
    while st.status not in ("completed", "failed", "cancelled"):
        if loop.time() > deadline:
            raise RuntimeError(f"job did not finish: {st}")
        await asyncio.sleep(0.05)
        with contextlib.suppress(errors.RedgrainError):  # a call may fail while the dead silo is declared so
            st = await coord.with_timeout(5.0).status()
    if st.status != "completed":
        raise RuntimeError(f"job {st.status}: {st.error}")
    change = next((c for c in st.changes if c.at >= killed_at), None)
    if change is None or change.first_step_at is None:
        raise RuntimeError(f"the coordinator recorded no recovery after the kill: {st.changes}")
    return {
        "recovery_s": change.first_step_at - killed_at,
        "detected_s": change.at - killed_at,
        "lost_steps": max(0, killed_step - change.start_step),
        "accuracy": st.accuracy,
        "reason": change.reason[:200],
    }
