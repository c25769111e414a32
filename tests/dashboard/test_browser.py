"""The dashboard page in a real headless Chromium (Debian's package, driven by Playwright).

The training job here is synthetic: the training grains are written in
parallel, so the test publishes a JobProgress record and per-step history
with ``publish_job_progress``, exactly as the coordinator will.
Screenshots land in test-artifacts/ for a person to look at.
"""

from __future__ import annotations

import asyncio
import math
import re
import time

import pytest

from dashboard.server import DashboardThread
from grains.training.api.records import (
    CheckpointInfo,
    JobPoint,
    JobProgress,
    Placement,
    RecoveryInfo,
    publish_job_progress,
)
from silo.client import ClusterClient
from silo.testing.embedded import RedisServer
from tests.browser import ARTIFACTS, browser_page
from tests.dashboard.conftest import CALM
from tests.helpers import free_port
from tests.sample_grains import Counter, Echo


async def publish_synthetic_job(silos: list, redis, keys, job: str, steps: int) -> None:
    """A classification job: training loss and batch accuracy each step, an evaluation
    (loss, accuracy on the test split) every 10 steps."""
    addresses = [str(s.address) for s in silos]
    base = JobProgress(
        job=job,
        mode="ssp",
        total_steps=200,
        trainers=[Placement(key=f"{job}/trainer-{i}", silo=addresses[i % 2]) for i in range(4)],
        shards=[Placement(key=f"{job}/shard-{i}", silo=addresses[(i + 1) % 2]) for i in range(2)],
    )
    now = time.time() - steps
    evaluation: dict[str, float] = {}
    for step in range(1, steps + 1):
        evaluated = step % 10 == 0
        if evaluated:
            evaluation = {"loss": 2.0 * math.exp(-step / 25) + 0.1, "accuracy": 1 - 0.8 * math.exp(-step / 20)}
        progress = base.model_copy(
            update={
                "step": step,
                "epoch": step / 20,
                "loss": 2.3 * math.exp(-step / 25) + 0.08,
                "metrics": {"accuracy": 1 - 0.9 * math.exp(-step / 20)},
                "eval_metrics": evaluation,
                "eval_step": step - step % 10 if evaluation else None,
                "accuracy": evaluation.get("accuracy"),
                "samples_per_s": 5000 + 300 * math.sin(step / 5),
                "bytes_per_step": 1_200_000,
                "max_staleness": 3.0,
                "max_gap": 2.0,
                "checkpoints": [
                    CheckpointInfo(snapshot=f"snap-{s}", step=s, at=now + s)
                    for s in range(25, step + 1, 25)
                ],
                "recoveries": [
                    RecoveryInfo(reason="shard(s) lost", start_step=25, at=now + 31, back_after_s=0.42)
                ]
                if step > 30
                else [],
                "updated_at": now + step,
            }
        )
        await publish_job_progress(redis, keys, progress, evaluated=evaluated)
    # One more point published with an explicit JobPoint, as a coordinator may.
    await publish_job_progress(
        redis, keys, progress, point=JobPoint(step=steps + 1, loss=0.1, at=now + steps + 1)
    )


async def publish_regression_job(redis, keys, job: str, steps: int) -> None:
    """A regression job with the user's own metric names and no accuracy: training ``mse``,
    evaluation ``mse`` and ``r2`` every 5 steps."""
    for step in range(1, steps + 1):
        evaluated = step % 5 == 0
        progress = JobProgress(
            job=job,
            step=step,
            total_steps=steps,
            loss=1 / step,
            metrics={"mse": 1 / step},
            eval_metrics={"mse": 1.2 / step, "r2": 1 - 1 / step} if step >= 5 else {},
            eval_step=step - step % 5 if step >= 5 else None,
        )
        await publish_job_progress(redis, keys, progress, evaluated=evaluated)


