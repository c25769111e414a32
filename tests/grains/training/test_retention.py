"""Redis does not fill up: an ended job can be forgotten (by hand or after its TTL), and a
cluster that ran fifty jobs and restarted its silos many times is back to its own size."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

from grains.checkpoints import Snapshots
from grains.training import CoordinatorGrain, TrainingJob
from silo import errors
from silo.keys import Keys
from silo.redis_util import connect_redis
from silo.settings import RemindersSettings, RetentionSettings
from tests.grains.training.conftest import GRAINS, run_job, wait_done
from tests.helpers import REPO

pytestmark = pytest.mark.slow


def tiny(**kw: Any) -> TrainingJob:
    base: dict[str, Any] = {"mode": "sync", "trainers": 1, "shards": 1, "steps": 3, "batch_size": 32, "checkpoint_every": 2}
    return TrainingJob(**{**base, **kw})


async def cluster_keys(redis: Any, keys: Keys) -> set[str]:
    return {k.decode() for p in keys.patterns() async for k in redis.scan_iter(match=p, count=1000)}


def of_job(found: set[str], keys: Keys, job: str) -> set[str]:
    """Keys named for ``job``: its records, checkpoint groups, directory and state entries."""
    marks = (f":job:{job}:", f"ckpt:training.{job}.", f"/{job}", f"rdzv:{job}:")
    return {k for k in found if any(m in k for m in marks)}


async def test_forget_deletes_an_ended_job_from_redis_and_refuses_a_running_one(
    cluster, client, redis_url: str, cluster_name: str
) -> None:
    await cluster(2, grains=GRAINS)
    redis, keys = connect_redis(redis_url), Keys(cluster_name)
    try:
        for job in ("kept", "gone"):
            assert (await run_job(client, job, tiny(ttl_after_finished_s=None))).status == "completed"
        gone: Any = client.get_grain(CoordinatorGrain, "gone")
        before = await cluster_keys(redis, keys)
        assert of_job(before, keys, "gone") and of_job(before, keys, "kept")

        busy: Any = client.get_grain(CoordinatorGrain, "busy")
        await busy.start(tiny(steps=100_000))
        with pytest.raises(errors.ConfigError, match="cancel it before forgetting"):
            await busy.forget()
        await busy.cancel()

        status = await gone.forget()
        assert status.status == "idle" and status.checkpoints == []
        after = await cluster_keys(redis, keys)
        # The coordinator and the job's store grain are on their way out (deactivating).
        leaving = {keys.directory_entry("CoordinatorGrain/gone"), keys.directory_entry("CheckpointStoreGrain/gone")}
        assert of_job(after, keys, "gone") <= leaving, of_job(after, keys, "gone")
        assert of_job(after, keys, "kept") == of_job(before, keys, "kept")  # another job is untouched
        groups = {g.decode() for g in await redis.smembers(keys.checkpoint_groups)}
        assert not any(g.startswith("training.gone.") for g in groups) and "training.kept.r1" in groups
        assert b"gone" not in await redis.smembers(keys.jobs)

        # The same from the command line: `redgrain jobs` lists, `redgrain jobs forget` deletes
        # (as subprocesses the silos of this process serve, so the loop must keep running).
        async def redgrain(*argv: str) -> str:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "grains.cli", "jobs", *argv, "--redis", redis_url, "--cluster", cluster_name,
                env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), 90)
            assert proc.returncode == 0, err.decode()[-2000:]
            return out.decode()

        listed = await redgrain()
        assert "kept" in listed and "busy" in listed and "gone" not in listed
        assert "forgotten" in await redgrain("forget", "busy")
        assert not of_job(await cluster_keys(redis, keys), keys, "busy") - {keys.directory_entry("CoordinatorGrain/busy")}
    finally:
        await redis.aclose()


async def test_a_forget_cut_short_is_finished_by_the_next_tick_of_its_reminder(
    cluster, client, redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A silo killed part-way through a forget (a fresh-check caught one: its checkpoints stayed
    # for good) must leave the reminder registered, and its next tick come soon, not a ttl later.
    await cluster(1, grains=GRAINS, reminders=RemindersSettings(poll_interval_s=0.05))
    redis, keys = connect_redis(redis_url), Keys(cluster_name)
    real, deletes, cut = Snapshots.delete, [0], asyncio.Event()

    async def dies_on_the_second(self: Snapshots, group: str, snapshot_id: int | str) -> bool:
        deletes[0] += 1
        if deletes[0] == 2:
            cut.set()
            raise errors.StorageError("what a kill part-way through leaves: one snapshot deleted, the rest not")
        return await real(self, group, snapshot_id)

    monkeypatch.setattr(Snapshots, "delete", dies_on_the_second)
    try:
        assert (await run_job(client, "cut", tiny(ttl_after_finished_s=3.0))).status == "completed"
        await asyncio.wait_for(cut.wait(), 30)
        assert await redis.zcard(keys.reminders) == 1  # still registered: the forget did not finish
        leaving = {keys.directory_entry("CoordinatorGrain/cut"), keys.directory_entry("CheckpointStoreGrain/cut")}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while of_job(await cluster_keys(redis, keys), keys, "cut") - leaving or await redis.zcard(keys.reminders):
            assert loop.time() < deadline, sorted(of_job(await cluster_keys(redis, keys), keys, "cut"))
            await asyncio.sleep(0.1)
        assert deletes[0] > 2  # the next tick deleted the rest
    finally:
        await redis.aclose()


async def test_fifty_jobs_and_twelve_silo_restarts_leave_redis_as_small_as_it_started(
    cluster, client, redis_url: str, cluster_name: str
) -> None:
    fast = {
        "grains": GRAINS,
        # A tick claimed by a silo killed mid-delivery is claimed again once its lease
        # (delivery timeout + slack) runs out: 5 s here, not the default 30.
        "reminders": RemindersSettings(poll_interval_s=0.05, delivery_timeout_s=5.0),
        "retention": RetentionSettings(dead_silo_s=0.0, period_s=0.1),
    }
    await cluster(2, **fast)
    redis, keys = connect_redis(redis_url), Keys(cluster_name)
    try:
        await client.refresh()
        baseline = await cluster_keys(redis, keys)
        memory_before = await redis.info("memory")

        async def one(i: int) -> None:
            coord: Any = client.get_grain(CoordinatorGrain, f"job-{i}")
            await coord.start(tiny(ttl_after_finished_s=2.0, seed=i))  # seen completed, then forgotten
            assert (await wait_done(coord, 120.0)).status == "completed"

        for batch in range(5):
            await asyncio.gather(*(one(10 * batch + i) for i in range(10)))
        for _ in range(12):  # silos come and go: each restart is a new generation, a new row
            (extra,) = await cluster(1, **fast)
            await extra.stop(graceful=False)

        async def settled() -> set[str]:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            deadline = loop.time() + 60
            while True:
                found = await cluster_keys(redis, keys)
                # A forget deletes the coordinator's state last, after its store's release (a call
                # that may wait out a killed silo): settled means that state gone and its reminder too.
                left = {k for k in found if ":job:" in k or ":ckpt:training." in k or "rdzv:" in k or ":state:index:" in k
                        or (k.startswith(keys.grain_prefix("CoordinatorGrain/")[:-2]) and k.endswith("}:state"))}
                members = await redis.hlen(keys.members)
                if not left and members == 2 and not await redis.zcard(keys.reminders):
                    print(f"settled after {loop.time() - t0:.1f} s")
                    return found
                assert loop.time() < deadline, (sorted(left)[:10], members)
                await asyncio.sleep(0.1)

        found = await settled()
        # What remains is the cluster's own keys plus one directory entry per coordinator (and
        # job store) still activated: forget releases them, and each goes as any grain goes.
        extra_keys = found - baseline
        activated = (keys.grain_prefix("CoordinatorGrain/")[:-2], keys.grain_prefix("CheckpointStoreGrain/")[:-2])
        assert {k for k in extra_keys if not (k.startswith(activated) and k.endswith("}:dir"))} <= {
            keys.reminders, keys.reminder_rows, keys.reminder_fired, keys.logs, keys.fencing_counter(),
            keys.fencing_term(),
        } | {k for k in extra_keys if ":dirindex:" in k or ":state:types" in k} | {
            keys.members_seen(m.decode() if isinstance(m, bytes) else m) for m in await redis.hkeys(keys.members)
        } | {k for k in extra_keys if ":members:seen:" in k and await redis.pttl(k) > 0}, sorted(extra_keys)
        # A live silo's detector keeps a seen-hash (it may start after the baseline); a killed
        # silo's detector may write its own once more after housekeeping removed its row, and
        # that one goes by itself (every seen-hash carries SEEN_TTL_MS).
        assert await redis.zcard(keys.reminders) == 0  # every job's forget reminder went with it
        assert await redis.scard(keys.jobs) == 0 and await redis.scard(keys.checkpoint_groups) == 0
        memory_after = await redis.info("memory")
        grown = memory_after["used_memory"] - memory_before["used_memory"]
        print(f"keys: {len(baseline)} before, {len(found)} after 50 jobs and 12 restarts; memory +{grown / 1e6:.2f} MB")
        assert grown < 2_000_000, grown  # a job's two checkpoints are ~90 kB: fifty kept would be 4.5 MB
    finally:
        await redis.aclose()
