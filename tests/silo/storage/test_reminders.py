"""Durable reminders: fire as turns, activate the grain, survive the silo that hosted it."""

from __future__ import annotations

import asyncio
import time

import pytest

from grains.base import DeactivationReason
from grains.ids import GrainId
from silo.client import ClusterClient
from silo.settings import RemindersSettings
from tests.sample_grains import Reminded


@pytest.fixture
def redis_url(backend_url: str) -> str:
    """Every test here runs on one Redis and on the 3-master Redis Cluster (silo processes too)."""
    return backend_url


async def _until(check, timeout_s: float = 15.0):  # type: ignore[no-untyped-def]
    """Poll ``check()`` (ticks happen in silos, there is nothing to await) until it returns truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_reminder_ticks_reach_a_deactivated_grain_and_stop_when_unregistered(
    cluster, client: ClusterClient
) -> None:
    (silo,) = await cluster(1, reminders=RemindersSettings(poll_interval_s=0.05))
    ref = client.get_grain(Reminded, "one")
    await ref.start(0.1)
    rows = await silo.reminders.list(GrainId("Reminded", "one"))
    assert [(r.name, r.period_s) for r in rows] == [("tick", 0.1)]
    await _until(lambda: _ticks_at_least(ref, 2))
    act = silo.catalog.get(GrainId("Reminded", "one"))
    assert act is not None
    before = silo.catalog.statistics().activated_total
    await silo.catalog.deactivate(act, DeactivationReason.REQUESTED)
    await _until(lambda: _activated_again(silo, before))  # the next tick re-activates it
    await ref.stop()
    assert await silo.reminders.list() == []
    stats = silo.reminders.statistics()
    assert stats.delivered >= 3 and stats.failed == 0


async def _ticks_at_least(ref, n: int) -> bool:  # type: ignore[no-untyped-def]
    return (await ref.ticks())[0] >= n


async def _activated_again(silo, before: int) -> bool:  # type: ignore[no-untyped-def]
    return silo.catalog.statistics().activated_total > before


async def test_reminder_keeps_firing_after_its_hosting_silo_is_killed(
    silo_processes, redis_url: str, cluster_name: str
) -> None:
    procs = silo_processes(2, env={"REDGRAIN_REMINDERS__POLL_INTERVAL_S": "0.1"})
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as client:
        ref = client.get_grain(Reminded, "durable")
        await ref.start(0.3)
        await _until(lambda: _ticks_at_least(ref, 2))
        host = await ref.where()
        victim = next(p for p in procs if str(p.address) == host)
        survivor = next(p for p in procs if p is not victim)
        victim.kill()

        async def ticked_on_survivor() -> bool:
            try:
                _, silos = await ref.ticks()
            except Exception:  # noqa: BLE001 - the grain moves while its old silo is declared dead
                return False
            return silos[-1] == str(survivor.address)

        await _until(ticked_on_survivor, timeout_s=20)
        _, silos = await ref.ticks()
        assert set(silos) == {host, str(survivor.address)}
        await ref.stop()