async def test_pages_render_live_figures_and_curves(
    cluster, client: ClusterClient, redis_url: str, cluster_name: str
) -> None:
    silos = await cluster(2, stats_interval_s=0.2, membership=CALM)
    await asyncio.gather(*(client.get_grain(Echo, f"e{i % 20}").echo(i) for i in range(300)))
    await asyncio.gather(*(client.get_grain(Counter, f"c{i % 5}").add(1) for i in range(50)))
    await publish_synthetic_job(silos, silos[0].redis, silos[0].keys, "digits-1", steps=60)
    await publish_regression_job(silos[0].redis, silos[0].keys, "regress-1", steps=40)
    for silo in silos:
        await silo.stats_publisher.publish()  # the figures below are in Redis now

    board = DashboardThread(redis_url, cluster_name, port=free_port()).start()
    try:
        async with browser_page(900) as page:
            await page.goto(board.url + "/#/overview")
            await page.wait_for_function(
                "document.querySelector('[data-testid=calls-total]')?.textContent === '350'"
            )
            assert await page.text_content("[data-testid=silos-live]") == "2"
            assert "Redis OK" in (await page.text_content("#conn-text") or "")
            await page.wait_for_selector(
                "[data-testid=overview-chart][data-points]:not([data-points='0'])"
            )
            await page.screenshot(path=str(ARTIFACTS / "dashboard-overview.png"), full_page=True)

            await page.goto(board.url + "/#/silos")
            await page.wait_for_selector("[data-testid=silo-table]")
            rows = await page.locator("[data-testid=silo-table] tbody tr").evaluate_all(
                "rows => rows.map(r => r.dataset.silo)"
            )
            assert sorted(rows) == sorted(str(s.address) for s in silos)
            await page.screenshot(path=str(ARTIFACTS / "dashboard-silos.png"), full_page=True)

            await page.goto(board.url + f"/#/silos/{silos[0].address}")
            await page.wait_for_selector("[data-testid=cpu-chart]:not([data-points='0'])")
            await page.screenshot(path=str(ARTIFACTS / "dashboard-silo.png"), full_page=True)

            await page.goto(board.url + "/#/methods")
            await page.wait_for_selector("[data-method='Echo.echo']")
            assert await page.text_content("[data-method='Echo.echo'] [data-col=calls]") == "300"
            assert await page.text_content("[data-method='Counter.add'] [data-col=calls]") == "50"
            await page.click("th[data-sort=method]")  # sorts by name: add before echo
            await page.wait_for_function(
                "document.querySelector('[data-testid=methods-table] tbody tr')?.dataset.method === 'Counter.add'"
            )
            await page.screenshot(path=str(ARTIFACTS / "dashboard-methods.png"), full_page=True)

            await page.goto(board.url + "/#/grains")
            await page.wait_for_selector("[data-testid=grains-by-type]")
            await page.screenshot(path=str(ARTIFACTS / "dashboard-grains.png"), full_page=True)
            await page.goto(board.url + "/#/grains/Counter/c1")
            await page.wait_for_selector("[data-testid=grain-state]")
            assert "10" in (await page.text_content("[data-testid=grain-state]") or "")

            await page.goto(board.url + "/#/training")
            await page.wait_for_selector("[data-testid=jobs-table]")
            listed = await page.text_content("[data-testid=jobs-table]") or ""
            assert "r2 0.975" in listed and "accuracy 96.0 %" in listed  # each job's evaluation by name

            await page.goto(board.url + "/#/training/digits-1")
            curve = "[data-testid=metric-curve][data-metric={}] path.series[data-series={}]"
            loss = page.locator(curve.format("loss", "train"))
            await loss.wait_for()
            assert int(await loss.get_attribute("data-points") or 0) == 61
            # Evaluation points are their own series: one per evaluation, never a training point.
            eval_loss = page.locator(curve.format("loss", "eval"))
            assert int(await eval_loss.get_attribute("data-points") or 0) == 6
            train_acc = page.locator(curve.format("accuracy", "train"))
            eval_acc = page.locator(curve.format("accuracy", "eval"))
            assert int(await train_acc.get_attribute("data-points") or 0) == 60
            assert int(await eval_acc.get_attribute("data-points") or 0) == 6
            eval_card = page.locator(".card[data-split=eval][data-metric=accuracy] .value")
            assert await eval_card.text_content() == "96.0 %"  # 1 - 0.8 e^-3, at step 60
            assert await page.text_content("[data-testid=job-epoch]") == "3.00"
            assert await page.text_content("[data-testid=job-staleness]") == "3"
            assert await page.text_content("[data-testid=job-step]") == "60 / 200"
            assert await page.locator("[data-testid=trainers] tbody tr").count() == 4
            assert await page.locator("[data-testid=checkpoints] tbody tr").count() == 2
            assert "0.42 s" in (await page.text_content("[data-testid=recoveries]") or "")
            await page.screenshot(path=str(ARTIFACTS / "dashboard-training.png"), full_page=True)

            await page.goto(board.url + "/#/training/regress-1")
            r2 = page.locator(curve.format("r2", "eval"))
            await r2.wait_for()
            assert int(await r2.get_attribute("data-points") or 0) == 8
            assert await page.locator(curve.format("r2", "train")).count() == 0
            assert int(await page.locator(curve.format("mse", "train")).get_attribute("data-points") or 0) == 40
            assert int(await page.locator(curve.format("mse", "eval")).get_attribute("data-points") or 0) == 8
            assert await page.locator("[data-testid=metric-curve][data-metric=accuracy]").count() == 0
            r2_card = page.locator(".card[data-split=eval][data-metric=r2] .value")
            assert await r2_card.text_content() == "0.975"  # 1 - 1/40, 4 significant digits
            await page.screenshot(path=str(ARTIFACTS / "dashboard-training-regression.png"), full_page=True)

            await page.goto(board.url + "/#/events")
            await page.wait_for_selector("[data-testid=events-table] .pill.join")
            await page.screenshot(path=str(ARTIFACTS / "dashboard-events.png"), full_page=True)
    finally:
        board.stop()


