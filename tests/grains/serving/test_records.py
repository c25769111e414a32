"""What replicas publish: the dashboard's /api/models and the serving families on /metrics."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient

from dashboard.app import create_app as dashboard_app
from grains.serving import ModelGrain, ServeSpec, deploy
from tests.grains.serving.conftest import GRAINS, train_digits


async def test_models_api_shows_replicas_versions_rates_and_batches(cluster, client, redis_url, cluster_name, digits_test):
    await cluster(2, grains=GRAINS)
    st = await train_digits(client, steps=10)
    await deploy(client, "digits", ServeSpec(job="digits"))
    model = client.get_grain(ModelGrain, "digits")
    x, _ = digits_test
    await asyncio.gather(*(model.predict(x[i : i + 1]) for i in range(200)))
    app = dashboard_app(redis_url, cluster_name, cache_s=0.0)
    with TestClient(app) as api:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:  # replicas publish once a second
            body = (await asyncio.to_thread(api.get, "/api/models")).json()
            models = body["models"]
            if models and models[0]["requests"] >= 200 and models[0]["ready_replicas"] == 2:
                break
            assert loop.time() < deadline, body
            await asyncio.sleep(0.2)
        m = models[0]
        assert m["name"] == "digits" and m["versions"] == [f"digits step {st.step}"]
        assert {r["silo"] for r in m["replicas"]} == {str(s.address) for s in cluster_silos(client)}
        assert m["errors"] == 0 and m["p99_ms"] > 0 and m["mean_batch_rows"] >= 1
        assert sum(m["batch_rows"]) == sum(r["batches"] for r in m["replicas"])
        assert (await asyncio.to_thread(api.get, "/api/models/digits")).json()["name"] == "digits"
        assert (await asyncio.to_thread(api.get, "/api/models/nope")).status_code == 404
        # The same records as Prometheus families on the dashboard's /metrics.
        text = (await asyncio.to_thread(api.get, "/metrics")).text
    assert 'redgrain_inference_replicas{model="digits",ready="true"} 2.0' in text
    assert 'redgrain_inference_batch_rows_count{model="digits"}' in text
    assert 'redgrain_inference_latency_seconds_bucket{le="+Inf",model="digits"} 200.0' in text

    # The Models page in a real browser (the dashboard tests' harness).

    from dashboard.server import DashboardThread
    from tests.browser import ARTIFACTS, browser_page
    from tests.helpers import free_port

    board = DashboardThread(redis_url, cluster_name, port=free_port()).start()
    try:
        async with browser_page(800) as page:
            await page.goto(board.url + "/#/models")
            row = page.locator("[data-testid=models-table] tbody tr")
            await row.wait_for()
            text = await row.text_content() or ""
            assert "digits" in text and "2 ready of 2" in text and f"digits step {st.step}" in text, text
            replicas = page.locator("[data-testid=replicas-digits] tbody tr")
            assert await replicas.count() == 2
            assert "ready" in (await replicas.first.text_content() or "")
            await page.screenshot(path=str(ARTIFACTS / "dashboard-models.png"), full_page=True)
    finally:
        board.stop()


def cluster_silos(client):  # the silos the client sees hosting the model grain
    return [r for r in client.view.hosting("ModelGrain")]
