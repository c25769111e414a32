"""State under failure: silos SIGKILLed mid-hammer, Redis killed and restarted mid-write."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from silo import errors
from silo.client import ClusterClient
from silo.settings import SiloSettings, StorageSettings
from silo.silo import Silo
from tests.sample_grains import Counter, Echo, Ledger


async def test_ledger_hammered_while_its_silo_is_killed_keeps_exactly_the_acknowledged_adds(
    silo_processes, redis_url: str, cluster_name: str
) -> None:
    procs = silo_processes(2)
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as client:
        ledger = client.get_grain(Ledger, "hammer")
        acked = 0
        retried = 0
        stop = asyncio.Event()

        async def worker(w: int) -> None:
            nonlocal acked, retried
            for j in itertools.count():
                if stop.is_set():
                    return
                op = f"w{w}-{j}"
                while True:
                    try:
                        await ledger.add(1, op)
                        break
                    except errors.RedgrainError:
                        # Maybe applied, maybe not: the op id makes a blind retry safe.
                        retried += 1
                        await asyncio.sleep(0.05)
                acked += 1

        async def host() -> str:
            while True:
                try:
                    return str(await ledger.where())
                except errors.RedgrainError:
                    await asyncio.sleep(0.05)

        workers = [asyncio.ensure_future(worker(w)) for w in range(3)]
        try:
            for round_ in range(2):
                before = acked
                where = await host()
                victim = next(p for p in procs if str(p.address) == where)
                victim.kill()
                while acked < before + 10:  # served again elsewhere, from the persisted state
                    await asyncio.sleep(0.05)
                if round_ == 0:
                    await asyncio.to_thread(victim.start)  # hammering goes on meanwhile
        finally:
            stop.set()
            await asyncio.gather(*workers)
        total, applied = await ledger.total()
        assert (total, applied) == (acked, acked)
        assert retried > 0  # the kills did interrupt calls


async def test_redis_killed_during_writes_gives_storage_errors_then_recovers(
    fresh_redis, cluster_name: str
) -> None:
    settings = SiloSettings(
        redis_url=fresh_redis.url,
        cluster=cluster_name,
        grains=("tests.sample_grains",),
        storage=StorageSettings(retries=2, retry_backoff_s=0.05),
    )
    silo = await Silo(settings).start()
    try:
        counter, echo = silo.get_grain(Counter, "r"), silo.get_grain(Echo, "e")
        assert await echo.echo("up") == "up"
        acked = 0
        failed = 0
        for i in range(40):
            if i == 20:
                fresh_redis.kill()
            try:
                await counter.add(1)
                acked += 1
            except errors.StorageError as exc:
                assert "Redis unreachable" in str(exc) or "Redis error" in str(exc)
                failed += 1
        assert acked == 20 and failed == 20
        assert await echo.echo("still serving") == "still serving"  # the silo keeps running

        fresh_redis.restart()
        for _ in range(100):  # reconnecting: the first calls may still see the old connections fail
            try:
                value = await counter.add(1)
                break
            except errors.StorageError:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("writes did not recover after Redis came back")
        assert (
            value == acked + 1
        )  # nothing half-written became visible; the acknowledged 20 survived
        assert await counter.get() == acked + 1
    finally:
        await silo.stop(graceful=False)
