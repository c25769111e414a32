"""/api/reminders and /api/logs against a real in-process cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi.testclient import TestClient

from dashboard import models as m
from grains.ids import GrainId
from silo.client import ClusterClient
from silo.cluster.reminders import ReminderStatistics
from silo.settings import RemindersSettings
from tests.dashboard.conftest import CALM
from tests.dashboard.grains import Grumbler
from tests.sample_grains import Reminded

GRAINS = ("tests.sample_grains", "tests.dashboard.grains")


async def until(api: TestClient, path: str, check: Callable[[dict], bool], timeout_s: float = 15.0) -> dict:
    """GET ``path`` until ``check`` holds: silos tick and publish on their own schedule, in this loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = api.get(path).json()
        if check(body):
            return body
        assert time.monotonic() < deadline, f"{path} never satisfied the check; last: {body}"
        await asyncio.sleep(0.05)  # lets the silos (same event loop) run


def _fired(body: dict) -> bool:
    return any(r["type"] == "Reminded" and r["last_fired"] for r in body.get("reminders", []))


async def test_reminders_list_period_next_due_and_where_the_last_tick_ran(
    cluster, client: ClusterClient, api: TestClient
) -> None:
    silos = await cluster(2, grains=GRAINS, membership=CALM, reminders=RemindersSettings(poll_interval_s=0.05))
    ref = client.get_grain(Reminded, "r1")
    await ref.start(0.2)
    # A reminder of a type no silo hosts, due in an hour: listed, never fired.
    await silos[0].reminders.register(GrainId("Billing", "acct-7"), "invoice", 3600.0)
    body = await until(api, "/api/reminders", _fired)
    listed = m.ReminderList.model_validate(body)
    assert listed.types == ["Billing", "Reminded"]
    billing, reminded = listed.reminders
    assert (billing.key, billing.name, billing.period_s, billing.last_fired, billing.last_silo) == (
        "acct-7", "invoice", 3600.0, None, None
    )
    assert billing.next_due is not None and 3590 < billing.next_due - time.time() < 3610
    assert (reminded.key, reminded.name, reminded.period_s) == ("r1", "tick", 0.2)
    _, ticked_on = await ref.ticks()
    assert reminded.last_silo == await ref.where() == ticked_on[-1]
    assert reminded.last_silo in {str(s.address) for s in silos}
    assert reminded.last_fired is not None and abs(reminded.last_fired - time.time()) < 5
    assert reminded.next_due is not None and reminded.next_due - time.time() < 1.0

    only = m.ReminderList.model_validate(api.get("/api/reminders?type=Billing").json())
    assert [r.name for r in only.reminders] == ["invoice"] and only.types == ["Billing", "Reminded"]

    await ref.stop()
    left = m.ReminderList.model_validate(api.get("/api/reminders").json())
    assert [r.type for r in left.reminders] == ["Billing"]
    # A tick in flight when it was unregistered must not bring the row back: wait until every
    # claimed tick has ended, then look.
    deadline = time.monotonic() + 10
    while not all(_settled(s.reminders.statistics()) for s in silos):
        assert time.monotonic() < deadline, [s.reminders.statistics() for s in silos]
        await asyncio.sleep(0.02)
    assert not await silos[0].redis.hexists(silos[0].keys.reminder_fired, '["Reminded","r1","tick"]')
    assert await silos[0].redis.hlen(silos[0].keys.reminder_fired) == 0


def _settled(stats: ReminderStatistics) -> bool:
    return stats.claimed == stats.delivered + stats.failed


def _grumbled(text: str) -> Callable[[dict], bool]:
    return lambda body: any(e["message"] == f"grumble: {text}" for e in body.get("entries", []))


async def test_logs_show_a_silos_warning_with_its_address_and_tail_with_since(
    cluster, client: ClusterClient, api: TestClient
) -> None:
    silos = await cluster(2, grains=GRAINS, membership=CALM)
    where = await client.get_grain(Grumbler, "g").grumble("disk full")
    body = await until(api, "/api/logs?level=WARNING", _grumbled("disk full"))
    logs = m.LogList.model_validate(body)
    (entry,) = [e for e in logs.entries if e.message == "grumble: disk full"]
    assert (entry.silo, entry.level, entry.logger) == (where, "WARNING", "tests.grumbler")
    assert logs.entries[-1].id == logs.last_id  # newest last

    other = next(str(s.address) for s in silos if str(s.address) != where)
    assert not _grumbled("disk full")(api.get(f"/api/logs?silo={other}").json())
    assert _grumbled("disk full")(api.get(f"/api/logs?silo={where}").json())
    assert not _grumbled("disk full")(api.get("/api/logs?level=ERROR").json())

    await client.get_grain(Grumbler, "g").grumble("quiet", "INFO")  # below the default level
    await client.get_grain(Grumbler, "g").grumble("second")
    tail = m.LogList.model_validate(
        await until(api, f"/api/logs?since={logs.last_id}", _grumbled("second"))
    )
    assert [e.message for e in tail.entries if e.logger == "tests.grumbler"] == ["grumble: second"]
    assert all(_seq(e.id) > _seq(logs.last_id or "0-0") for e in tail.entries)
    quiet = api.get(f"/api/logs?since={tail.last_id}").json()
    assert quiet["entries"] == [] and quiet["last_id"] == tail.last_id

    since_ms = int(entry.id.split("-")[0])
    assert _grumbled("disk full")(api.get(f"/api/logs?since={since_ms}").json())
    assert api.get("/api/logs?level=LOUD").status_code == 422
    assert api.get("/api/logs?since=yesterday").status_code == 422


def _seq(stream_id: str) -> tuple[int, int]:
    ms, _, n = stream_id.partition("-")
    return int(ms), int(n or 0)
