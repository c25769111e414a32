"""Fixtures of the catalog tests: a virtual clock on the test's loop, a silo on the twins."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from silo.settings import CatalogSettings
from silo.testing.clock import VirtualClock
from silo.testing.harness import InProcessSilo
from tests.silo.catalog import grains

ALL_GRAINS = (
    grains.Latch,
    grains.ReentrantLatch,
    grains.PingPong,
    grains.ReentrantPingPong,
    grains.Lifecycle,
    grains.Brief,
    grains.Resident,
    grains.Ticker,
    grains.Counter,
)


@pytest.fixture
async def clock() -> AsyncIterator[VirtualClock]:
    """Virtual time for the running loop and the catalog: it moves only on ``await clock.advance(s)``."""
    with VirtualClock() as c:
        yield c


@pytest.fixture
async def make_silo(clock: VirtualClock) -> AsyncIterator[Callable[..., InProcessSilo]]:
    """``make_silo(settings=...)``: an in-process silo hosting the test grains, stopped after the test."""
    made: list[InProcessSilo] = []

    def make(settings: CatalogSettings | None = None) -> InProcessSilo:
        silo = InProcessSilo(ALL_GRAINS, clock=clock, settings=settings)
        made.append(silo)
        return silo

    yield make
    for silo in made:
        await silo.stop()


@pytest.fixture
async def silo(make_silo: Callable[..., InProcessSilo]) -> InProcessSilo:
    return await make_silo().start()
