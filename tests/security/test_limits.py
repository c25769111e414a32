"""Back-pressure and size limits: clear errors, bounded memory, and the silo keeps serving."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from silo import errors
from silo.client import ClusterClient
from silo.settings import CatalogSettings, ClientSettings, TransportSettings
from silo.silo import Silo
from tests.sample_grains import Echo

ClusterFactory = Callable[..., Awaitable[list[Silo]]]


async def test_calls_over_the_connection_in_flight_limit_wait_for_a_slot(
    cluster: ClusterFactory, redis_url: str, cluster_name: str
) -> None:
    (silo,) = await cluster(1)
    settings = ClientSettings(transport=TransportSettings(max_in_flight=4))
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=settings) as c:
        refs = [c.get_grain(Echo, f"k{i}") for i in range(10)]
        for r in refs:  # activate and connect first
            await r.echo(0)
        requests = silo.dispatcher.statistics().requests
        results = await asyncio.gather(*(r.sleep(0.05) for r in refs))
        # Nothing failed for being over the limit: the six extra calls waited for slots.
        assert results == ["slept"] * 10
        assert silo.dispatcher.statistics().requests - requests == 10
        assert silo.transport.statistics().overloaded == 0
        assert c.transport.statistics().pending_calls == 0


async def test_silo_bounds_calls_it_serves_per_connection_even_if_the_caller_does_not(
    cluster: ClusterFactory, redis_url: str, cluster_name: str
) -> None:
    (silo,) = await cluster(1, transport=TransportSettings(max_in_flight=4))
    greedy = ClientSettings(transport=TransportSettings(max_in_flight=1000))
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=greedy) as c:
        refs = [c.get_grain(Echo, f"s{i}") for i in range(10)]
        for r in refs:
            await r.echo(0)
        results = await asyncio.gather(*(r.sleep(0.3) for r in refs))
        # The silo shed what it would not hold (LoadShedError, never run), and the
        # caller's router retried those with backoff until they were served.
        assert results == ["slept"] * 10
        assert silo.transport.statistics().overloaded >= 6
        assert c.router.statistics().retries >= 6


async def test_a_silo_that_sheds_answers_load_shed_error_which_a_bare_request_sees(
    cluster: ClusterFactory, redis_url: str, cluster_name: str
) -> None:
    (silo,) = await cluster(1, transport=TransportSettings(max_in_flight=1))
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as c:
        await c.get_grain(Echo, "x").echo(0)
        conn = c.transport.connection_nowait(silo.address.endpoint)
        assert conn is not None
        header = [1, 0, "Echo", "x", "sleep", 5000, [], 0]
        first = conn.request(list(header), [0.3], 5.0)
        with pytest.raises(errors.LoadShedError, match="connection from .* over its limit of 1"):
            await conn.request(list(header), [0.3], 5.0)
        assert await first == "slept"


async def test_calls_over_an_activation_queue_limit_are_shed_and_retried(
    cluster: ClusterFactory, client: ClusterClient
) -> None:
    await cluster(1, catalog=CatalogSettings(max_queue=3))
    grain = client.get_grain(Echo, "busy")
    await grain.echo(0)
    results = await asyncio.gather(*(grain.sleep(0.02) for _ in range(12)))
    assert results == ["slept"] * 12
    assert client.router.statistics().retries > 0
    assert await grain.echo("still serving") == "still serving"


async def test_oversized_frame_is_refused_clearly_and_the_silo_keeps_serving(
    cluster: ClusterFactory, client: ClusterClient, caplog: pytest.LogCaptureFixture
) -> None:
    (silo,) = await cluster(1, transport=TransportSettings(max_frame_bytes=64 * 1024))
    caplog.set_level(logging.WARNING, logger="redgrain.transport")
    grain = client.get_grain(Echo, "e")
    assert await grain.echo(b"small") == b"small"
    with pytest.raises(errors.SiloUnavailableError):
        await grain.with_timeout(5).echo(b"x" * 200_000)
    assert silo.transport.statistics().bad_frames == 1
    assert any("exceeds max_frame_bytes=65536" in r.getMessage() for r in caplog.records)
    # A new connection serves as before.
    assert await grain.echo(b"small again") == b"small again"
