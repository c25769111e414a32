"""The heartbeat thread sends the silo's load when its activations change, not with every beat (issue 39)."""

from __future__ import annotations

import asyncio
import threading

from grains.ids import SiloAddress
from silo.cluster.failure_detector import HeartbeatThread
from silo.cluster.membership import RedisMembershipTable
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloLoad, SiloStatus
from silo.redis_util import close_redis, connect_redis
from silo.settings import MembershipSettings
from silo.testing.clock import VirtualClock


async def test_the_heartbeat_thread_beats_when_activations_change_else_only_to_renew_its_lease(
    redis_url: str, cluster_name: str
) -> None:
    redis, keys, me = connect_redis(redis_url), Keys(cluster_name), SiloAddress("127.0.0.1", 7001, 1)
    table = RedisMembershipTable(redis, keys)
    await table.join(MemberRow(address=str(me), host=me.host, port=me.port, generation=1))
    await table.set_status(str(me), SiloStatus.ACTIVE)
    mono = VirtualClock(start=1000.0)
    activations = [0]
    looks = threading.Semaphore(0)

    def load() -> SiloLoad:
        mono.jump(0.01)  # each look of the thread: 10 ms of its clock
        looks.release()
        return SiloLoad(cpu_percent=mono(), activations=activations[0])

    async def look(times: int) -> None:
        for _ in range(times):
            assert await asyncio.to_thread(looks.acquire, True, 10)

    settings = MembershipSettings(heartbeat_s=0.05, lease_s=20.0)
    hb = HeartbeatThread(
        redis_url=redis_url, keys=keys, address=str(me), settings=settings,
        load=load, on_dead=lambda: None, loop=asyncio.get_running_loop(), monotonic=mono,
    )  # fmt: skip
    hb.start()
    try:
        await look(3)
        assert hb.beats == 1  # the first beat sends the load
        await look(100)  # a second of its clock, nothing changed: no beat
        assert hb.beats == 1
        activations[0] = 3
        await look(10)
        assert hb.beats == 2
        sent = SiloLoad.model_validate_json(await redis.hget(keys.members_loads, str(me)) or b"")
        assert sent.activations == 3
        mono.jump(settings.lease_s / 2)
        await look(3)
        assert hb.beats == 3  # the lease renewed
    finally:
        await hb.stop()
        await close_redis(redis)
