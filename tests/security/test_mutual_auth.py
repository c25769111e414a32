"""Mutual authentication: a caller with the cluster secret talks only to silos that prove it too.

The fake silo is a plain asyncio server that speaks the first half of the
handshake (a HELLO with a nonce) and then answers AUTH_OK however it likes;
it records every frame it receives, so the tests can assert that no call
ever reached it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.client import ClusterClient
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.membership import RedisMembershipTable
from silo.codec import Codec
from silo.keys import Keys
from silo.messaging.frame import AUTH, AUTH_OK, BUFLEN, HELLO, PREFIX
from silo.messaging.transport import Transport
from silo.records.membership import MemberRow, SiloStatus
from silo.settings import ClientSettings, TransportSettings
from silo.silo import Silo
from silo.testing.transport import pack_frame
from tests.sample_grains import Echo

SECRET = "the cluster's own secret"
ClusterFactory = Callable[..., Awaitable[list[Silo]]]


@dataclass
class FakeSilo:
    """Answers every AUTH with ``answer(auth_header)`` and records the kinds of all frames it gets."""

    answer: Callable[[list[Any]], list[Any]]
    kinds: list[int] = field(default_factory=list)
    server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(pack_frame([HELLO, b"n" * 16]))
        try:
            while True:
                hlen, mlen, nbuf = PREFIX.unpack(await reader.readexactly(PREFIX.size))
                lens = [BUFLEN.unpack(await reader.readexactly(BUFLEN.size))[0] for _ in range(nbuf)]
                header = msgpack.unpackb(await reader.readexactly(hlen))
                await reader.readexactly(mlen + sum(lens))
                self.kinds.append(header[0])
                if header[0] == AUTH:
                    writer.write(pack_frame(self.answer(header)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def _settings(secret: str | None = SECRET) -> TransportSettings:
    return TransportSettings(cluster_secret=SecretStr(secret) if secret else None, connect_timeout_s=3)


@pytest.fixture
async def fake() -> AsyncIterator[Callable[[Callable[[list[Any]], list[Any]]], Awaitable[tuple[FakeSilo, str]]]]:
    started: list[FakeSilo] = []

    async def start(answer: Callable[[list[Any]], list[Any]]) -> tuple[FakeSilo, str]:
        f = FakeSilo(answer)
        started.append(f)
        return f, await f.start()

    yield start
    for f in started:
        await f.stop()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        pytest.param(lambda h: [AUTH_OK], "did not prove it holds the cluster secret", id="bare-auth-ok"),
        pytest.param(lambda h: [AUTH_OK, b"\0" * 32], "proof of the cluster secret is wrong", id="wrong-proof"),
        # The caller's own HMAC handed back: the two sides' MACs never cover the same input.
        pytest.param(lambda h: [AUTH_OK, h[1]], "proof of the cluster secret is wrong", id="reflected-auth"),
        pytest.param(lambda h: [AUTH_OK, "not bytes"], "did not prove", id="malformed-proof"),
    ],
)
async def test_a_fake_silo_that_answers_auth_ok_is_refused_before_any_call_frame(
    fake: Any, answer: Callable[[list[Any]], list[Any]], message: str
) -> None:
    silo, endpoint = await fake(answer)
    transport = Transport(_settings(), Codec())
    try:
        with pytest.raises(errors.AuthenticationError, match=message):
            await transport.connect(endpoint)
        assert transport.connection_nowait(endpoint) is None
        assert transport.statistics().refused == 1
    finally:
        await transport.close()
    assert silo.kinds == [AUTH], "only the handshake may reach a silo that has not proved the secret"


async def test_a_client_refuses_a_fake_silo_in_the_membership_table_and_sends_it_no_call(
    cluster: ClusterFactory, redis_url: str, cluster_name: str, fake: Any
) -> None:
    """Whoever can write to Redis can list a fake silo and point a grain at it; it still gets nothing."""
    await cluster(1, transport=_settings())
    silo, endpoint = await fake(lambda h: [AUTH_OK])
    host, _, port = endpoint.rpartition(":")
    address = SiloAddress(host, int(port), 999)
    keys = Keys(cluster_name)
    redis = aioredis.Redis.from_url(redis_url)
    try:
        table = RedisMembershipTable(redis, keys)
        row = MemberRow(address=str(address), host=host, port=int(port), generation=999,
                        grain_types=["Echo"], heartbeat=time.time(), started=time.time())  # fmt: skip
        await table.join(row)
        await table.set_status(str(address), SiloStatus.ACTIVE)
        await RedisGrainDirectory(redis, keys).register(GrainId("Echo", "victim"), address, "fake-activation")
        settings = ClientSettings(transport=_settings())
        async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=settings) as client:
            with pytest.raises(errors.AuthenticationError, match="did not prove it holds the cluster secret"):
                await client.get_grain(Echo, "victim").with_timeout(3).echo("for your eyes only")
            # Other grains still go to the real silo.
            assert await client.get_grain(Echo, "elsewhere").echo(1) == 1
    finally:
        await redis.aclose()
    # AUTH frames only, never a call: one from the client, and one more if the real silo's
    # failure detector probed the listed fake meanwhile (it is refused the same way).
    assert silo.kinds and set(silo.kinds) == {AUTH}, silo.kinds


async def test_a_real_silo_proves_the_secret_and_calls_go_through(cluster: ClusterFactory) -> None:
    (real,) = await cluster(1, transport=_settings())
    transport = Transport(_settings(), Codec())
    try:
        conn = await transport.connect(real.address.endpoint)
        assert not conn.closed
        assert transport.statistics().refused == 0
    finally:
        await transport.close()


async def test_a_silo_with_another_secret_is_refused_by_the_caller_too(cluster: ClusterFactory) -> None:
    (other,) = await cluster(1, transport=_settings("a different secret"))
    transport = Transport(_settings(), Codec())
    try:
        # The silo drops us (our HMAC is wrong for it) before it would prove anything.
        with pytest.raises((errors.AuthenticationError, errors.SiloUnavailableError)):
            await transport.connect(other.address.endpoint)
    finally:
        await transport.close()
    assert other.transport.statistics().refused == 1
