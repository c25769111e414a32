"""Helpers for training tests: run a job to its end on a cluster."""

from __future__ import annotations

import asyncio
from typing import Any

from grains.training import CoordinatorGrain, TrainingJob, TrainingStatus

GRAINS = ("grains.training",)


async def run_job(client: Any, job_id: str, spec: TrainingJob, timeout_s: float = 60.0) -> TrainingStatus:
    """Start a job and wait for a terminal status (polls: the job runs in other tasks/processes)."""
    coord = client.get_grain(CoordinatorGrain, job_id)
    await coord.start(spec)
    return await wait_done(coord, timeout_s)


async def wait_done(coord: Any, timeout_s: float = 60.0) -> TrainingStatus:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        st: TrainingStatus = await coord.status()
        if st.status in ("completed", "failed", "cancelled"):
            return st
        if loop.time() > deadline:
            raise TimeoutError(f"job not done after {timeout_s}s: {st}")
        await asyncio.sleep(0.1)


async def training_silos(client: Any, count: int, timeout_s: float = 30.0) -> list[Any]:
    """The client's view of the silos hosting training grains, sorted by address (as the
    coordinator sorts them), once it holds ``count`` of them (new silos joined, dead ones gone)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        await client.refresh()
        rows = sorted(client.view.hosting("CoordinatorGrain"), key=lambda r: r.address)
        if len(rows) == count:
            return rows
        assert loop.time() < deadline, rows
        await asyncio.sleep(0.05)


async def poll_status(coord: Any, pred: Any, timeout_s: float) -> TrainingStatus | None:
    """The first status ``pred`` accepts within ``timeout_s`` (None: none did); fails at once on a
    job that ended without one (the job runs in other tasks or processes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        st: TrainingStatus = await coord.status()
        if pred(st):
            return st
        assert st.status not in ("completed", "failed", "cancelled"), st
        if loop.time() >= deadline:
            return None
        await asyncio.sleep(0.05)


async def status_when(coord: Any, pred: Any, timeout_s: float = 60.0) -> TrainingStatus:
    """Poll until ``pred(status)``; fail early on a dead job, and after ``timeout_s``."""
    st = await poll_status(coord, pred, timeout_s)
    assert st is not None, f"condition not reached: {await coord.status()}"
    return st


async def grown_at_a_gate(coord: Any, done: Any, first: int, last: int, every: int, wait_s: float = 10.0) -> TrainingStatus:
    """Let trainers held at step ``first - every`` by :mod:`data_ids` (``limit``) on, ``every``
    steps a round, up to ``last``, until ``done(status)``: the job cannot end before a joining
    silo warmed up (a loaded host once grew a job at step 430 of 440). Each round waits
    ``wait_s``; the steps run past no other gate until the caller lifts the limit."""
    from tests.grains.training import data_ids

    for limit in range(first, last + 1, every):
        data_ids.control(limit=limit)
        st = await poll_status(coord, done, wait_s)
        if st is not None:
            return st
    raise AssertionError(f"not reached by step {last}: {await coord.status()}")