async def test_the_overview_warns_while_a_redis_master_has_fewer_replicas_than_wait_replicas(
    cluster, client: ClusterClient, redis_url: str, cluster_name: str
) -> None:
    # A failover's promoted master has no replica: writes are acknowledged unreplicated, which
    # only the counter showed (issue 39). The test's Redis has no replica at all.
    await cluster(1, redis_url=f"{redis_url}?wait_replicas=1&wait_timeout_ms=200")
    await client.refresh()
    for i in range(5):
        await client.get_grain(Counter, f"c{i}").add()
    board = DashboardThread(redis_url, cluster_name, port=free_port()).start()
    try:
        async with browser_page(900, page_errors=True) as page:
            await page.goto(board.url + "/#/overview")
            warning = page.locator("[data-testid=overview-warning]")
            await warning.wait_for()
            text = await warning.text_content() or ""
            assert "1 silo(s) see a Redis master with fewer connected replicas than wait_replicas" in text, text
            assert int(re.search(r"\((\d+) so far", text).group(1)) >= 5, text  # type: ignore[union-attr]
            await page.screenshot(path=str(ARTIFACTS / "dashboard-replica-warning.png"))
    finally:
        board.stop()


async def test_page_says_no_silos_then_redis_unreachable_then_recovers(
    fresh_redis: RedisServer,
) -> None:
    board = DashboardThread(fresh_redis.url, "empty", port=free_port()).start()
    try:
        async with browser_page(700, page_errors=True) as page:
            await page.goto(board.url + "/#/overview")
            notice = page.locator("[data-testid=overview-message]")
            await notice.wait_for()
            assert "No silos have joined" in (await notice.text_content() or "")
            banner = page.locator("#banner")
            assert await banner.is_hidden()

            fresh_redis.kill()
            await banner.wait_for(state="visible")
            assert "Redis unreachable" in (await banner.text_content() or "")
            await page.screenshot(path=str(ARTIFACTS / "dashboard-redis-down.png"))

            fresh_redis.start()
            await banner.wait_for(state="hidden")
            assert "Redis OK" in (await page.text_content("#conn-text") or "")
    finally:
        board.stop()


