"""Reminder ticks and stream items take the path of every call: Router.invoke, its one retry policy.

A tick or an item turned away unrun (a mailbox over ``max_queue``: LoadShedError; a silo not
serving: SiloNotServingError) is retried by the router until its deadline, like any call, and
delivered; the reminder service and the stream agent see one successful call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from grains.ids import GrainId
from silo.client import ClusterClient
from silo.settings import CatalogSettings, RemindersSettings, StreamSettings
from silo.silo import Silo
from tests.silo.delivery_grains import Busy

GRAINS = ("tests.silo.delivery_grains",)
FAST_REMINDERS = RemindersSettings(poll_interval_s=0.05)
FAST_STREAMS = StreamSettings(discover_interval_s=0.1, block_ms=50)


async def _until(check: Callable[[], Any], timeout_s: float = 10.0) -> None:
    """Poll ``check()`` (deliveries happen in the silo's own tasks: nothing to await) until truthy."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def full_mailbox(client: ClusterClient) -> AsyncIterator[Callable[[str], Awaitable[None]]]:
    """``await full_mailbox(key)``: Busy/key runs hold() and has one call queued behind it."""
    Busy.gate, Busy.holding = asyncio.Event(), asyncio.Event()
    calls: list[asyncio.Future[Any]] = []

    async def fill(key: str) -> None:
        ref = client.get_grain(Busy, key)
        calls.append(asyncio.ensure_future(ref.hold()))
        assert Busy.holding is not None
        await Busy.holding.wait()
        calls.append(asyncio.ensure_future(ref.queued()))

    yield fill
    Busy.gate.set()
    await asyncio.gather(*calls)
    Busy.gate = Busy.holding = None


def _queued(silo: Silo, key: str) -> bool:
    act = silo.catalog.get(GrainId("Busy", key))
    return act is not None and act.queue_length >= 1


async def test_a_reminder_tick_shed_by_a_full_mailbox_is_retried_by_the_router_and_delivered(
    cluster: Any, client: ClusterClient, full_mailbox: Callable[[str], Awaitable[None]]
) -> None:
    (silo,) = await cluster(1, grains=GRAINS, catalog=CatalogSettings(max_queue=1), reminders=FAST_REMINDERS)
    await full_mailbox("r")
    await _until(lambda: _queued(silo, "r"))
    before = silo.router.statistics().retries
    # The next tick is a minute away: only a retry of this one can arrive in time.
    await silo.reminders.register(GrainId("Busy", "r"), "tick", period_s=60.0, due_s=0.0)
    await _until(lambda: silo.router.statistics().retries > before or silo.reminders.statistics().failed)
    assert Busy.gate is not None
    Busy.gate.set()
    await _until(lambda: silo.reminders.statistics().delivered + silo.reminders.statistics().failed >= 1)
    stats = silo.reminders.statistics()
    assert (stats.delivered, stats.failed) == (1, 0)
    assert (await client.get_grain(Busy, "r").seen())[0] == 1


async def test_a_stream_item_shed_by_a_full_mailbox_is_retried_by_the_router_and_delivered(
    cluster: Any, client: ClusterClient, full_mailbox: Callable[[str], Awaitable[None]]
) -> None:
    (silo,) = await cluster(1, grains=GRAINS, catalog=CatalogSettings(max_queue=1), streams=FAST_STREAMS)
    await full_mailbox("s")
    await _until(lambda: _queued(silo, "s"))
    before = silo.router.statistics().retries
    await client.stream("busy", "s").publish("item")
    agents = silo.stream_agents
    await _until(lambda: silo.router.statistics().retries > before or sum(a.statistics().retries for a in agents))
    assert Busy.gate is not None
    Busy.gate.set()
    await _until(lambda: sum(a.statistics().delivered for a in agents) >= 1)
    assert [(a.statistics().retries, a.statistics().failed) for a in agents] == [(0, 0)]  # one call, retried inside
    assert (await client.get_grain(Busy, "s").seen())[1] == ["item"]


async def test_ticks_and_items_for_a_silo_not_serving_are_retried_by_the_router_until_it_serves(
    cluster: Any, client: ClusterClient
) -> None:
    (silo,) = await cluster(1, grains=GRAINS, reminders=FAST_REMINDERS, streams=FAST_STREAMS)
    await client.get_grain(Busy, "n").seen()  # activated: the stream agent holds the key once published
    serving = silo.dispatcher.fenced
    silo.dispatcher.fenced = lambda: True  # liveness unconfirmed: every call turned away unrun
    try:
        before = silo.router.statistics().retries
        await silo.reminders.register(GrainId("Busy", "n"), "tick", period_s=60.0, due_s=0.0)
        await client.stream("busy", "n").publish("item")
        await _until(lambda: silo.router.statistics().retries >= before + 4)
    finally:
        silo.dispatcher.fenced = serving
    agents = silo.stream_agents
    await _until(lambda: silo.reminders.statistics().delivered and sum(a.statistics().delivered for a in agents))
    assert silo.reminders.statistics().failed == 0
    assert [(a.statistics().retries, a.statistics().failed) for a in agents] == [(0, 0)]
    assert await client.get_grain(Busy, "n").seen() == (1, ["item"])
