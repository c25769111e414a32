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


async def test_the_heartbeat_thread_sends_its_load_when_activations_change_not_each_beat(
    redis_url: str, cluster_name: str
) -> None:
    redis, keys, me = connect_redis(redis_url), Keys(cluster_name), SiloAddress("127.0.0.1", 7001, 1)
    table = RedisMembershipTable(redis, keys)
    await table.join(MemberRow(address=str(me), host=me.host, port=me.port, generation=1))
    await table.set_status(str(me), SiloStatus.ACTIVE)
    beats: list[int] = []
    activations = [0]
    changed_at: list[int] = []
    go = threading.Event()
    quiet, sent = threading.Event(), threading.Event()

    def load() -> SiloLoad:
        beats.append(1)
        n = len(beats)
        if n == 5:
            quiet.set()
        if go.is_set() and not changed_at:
            activations[0] = 3  # work arrived: this beat sees it
            changed_at.append(n)
        elif changed_at and n >= changed_at[0] + 2:
            sent.set()  # the beat that saw it has gone out
        return SiloLoad(cpu_percent=float(n), activations=activations[0])

    hb = HeartbeatThread(
        redis_url=redis_url, keys=keys, address=str(me), settings=MembershipSettings(heartbeat_s=0.01),
        load=load, on_dead=lambda: None, loop=asyncio.get_running_loop(),
        monotonic=VirtualClock(start=1000.0),  # frozen: the periodic refresh never falls due
    )  # fmt: skip
    hb.start()
    try:
        await asyncio.to_thread(quiet.wait, 10)
        first = SiloLoad.model_validate_json(await redis.hget(keys.members_loads, str(me)) or b"")
        assert first.cpu_percent == 1.0 and first.activations == 0  # beats 2-5 sent no load: nothing changed
        go.set()
        await asyncio.to_thread(sent.wait, 10)
        changed = SiloLoad.model_validate_json(await redis.hget(keys.members_loads, str(me)) or b"")
        assert changed.activations == 3 and changed.cpu_percent == float(changed_at[0])
    finally:
        await hb.stop()
        await close_redis(redis)
