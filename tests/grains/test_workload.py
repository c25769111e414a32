"""A workload's shared store and progress record are a facility a grain reaches through its
context (``workload(self)``); a plain user grain publishes, meets and forgets with it."""

from __future__ import annotations

import json
from typing import Any

from silo.client import ClusterClient
from tests.facility_grains import Batch

GRAINS = ("tests.facility_grains",)


async def test_a_plain_user_grain_publishes_progress_and_forgets_it_through_the_facility(
    cluster: Any, client: ClusterClient
) -> None:
    await cluster(1, grains=GRAINS)
    redis: Any = client.redis  # replies as bytes
    keys = client.keys
    job = client.get_grain(Batch, "nightly")
    # A float goes as its repr and a None is left out, as the dashboard's points expect.
    assert await job.report(1, [{"step": 1, "loss": 0.5, "acc": None}]) is False
    assert await job.report(2, [{"step": 2, "loss": 0.25}]) is False
    assert json.loads(await redis.get(keys.job_progress("nightly"))) == {"job": "nightly", "done": 2, "note": ""}
    history = [fields for _, fields in await redis.xrange(keys.job_history("nightly"))]
    assert history == [{b"step": b"1", b"loss": b"0.5"}, {b"step": b"2", b"loss": b"0.25"}]
    assert await redis.sismember(keys.jobs, "nightly")

    assert await job.report(3, [{"step": 3}], True) is False  # restart: the history is these alone
    assert [f for _, f in await redis.xrange(keys.job_history("nightly"))] == [{b"step": b"3"}]

    await redis.set(keys.job_cancel("nightly"), "cancel")  # what `redgrain train --cancel` writes
    assert await job.report(4, []) is True

    key = await job.meet(7, "yes")
    assert key == keys.rendezvous("nightly", 7) + "ready"  # the cluster's key space, silo/keys.py
    assert await redis.get(key) == b"yes"

    await job.forget()
    gone = [keys.job_progress("nightly"), keys.job_history("nightly"), keys.job_cancel("nightly"), key]
    assert await redis.exists(*gone) == 0
    assert not await redis.sismember(keys.jobs, "nightly")
