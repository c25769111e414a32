"""/api/streams against a real in-process cluster: streams, their subscribers' lag and consumers."""

from __future__ import annotations

from fastapi.testclient import TestClient

from dashboard import models as m
from silo.client import ClusterClient
from silo.settings import StreamSettings
from tests.dashboard.conftest import CALM
from tests.dashboard.test_reminders_logs_api import until
from tests.silo.streams.grains import OrderLog, Tick

GRAINS = ("tests.silo.streams.grains",)
FAST = StreamSettings(lease_s=1.5, discover_interval_s=0.1, block_ms=100)


def _settled(body: dict) -> bool:
    """orders/acct-1 has its subscriber caught up: every item read and acknowledged."""
    for s in body.get("streams", []):
        if (s["namespace"], s["key"]) == ("orders", "acct-1") and s["groups"]:
            g = s["groups"][0]
            return g["lag"] == 0 and g["pending"] == 0 and g["holder"] is not None and bool(g["consumers"])
    return False


async def test_streams_list_items_lag_and_the_silo_delivering_each_key(
    cluster, redis_url: str, cluster_name: str, api: TestClient
) -> None:
    (silo,) = await cluster(1, grains=GRAINS, membership=CALM, streams=FAST)
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, types=[Tick]) as client:
        tokens = [await client.stream("orders", "acct-1").publish(Tick(n=n)) for n in range(7)]
        await client.stream("feed", "lobby").publish("no subscriber here")
        body = await until(api, "/api/streams", _settled)
        listed = m.StreamList.model_validate(body)
        assert listed.namespaces == ["feed", "orders"] and not listed.truncated
        feed, orders = listed.streams
        assert (feed.namespace, feed.key, feed.length, feed.groups) == ("feed", "lobby", 1, [])
        assert (orders.length, orders.first_token, orders.last_token) == (7, tokens[0], tokens[-1])
        (group,) = orders.groups
        assert (group.name, group.lag, group.pending, group.last_delivered) == ("OrderLog", 0, 0, tokens[-1])
        assert group.holder == str(silo.address)
        assert [c.name for c in group.consumers] == [str(silo.address)]
        assert await client.get_grain(OrderLog, "acct-1").seen() == list(range(7))

        # Lag as the dashboard sees it: items published while nobody delivers.
        await silo.stream_agents[0].stop()
        for n in range(7, 10):
            await client.stream("orders", "acct-1").publish(Tick(n=n))
        only = m.StreamList.model_validate(api.get("/api/streams", params={"namespace": "orders"}).json())
        assert [s.key for s in only.streams] == ["acct-1"]
        assert (only.streams[0].length, only.streams[0].groups[0].lag) == (10, 3)
        limited = m.StreamList.model_validate(api.get("/api/streams", params={"limit": 1}).json())
        assert len(limited.streams) == 1 and limited.truncated


async def test_streams_list_each_namespaces_dead_letters(cluster, redis_url: str, cluster_name: str, api: TestClient) -> None:
    await cluster(1, grains=GRAINS, membership=CALM, streams=FAST.model_copy(update={"max_attempts": 1}))
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as client:
        tokens = [await client.stream("poison", "p").publish(n) for n in range(4)]
        body = await until(api, "/api/streams", lambda b: any(d["count"] == 2 for d in b.get("dead_letters", [])))
        (dead,) = m.StreamList.model_validate(body).dead_letters
        assert (dead.namespace, dead.count) == ("poison", 2)
        assert [(d.key, d.group, d.token, d.attempts, d.error) for d in dead.newest] == [
            ("p", "Picky", tokens[3], 1, "ValueError: odd item 3"),
            ("p", "Picky", tokens[1], 1, "ValueError: odd item 1"),
        ]
        other = m.StreamList.model_validate(api.get("/api/streams", params={"namespace": "orders"}).json())
        assert other.dead_letters == []


async def test_the_streams_page_shows_each_subscriber_and_filters_by_namespace(
    cluster, redis_url: str, cluster_name: str
) -> None:
    from dashboard.server import DashboardThread
    from tests.browser import ARTIFACTS, browser_page
    from tests.helpers import free_port

    (silo,) = await cluster(1, grains=GRAINS, membership=CALM, streams=FAST.model_copy(update={"max_attempts": 1}))
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, types=[Tick]) as client:
        for n in range(3):
            await client.stream("orders", "acct-9").publish(Tick(n=n))
        await client.stream("feed", "lobby").publish("hello")
        await client.stream("poison", "p").publish(1)  # Picky raises on it: a dead letter
        board = DashboardThread(redis_url, cluster_name, port=free_port()).start()
        try:
            async with browser_page(700) as page:
                await page.goto(board.url + "/#/streams")
                row = "[data-testid=streams-table] tr[data-stream='{}']"
                holder = page.locator(row.format("orders/acct-9") + " [data-col=holder] a")
                await holder.wait_for()
                assert await holder.text_content() == str(silo.address)
                assert await page.text_content(row.format("orders/acct-9") + " [data-col=group]") == "OrderLog"
                assert await page.text_content(row.format("orders/acct-9") + " [data-col=length]") == "3"
                assert "no implicit subscriber" in (await page.text_content(row.format("feed/lobby")) or "")
                dead = page.locator("[data-testid=dead-letters-poison] [data-col=count]")
                await dead.wait_for()
                assert await dead.text_content() == "1"
                assert "ValueError: odd item 1" in (await page.text_content("[data-dead^='poison/p/'] [data-col=error]") or "")
                await page.screenshot(path=str(ARTIFACTS / "dashboard-streams.png"), full_page=True)
                await page.select_option("[data-testid=stream-namespace]", "feed")
                await page.locator(row.format("orders/acct-9")).wait_for(state="detached")
                assert await page.locator(row.format("feed/lobby")).count() == 1
        finally:
            board.stop()
