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


async def test_calls_over_the_connection_in_flight_limit_get_overloaded_error(
    cluster: ClusterFactory, redis_url: str, cluster_name: str
) -> None:
    await cluster(1)
    settings = ClientSettings(transport=TransportSettings(max_in_flight=4))
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=settings) as c:
        refs = [c.get_grain(Echo, f"k{i}") for i in range(10)]
        for r in refs:  # activate and connect first, within the limit
            await r.echo(0)
        results = await asyncio.gather(*(r.sleep(0.3) for r in refs), return_exceptions=True)
        overloaded = [r for r in results if isinstance(r, errors.OverloadedError)]
        assert results.count("slept") == 4 and len(overloaded) == 6, results
        assert "is over its limit of 4; retry later" in str(overloaded[0])
        # Back-pressure, not a leak: once the calls are answered, the slots are free again.
        assert await asyncio.gather(*(r.echo(1) for r in refs[:4])) == [1] * 4
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
        results = await asyncio.gather(*(r.sleep(0.3) for r in refs), return_exceptions=True)
        overloaded = [r for r in results if isinstance(r, errors.OverloadedError)]
        assert results.count("slept") == 4 and len(overloaded) == 6, results
        assert "connection from" in str(overloaded[0]) and "over its limit of 4" in str(overloaded[0])
        assert silo.transport.statistics().overloaded == 6
        # The slots free up as answers go out.
        assert await asyncio.gather(*(r.echo(1) for r in refs[:4])) == [1] * 4


async def test_calls_over_an_activation_queue_limit_get_overloaded_error(
    cluster: ClusterFactory, client: ClusterClient
) -> None:
    await cluster(1, catalog=CatalogSettings(max_queue=3))
    grain = client.get_grain(Echo, "busy")
    await grain.echo(0)
    results = await asyncio.gather(*(grain.sleep(0.05) for _ in range(12)), return_exceptions=True)
    overloaded = [r for r in results if isinstance(r, errors.OverloadedError)]
    assert overloaded and results.count("slept") + len(overloaded) == 12, results
    assert "mailbox of" in str(overloaded[0]) and "over its limit of 3" in str(overloaded[0])
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
