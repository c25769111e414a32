"""An idle silo writes its stats record every ``idle_interval_s``, a working one every interval (issue 39)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from silo.catalog.catalog import CatalogStatistics
from silo.keys import Keys
from silo.stats import MethodStatistics, StatsPublisher


class _Source:
    def __init__(self) -> None:
        self.calls = 0
        self.activations = 0

    def __call__(self) -> dict[str, Any]:
        catalog = CatalogStatistics(
            activations=self.activations, by_type={"T": self.activations} if self.activations else {},
            activated_total=self.activations, deactivated_total=0, queued_calls=0,
        )  # fmt: skip
        methods = [MethodStatistics("T", "m", self.calls, 0, float(self.calls), (self.calls,))] if self.calls else []
        return {"catalog": catalog, "methods": methods}


async def test_an_idle_silo_writes_its_stats_only_every_idle_interval_and_a_change_at_once(redis_url: str) -> None:
    now = [1000.0]
    source = _Source()
    redis = aioredis.Redis.from_url(redis_url)
    keys = Keys("cadence")
    pub = StatsPublisher(
        redis, keys, "s1", source, status=lambda: "Active", started=now[0],
        interval_s=1.0, idle_interval_s=15.0, clock=lambda: now[0], gpus=list,
    )  # fmt: skip
    try:
        written = []
        for _ in range(30):  # 30 idle seconds, one tick a second
            written.append(await pub.publish_if_changed() is not None)
            now[0] += 1.0
        assert sum(written) == 2  # the first record, then one 15 s later
        assert written[0] and written[15]
        history = keys.silo_stats_history("s1")
        assert await redis.llen(history) == 2
        # The record outlives the idle cadence.
        assert await redis.ttl(keys.silo_stats("s1")) > 15

        source.activations = 1  # a change goes out on the next tick
        assert await pub.publish_if_changed() is not None
        now[0] += 1.0
        assert await pub.publish_if_changed() is None
        source.calls = 5  # calls too
        now[0] += 1.0
        assert await pub.publish_if_changed() is not None
        assert pub.statistics().published == 4
    finally:
        await redis.aclose()
