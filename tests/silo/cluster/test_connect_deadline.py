"""A call whose grain lives behind a partition ends by its deadline, not by connect_timeout_s.

No namespaces needed: a listening socket whose accept queue is full drops new
SYNs, so connecting to it hangs the way connecting across a partition does.
(tests/netns has the same with a real cut.)
"""

from __future__ import annotations

import socket
import time

import pytest

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.client import ClusterClient
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.membership import RedisMembershipTable
from silo.records.membership import MemberRow, SiloStatus
from tests.sample_grains import Echo


async def test_call_to_a_silo_that_cannot_be_reached_fails_by_its_deadline(
    cluster, client: ClusterClient
) -> None:
    (silo,) = await cluster(1)
    clogged = socket.socket()
    held: list[socket.socket] = []
    try:
        clogged.bind(("127.0.0.1", 0))
        clogged.listen(0)
        port = clogged.getsockname()[1]
        filler = socket.socket()
        filler.connect(("127.0.0.1", port))  # fills the queue: the next SYN is dropped
        held.append(filler)
        unreachable = SiloAddress("127.0.0.1", port, 10_000)
        table = RedisMembershipTable(silo.redis, silo.keys)
        await table.join(MemberRow(address=str(unreachable), host="127.0.0.1", port=port, generation=10_000,
                                   status=SiloStatus.ACTIVE, grain_types=["Echo"], heartbeat=time.time()))  # fmt: skip
        grain = GrainId("Echo", "behind-the-cut")
        await RedisGrainDirectory(silo.redis, silo.keys).register(grain, unreachable, "a1")
        await client.refresh()
        assert client.settings.transport.connect_timeout_s >= 5.0
        t0 = time.monotonic()
        with pytest.raises((errors.SiloUnavailableError, errors.GrainTimeoutError)):
            await client.get_grain(Echo, "behind-the-cut").with_timeout(0.5).where()
        took = time.monotonic() - t0
        assert took < 2.0, f"answered after {took:.2f}s: the connect outlived the call's 0.5 s deadline"
    finally:
        for s in held:
            s.close()
        clogged.close()
