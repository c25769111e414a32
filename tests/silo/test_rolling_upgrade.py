"""A rolling upgrade on real silo processes: v1 and v2 of one grain type side by side, under load.

Two v1 silos serve a load of calls from a client that connected while only they ran; two v2
silos join; the client calls the method only v2 has; the v1 silos drain (SIGTERM) and exit.
Not one call of the load fails, each landed exactly once (the totals add up), the state v1
wrote reads in v2, and every grain ends on v2.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

from silo import errors
from silo.client import ClusterClient
from tests.silo.cluster.test_failover import _wait_for
from tests.silo.ledger_v1 import LedgerV1
from tests.silo.ledger_v2 import LedgerV2

KEYS = [f"acct-{i}" for i in range(16)]
START = 100


@dataclass
class Load:
    adds: collections.Counter[str] = field(default_factory=collections.Counter)
    """Grain key -> calls of add(1) that succeeded."""
    served: list[tuple[float, int]] = field(default_factory=list)
    """(finished at, version that served it)"""
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(grain key, error)"""


async def _load(client: ClusterClient, load: Load, stop: asyncio.Event, start: int) -> None:
    # Old client code: it knows only v1's class, whose methods v2 has too.
    i = start
    while not stop.is_set():
        key = KEYS[i % len(KEYS)]
        i += 1
        try:
            _, served_by = await client.get_grain(LedgerV1, key).with_timeout(20).add(1)
        except errors.RedgrainError as exc:
            load.failed.append((key, f"{type(exc).__name__}: {exc}"))
        else:
            load.adds[key] += 1
            load.served.append((time.monotonic(), served_by))


async def test_v1_to_v2_rolling_upgrade_under_load_fails_no_call_and_keeps_state(
    silo_processes, redis_url: str, cluster_name: str
) -> None:
    old = silo_processes(2, grains="tests.silo.ledger_v1")
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as client:
        for key in KEYS:  # state written by v1
            assert await client.get_grain(LedgerV1, key).add(START) == (START, 1)
        load, stop = Load(), asyncio.Event()
        workers = [asyncio.ensure_future(_load(client, load, stop, w * 3)) for w in range(6)]
        try:
            # In a thread: the load keeps running while the new silos start.
            new = await asyncio.to_thread(silo_processes, 2, grains="tests.silo.ledger_v2")
            # The client's manifests predate v2: the unknown method makes it read them again, and
            # the grain (active on a v1 silo) is deactivated there and placed on a v2 silo.
            summary = await client.get_grain(LedgerV2, KEYS[0]).summary()
            assert summary["version"] == 2 and summary["label"] == "unlabelled"
            assert summary["total"] >= START and summary["entries"] >= 1
            for p in old:
                t_drain = time.monotonic()
                code = await asyncio.to_thread(p.stop, 30)
                assert code == 0, p.output()[-3000:]
            await _wait_for(lambda: _served_after(load, t_drain, 200), 20, "calls after the drain")
        finally:
            stop.set()
            await asyncio.gather(*workers)
        print(f"\nrolling upgrade: {sum(load.adds.values())} calls ok, {len(load.failed)} failed, served by v1/v2: {sum(v == 1 for _, v in load.served)}/{sum(v == 2 for _, v in load.served)}")
        assert not load.failed, load.failed[:5]
        assert {v for _, v in load.served} == {1, 2}, "the load ran on both versions"
        assert all(p.alive() for p in new)
        for key in KEYS:
            # Exactly once each: v1's state read by v2, plus every add that succeeded.
            summary = await client.get_grain(LedgerV2, key).summary()
            assert summary["total"] == START + load.adds[key], (key, summary, load.adds[key])
            assert summary["entries"] == 1 + load.adds[key] and summary["version"] == 2


async def _served_after(load: Load, t: float, n: int) -> bool:
    return sum(1 for at, _ in load.served if at > t) >= n
