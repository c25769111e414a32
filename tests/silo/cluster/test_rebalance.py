"""Rebalancing on join, drain by command, and SIGTERM under load without a failed call."""

from __future__ import annotations

import asyncio
import time

from grains.cli import main as cli
from silo import errors
from silo.client import ClusterClient
from silo.settings import RebalancerSettings
from tests.silo.cluster.grains import Pinned, Resident, Tracked
from tests.silo.cluster.test_failover import Record, _activations, _load, _wait_for

GRAINS = ("tests.silo.cluster.grains",)
FAST_REBALANCE = RebalancerSettings(period_s=0.5, lease_ttl_s=1.0, max_moves_per_period=40)


async def test_joining_silo_receives_a_share_of_activations_within_a_rebalance_period(
    cluster, client: ClusterClient
) -> None:
    await cluster(2, grains=GRAINS, rebalancer=FAST_REBALANCE)
    await client.refresh()
    keys = [f"j{i}" for i in range(36)]
    for k in keys:
        await client.get_grain(Tracked, k).hit()
    pinned = {(await client.get_grain(Pinned, f"pin{i}").hit())[0] for i in range(6)}
    rec, stop = Record(), asyncio.Event()
    load = [asyncio.ensure_future(_load(client, keys, rec, stop, w * 9)) for w in range(4)]
    (new,) = await cluster(1, grains=GRAINS, rebalancer=FAST_REBALANCE)
    t_join = time.monotonic()

    async def has_share() -> bool:
        cat = await _activations(client, new.address)  # type: ignore[arg-type]
        return cat is not None and sum(g.startswith("Tracked/") for g in cat) >= 8

    took = await _wait_for(has_share, 10, "the new silo to get a share")
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*load)
    print(f"\njoin: new silo held a share {took:.2f}s after joining (period {FAST_REBALANCE.period_s}s)")
    assert not rec.failed, rec.failed[:5]
    assert any(s == str(new.address) and t > t_join for t, _, s, _ in rec.ok)
    # Immovable grains stayed where they were.
    assert {(await client.get_grain(Pinned, f"pin{i}").hit())[0] for i in range(6)} == pinned
    # Every grain is active exactly once across the cluster.
    cats = [await _activations(client, s.silo) for s in client.view.active()]
    seen = [g for cat in cats for g in (cat or {}) if g.startswith("Tracked/")]
    assert sorted(seen) == sorted(f"Tracked/{k}" for k in keys)


async def test_drain_command_hands_keep_alive_grains_off_and_stops_the_silo(
    cluster, client: ClusterClient, redis_url: str, cluster_name: str
) -> None:
    a, b = await cluster(2, grains=GRAINS, rebalancer=FAST_REBALANCE)
    await client.refresh()
    on_a = []
    i = 0
    while len(on_a) < 3:
        key = f"res{i}"
        i += 1
        if (await client.get_grain(Resident, key).hit())[0] == str(a.address):
            on_a.append(key)
    code = await asyncio.to_thread(
        cli.main, ["drain", "--redis", redis_url, "--cluster", cluster_name, str(a.address), "--wait", "20"]
    )
    assert code == 0
    await asyncio.wait_for(a.stopped.wait(), 10)
    cat = await _activations(client, b.address)  # type: ignore[arg-type]
    assert cat is not None and all(f"Resident/{k}" in cat for k in on_a), "keep-alive grains not handed off"
    for k in on_a:
        assert (await client.get_grain(Resident, k).hit())[0] == str(b.address)


async def test_sigterm_drains_without_a_failed_call(silo_processes, client: ClusterClient) -> None:
    procs = silo_processes(2, grains=GRAINS[0], env={"REDGRAIN_REBALANCER__MAX_MOVES_PER_PERIOD": "0"})
    await client.refresh()
    keys = [f"t{i}" for i in range(30)]
    first = {k: (await client.get_grain(Tracked, k).hit())[0] for k in keys}
    victim = max(procs, key=lambda p: sum(s == str(p.address) for s in first.values()))
    rec, stop = Record(), asyncio.Event()
    load = [asyncio.ensure_future(_load(client, keys, rec, stop, w * 4)) for w in range(8)]
    await _wait_for(lambda: _ready(rec, keys), 10, "load on every key")
    t_term = time.monotonic()
    code = await asyncio.to_thread(victim.stop, 30)
    t_exit = time.monotonic()
    await _wait_for(lambda: _ready_after(rec, t_exit), 10, "calls after the drain")
    stop.set()
    await asyncio.gather(*load)
    moved = {k for _, k, s, _ in rec.ok if first[k] == str(victim.address) and s != str(victim.address)}
    print(f"\nSIGTERM: drained and exited in {t_exit - t_term:.2f}s, exit {code}, {len(rec.ok)} calls ok, {len(rec.failed)} failed, {len(moved)} grains moved")
    assert code == 0, victim.output()[-2000:]
    assert not rec.failed, rec.failed[:5]
    assert moved == {k for k in keys if first[k] == str(victim.address)}


async def _ready(rec: Record, keys: list[str]) -> bool:
    return len({k for _, k, _, _ in rec.ok}) == len(keys)


async def _ready_after(rec: Record, t: float) -> bool:
    return sum(1 for ok in rec.ok if ok[0] > t) > 200


__all__ = ["errors"]