async def test_reminders_and_logs_pages_list_rows_filter_and_tail_live(
    cluster, client: ClusterClient, redis_url: str, cluster_name: str
) -> None:
    from grains.ids import GrainId
    from silo.settings import RemindersSettings
    from tests.dashboard.grains import Grumbler
    from tests.sample_grains import Reminded

    silos = await cluster(
        2,
        grains=("tests.sample_grains", "tests.dashboard.grains"),
        membership=CALM,
        reminders=RemindersSettings(poll_interval_s=0.05),
    )
    reminded = client.get_grain(Reminded, "r1")
    await reminded.start(0.2)
    await silos[0].reminders.register(GrainId("Billing", "acct-7"), "invoice", 3600.0)
    grumbler = client.get_grain(Grumbler, "g")
    where = await grumbler.grumble("first")

    board = DashboardThread(redis_url, cluster_name, port=free_port()).start()
    try:
        async with browser_page(800) as page:
            await page.goto(board.url + "/#/reminders")
            row = "[data-testid=reminders-table] tr[data-reminder='{}']"
            ticked = page.locator(row.format("Reminded/r1/tick") + " [data-col=silo] a")
            await ticked.wait_for()  # shown once its first tick has run and been recorded
            assert await ticked.text_content() == await reminded.where()
            assert await page.text_content(row.format("Reminded/r1/tick") + " [data-col=period]") == "200 ms"
            billing = row.format("Billing/acct-7/invoice")
            assert "not yet" in (await page.text_content(billing + " [data-col=last-fired]") or "")
            assert await page.text_content(billing + " [data-col=period]") == "1h 0m"
            await page.screenshot(path=str(ARTIFACTS / "dashboard-reminders.png"), full_page=True)
            await page.select_option("[data-testid=reminder-type]", "Billing")
            await page.wait_for_function(
                "document.querySelectorAll('[data-testid=reminders-table] tbody tr').length === 1"
            )
            assert await page.locator(billing).count() == 1

            await page.goto(board.url + "/#/logs")
            message = "[data-testid=logs-table] tr:has(td.message:text-is('grumble: {}'))"
            first = page.locator(message.format("first"))
            await first.wait_for()
            assert await first.get_attribute("data-silo") == where
            assert await first.get_attribute("data-level") == "WARNING"
            await grumbler.grumble("live")  # no reload: the page's one-second tail picks it up
            await page.locator(message.format("live")).wait_for()
            # Newest first. Not "live is the top row": the silos may log meanwhile (a run had a
            # line a second after it there).
            rows = await page.eval_on_selector_all(
                "[data-testid=logs-table] tbody tr",
                "rows => rows.map(r => [r.dataset.id, r.querySelector('td.message')?.textContent])",
            )
            ids = [tuple(int(part) for part in rid.split("-")) for rid, _ in rows]
            assert ids == sorted(ids, reverse=True), rows
            messages = [text for _, text in rows]
            assert messages.index("grumble: live") < messages.index("grumble: first"), rows
            await page.screenshot(path=str(ARTIFACTS / "dashboard-logs.png"), full_page=True)

            await page.select_option("[data-testid=log-level]", "ERROR")
            await page.locator(message.format("first")).wait_for(state="detached")
            broke_on = await grumbler.grumble("broken", "ERROR")  # the rebalancer may have moved it
            await page.locator(message.format("broken")).wait_for()
            other = next(str(s.address) for s in silos if str(s.address) != broke_on)
            await page.select_option("[data-testid=log-silo]", other)
            await page.locator(message.format("broken")).wait_for(state="detached")
    finally:
        board.stop()
        await reminded.stop()


