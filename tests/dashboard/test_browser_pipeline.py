"""A real pipeline job on the dashboard's job page, in headless Chromium: its stages, their
silos and times, and the latest step's micro-batch timeline."""

from __future__ import annotations

from dashboard.server import DashboardThread
from grains.training import CoordinatorGrain, TrainingJob
from silo.client import ClusterClient
from tests.browser import ARTIFACTS, browser_page
from tests.dashboard.conftest import CALM
from tests.grains.training.conftest import GRAINS, run_job
from tests.helpers import free_port


async def test_the_job_page_shows_the_stages_and_a_micro_batch_timeline(
    cluster, client: ClusterClient, redis_url: str, cluster_name: str
) -> None:
    await cluster(2, grains=GRAINS, membership=CALM)
    spec = TrainingJob(model_args={"hidden": [64, 64]}, mode="pipeline", trainers=1, stages=2, microbatches=4,
                       steps=20, batch_size=32)  # fmt: skip
    st = await run_job(client, "pipe-page", spec)
    assert st.status == "completed" and len(st.stages) == 2, st
    assert (await client.get_grain(CoordinatorGrain, "pipe-page").status()).stages

    board = DashboardThread(redis_url, cluster_name, port=free_port()).start()
    try:
        async with browser_page(900) as page:
            await page.goto(board.url + "/#/training/pipe-page")
            await page.wait_for_selector("[data-testid=stages] tbody tr")
            rows = await page.locator("[data-testid=stages] tbody tr").all_text_contents()
            assert len(rows) == 2 and all(silo in " ".join(rows) for silo in st.trainer_silos), rows
            assert all("ms" in r and "KiB" in r for r in rows), rows  # per-micro-batch times, parameter bytes
            spans = await page.locator("[data-testid=microbatch-timeline] rect").evaluate_all(
                "rs => rs.map(r => r.dataset.kind + r.dataset.mb)"
            )
            assert sorted(spans) == sorted(f"{k}{m}" for k in "FB" for m in range(4) for _ in range(2)), spans
            await page.screenshot(path=str(ARTIFACTS / "dashboard-pipeline.png"), full_page=True)
    finally:
        board.stop()