async def test_grain_type_and_silo_pages_show_their_own_method_stats(
    cluster, client: ClusterClient, redis_url: str, cluster_name: str
) -> None:
    from silo import errors as rg_errors
    from silo.settings import RebalancerSettings
    from tests.sample_grains import RandomEcho

    # Placed at random (both silos serve some, but for a 1-in-128 draw) and not rebalanced:
    # each grain stays where it was first activated, so the calls it served are that silo's.
    silos = await cluster(2, membership=CALM, rebalancer=RebalancerSettings(enabled=False))
    keys = [f"m{i}" for i in range(8)]
    home = {k: await client.get_grain(RandomEcho, k).where() for k in keys}
    for i, k in enumerate(keys):
        grain = client.get_grain(RandomEcho, k)
        await asyncio.gather(*(grain.echo(n) for n in range(5 + i)))
        if i % 3 == 0:
            with pytest.raises(rg_errors.RemoteGrainError):
                await grain.fail("on purpose")
    await client.get_grain(Counter, "c").add(1)
    addresses = [str(s.address) for s in silos]
    echoes = {a: sum(5 + i for i, k in enumerate(keys) if home[k] == a) for a in addresses}
    failures = {a: sum(1 for i, k in enumerate(keys) if i % 3 == 0 and home[k] == a) for a in addresses}
    assert sum(echoes.values()) == 68

    board = DashboardThread(redis_url, cluster_name, port=free_port()).start()
    try:
        async with browser_page(900) as page:
            # The grain type's page: its own methods only, merged over both silos.
            await page.goto(board.url + "/#/grains/RandomEcho")
            table = "[data-testid=type-methods]"
            cell = table + " [data-method='RandomEcho.{}'] [data-col={}]"
            await page.wait_for_function(
                f"document.querySelector(\"{cell.format('echo', 'calls')}\")?.textContent === '68'"
            )
            assert await page.text_content(cell.format("fail", "errors")) == "3"
            assert await page.text_content(cell.format("where", "calls")) == "8"
            assert await page.locator(table + " [data-method='Counter.add']").count() == 0
            assert re.fullmatch(r"[0-9.]+ (µs|ms|s)", await page.text_content(cell.format("echo", "p99_ms")) or "")
            # The page keeps its key box; only the table is redrawn, live.
            await page.fill("#grain-key", "m1")
            await client.get_grain(RandomEcho, "m1").echo("again")
            await page.wait_for_function(
                f"document.querySelector(\"{cell.format('echo', 'calls')}\")?.textContent === '69'"
            )
            assert await page.input_value("#grain-key") == "m1"
            await page.screenshot(path=str(ARTIFACTS / "dashboard-grain-type.png"), full_page=True)

            # Each silo's page: only the calls that silo served.
            extra = {a: 1 if a == home["m1"] else 0 for a in addresses}
            for address in addresses:
                await page.goto(board.url + f"/#/silos/{address}")
                cell = "[data-testid=silo-methods] [data-method='RandomEcho.{}'] [data-col={}]"
                want = echoes[address] + extra[address]
                if not want:  # placement put every Echo grain on the other silo
                    await page.wait_for_selector("[data-testid=silo-methods], [data-testid=silo-methods-empty]")
                    assert await page.locator(cell.format("echo", "calls")).count() == 0
                    continue
                await page.wait_for_function(
                    f"document.querySelector(\"{cell.format('echo', 'calls')}\")?.textContent === '{want}'"
                )
                if failures[address]:
                    assert await page.text_content(cell.format("fail", "errors")) == str(failures[address])
                else:
                    assert await page.locator(cell.format("fail", "errors")).count() == 0
            await page.screenshot(path=str(ARTIFACTS / "dashboard-silo-methods.png"), full_page=True)
    finally:
        board.stop()
