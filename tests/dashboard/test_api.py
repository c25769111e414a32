"""The dashboard's JSON API and /metrics against a real in-process cluster."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest
import redis
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict

from dashboard import models as m
from dashboard.app import create_app
from grains.ids import GrainId
from grains.training.api.records import JobProgress, Placement, publish_job_progress
from silo import errors
from silo.client import ClusterClient
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.records.events import EventLog, read_events
from silo.redis_util import connect_redis
from silo.settings import StorageSettings
from silo.storage.store import RedisStateStore
from silo.testing.embedded import RedisServer
from tests.dashboard.conftest import ADMIN_TOKEN, CALM
from tests.sample_grains import Counter, Echo

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def until(
    api: TestClient, path: str, check: Callable[[dict], bool], timeout_s: float = 15.0
) -> dict:
    """GET ``path`` until ``check`` holds: the silos publish on their own schedule, in this loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = api.get(path).json()
        if check(body):
            return body
        assert time.monotonic() < deadline, f"{path} never satisfied the check; last: {body}"
        await asyncio.sleep(0.05)  # lets the silos (same event loop) run and publish


async def test_after_1000_calls_the_dashboard_reports_1000(
    cluster, client: ClusterClient, api: TestClient
) -> None:
    await cluster(2, stats_interval_s=0.1, membership=CALM)
    await asyncio.gather(*(client.get_grain(Echo, f"k{i % 40}").echo(i) for i in range(1000)))
    # No forced publish: the publishers' own once-an-interval records must carry it.
    body = await until(api, "/api/methods", lambda b: any(r["calls"] == 1000 for r in b["rows"]))
    (row,) = m.Methods.model_validate(body).rows
    assert (row.grain_type, row.method, row.calls, row.errors) == ("Echo", "echo", 1000, 0)
    overview = m.Overview.model_validate(api.get("/api/overview").json())
    assert (
        overview.calls_total == 1000
        and overview.activations == 40
        and overview.silos == {"Active": 2}
    )


async def test_every_endpoint_returns_its_documented_model(
    cluster, client: ClusterClient, api: TestClient, redis_url: str, cluster_name: str
) -> None:
    silos = await cluster(2, stats_interval_s=0.2, membership=CALM)
    await asyncio.gather(*(client.get_grain(Echo, f"e{i % 10}").echo(i) for i in range(200)))
    await asyncio.gather(*(client.get_grain(Counter, f"c{i % 4}").add(2) for i in range(40)))
    for i in range(10):
        with pytest.raises(errors.RemoteGrainError, match="boom"):
            await client.get_grain(Echo, "bad").fail(f"boom {i}")
    keys = Keys(cluster_name)
    await publish_job_progress(silos[0].redis, keys, JobProgress(job="j1", step=3, loss=0.5,
                               trainers=[Placement(key="j1/trainer-0", silo=str(silos[0].address))]))  # fmt: skip
    for silo in silos:
        await silo.stats_publisher.publish()  # everything above is in the records now

    overview = m.Overview.model_validate(api.get("/api/overview").json())
    assert overview.redis.ok and overview.message is None
    assert (overview.silos_live, overview.calls_total, overview.errors_total, overview.jobs) == (
        2,
        250,
        10,
        1,
    )
    assert overview.activations == 10 + 4 + 1
    assert 0 < overview.p50_ms <= overview.p99_ms

    silo_list = m.SiloList.model_validate(api.get("/api/silos").json())
    assert sorted(s.address for s in silo_list.silos) == sorted(str(s.address) for s in silos)
    assert sum(s.activations for s in silo_list.silos) == overview.activations
    assert sum(s.calls_total for s in silo_list.silos) == 250
    assert all(s.published and s.status == "Active" and s.rss_bytes > 0 for s in silo_list.silos)

    detail = m.SiloDetail.model_validate(api.get(f"/api/silos/{silos[0].address}").json())
    assert detail.history and detail.history[-1].activations == detail.silo.activations
    assert (
        "transport" in detail.components and sum(detail.by_type.values()) == detail.silo.activations
    )
    assert api.get("/api/silos/nowhere:1@1").status_code == 404

    grains = m.Grains.model_validate(api.get("/api/grains").json())
    by_type = {r.type: r for r in grains.by_type}
    assert by_type["Echo"].activations == 11 and by_type["Counter"].activations == 4
    assert by_type["Counter"].persisted and not by_type["Echo"].persisted
    keys_view = m.GrainKeys.model_validate(api.get("/api/grains/Counter").json())
    assert keys_view.persisted == ["c0", "c1", "c2", "c3"] == keys_view.active
    state = m.GrainState.model_validate(api.get("/api/grains/Counter/c1/state").json())
    assert state.found and state.size > 0 and state.state["value"] == 20  # 10 adds of 2
    assert not m.GrainState.model_validate(api.get("/api/grains/Counter/nope/state").json()).found

    methods = m.Methods.model_validate(api.get("/api/methods").json())
    rows = {(r.grain_type, r.method): r for r in methods.rows}
    assert rows[("Echo", "echo")].calls == 200 and rows[("Counter", "add")].calls == 40
    assert rows[("Echo", "fail")].errors == 10 and rows[("Echo", "fail")].error_percent == 100.0
    echo_only = m.Methods.model_validate(api.get("/api/methods?grain_type=Echo").json()).rows
    assert {r.method for r in echo_only} == {"echo", "fail"}
    per_silo = [
        m.Methods.model_validate(api.get("/api/methods", params={"silo": str(s.address)}).json()).rows
        for s in silos
    ]
    for key, row in rows.items():  # each silo's rows are its own: they add up to the merged row
        parts = [r for part in per_silo for r in part if (r.grain_type, r.method) == key]
        assert sum(r.calls for r in parts) == row.calls and sum(r.errors for r in parts) == row.errors
    assert m.Methods.model_validate(api.get("/api/methods?silo=10.9.9.9:1").json()).rows == []

    jobs = m.JobList.model_validate(api.get("/api/jobs").json())
    assert [j.job for j in jobs.jobs] == ["j1"]
    job = m.JobDetail.model_validate(api.get("/api/jobs/j1").json())
    assert job.progress.trainers[0].silo == str(silos[0].address) and [
        p.step for p in job.history
    ] == [3]
    assert api.get("/api/jobs/none").status_code == 404

    events = m.EventList.model_validate(api.get("/api/events").json())
    assert sorted(e.silo for e in events.events if e.kind == "join") == sorted(
        str(s.address) for s in silos
    )
    assert m.EventList.model_validate(api.get("/api/events?kind=dead").json()).events == []

    openapi = api.get("/openapi.json").json()
    for path in (
        "/api/overview",
        "/api/silos/{address}",
        "/api/methods",
        "/api/jobs/{job}",
        "/api/events",
    ):
        assert path in openapi["paths"]
    assert api.get("/docs").status_code == 200
    assert "<title>redgrain dashboard</title>" in api.get("/").text
    assert api.get("/static/app.js").status_code == 200


async def test_methods_sort_by_each_columns_own_value(
    cluster, client: ClusterClient, api: TestClient
) -> None:
    silos = await cluster(1, membership=CALM)
    await asyncio.gather(*(client.get_grain(Echo, "a").echo(i) for i in range(30)))  # many, fast
    for _ in range(3):
        await client.get_grain(Echo, "a").sleep(0.03)  # few, slow
    await silos[0].stats_publisher.publish()
    by_calls = api.get("/api/methods?sort=calls&order=desc").json()["rows"]
    by_p99 = api.get("/api/methods?sort=p99_ms&order=desc").json()["rows"]
    by_name = api.get("/api/methods?sort=method&order=asc").json()["rows"]
    assert [r["method"] for r in by_calls] == ["echo", "sleep"]
    assert [r["method"] for r in by_p99] == ["sleep", "echo"]
    assert [r["method"] for r in by_name] == ["echo", "sleep"]
    assert api.get("/api/methods?sort=nonsense").status_code == 422


async def test_with_no_silos_the_api_says_so(api: TestClient) -> None:
    overview = m.Overview.model_validate(api.get("/api/overview").json())
    assert overview.redis.ok and overview.silos_live == 0 and "No silos" in (overview.message or "")
    assert api.get("/api/silos").json()["silos"] == []
    assert api.get("/api/methods").json()["rows"] == []
    assert api.get("/api/grains").json() == {"by_type": [], "by_silo": []}
    families = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
    assert families["redgrain_redis_up"].samples[0].value == 1.0


async def test_redis_down_is_reported_and_recovers(fresh_redis: RedisServer) -> None:
    keys = Keys("down")
    r = redis.Redis.from_url(fresh_redis.url)
    r.set(keys.job_progress("j"), JobProgress(job="j", step=7).model_dump_json())
    r.sadd(keys.jobs, "j")
    r.close()
    with TestClient(create_app(fresh_redis.url, "down", cache_s=0.0, redis_timeout_s=0.5)) as api:
        assert api.get("/api/overview").json()["redis"]["ok"] is True
        fresh_redis.kill()
        overview = m.Overview.model_validate(api.get("/api/overview").json())
        assert not overview.redis.ok and "unreachable" in (overview.redis.error or "")
        down = api.get("/api/jobs")
        assert down.status_code == 503 and "Redis unreachable" in down.json()["detail"]
        metrics = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
        assert metrics["redgrain_redis_up"].samples[0].value == 0.0
        fresh_redis.start()
        assert api.get("/api/overview").json()["redis"]["ok"] is True
        assert api.get("/api/jobs").json()["jobs"][0]["step"] == 7  # AOF kept it


async def test_admin_actions_need_the_token_on_every_request(
    cluster, api: TestClient, redis_url: str, cluster_name: str
) -> None:
    (silo,) = await cluster(1, membership=CALM)
    keys = Keys(cluster_name)
    await publish_job_progress(silo.redis, keys, JobProgress(job="j2", step=1))
    drain = f"/api/silos/{silo.address}/drain"
    with TestClient(create_app(redis_url, cluster_name)) as read_only:
        refused = read_only.post(drain, headers=AUTH)
        assert refused.status_code == 403 and "read-only" in refused.json()["detail"]
        assert read_only.post("/api/jobs/j2/cancel", headers=AUTH).status_code == 403
    assert api.post(drain).status_code == 403
    assert api.post(drain, headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert (
        api.post("/api/jobs/j2/cancel", headers={"Authorization": ADMIN_TOKEN}).status_code == 403
    )
    assert await silo.redis.llen(keys.control(str(silo.address))) == 0
    assert not await publish_job_progress(silo.redis, keys, JobProgress(job="j2", step=2))

    assert m.AdminResult.model_validate(api.post(drain, headers=AUTH).json()).ok
    # Queued for the silo, or already taken by it (its inbox polls every 0.25 s; its count
    # moves just after its pop returns, which on a loaded machine can take a while).
    queued = await silo.redis.lrange(keys.control(str(silo.address)), 0, -1)
    if not queued:
        for _ in range(500):
            if silo.control.received:
                break
            await asyncio.sleep(0.01)
    assert [json.loads(c)["command"] for c in queued] == ["drain"] or silo.control.received == 1
    assert api.post("/api/silos/nowhere:1@1/drain", headers=AUTH).status_code == 404
    assert api.post("/api/jobs/j2/cancel", headers=AUTH).json()["ok"] is True
    assert await publish_job_progress(
        silo.redis, keys, JobProgress(job="j2", step=3)
    )  # the coordinator sees it
    assert api.get("/api/jobs/j2").json()["cancel_requested"] is True
    assert api.post("/api/jobs/none/cancel", headers=AUTH).status_code == 404
    found = await until(
        api, "/api/events", lambda b: {"drain", "cancel"} <= {e["kind"] for e in b["events"]}
    )
    assert any(
        e["kind"] == "drain" and e["data"].get("target") == str(silo.address) for e in found["events"]
    )


async def test_metrics_parse_as_prometheus_text(
    cluster, client: ClusterClient, api: TestClient
) -> None:
    silos = await cluster(2, membership=CALM)
    await asyncio.gather(*(client.get_grain(Echo, f"m{i % 8}").echo(i) for i in range(120)))
    for silo in silos:
        await silo.stats_publisher.publish()
    response = api.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    calls = [s for s in families["redgrain_calls"].samples if s.name == "redgrain_calls_total"]
    assert [(s.labels["method"], s.value) for s in calls] == [("echo", 120.0)]
    latency = families["redgrain_call_duration_seconds"].samples
    inf = [s for s in latency if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    assert inf[0].value == 120.0
    assert sum(s.value for s in families["redgrain_activations"].samples) == 8
    assert {s.labels["silo"] for s in families["redgrain_silo_rss_bytes"].samples} == {
        str(s.address) for s in silos
    }
    assert families["redgrain_silos"].samples  # one per status


class Weights(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    name: str
    w: torch.Tensor
    steps: tuple[int, ...]


async def test_persisted_state_of_an_unknown_type_shows_as_json_with_tensor_summaries(
    redis_url: str, cluster_name: str, api: TestClient
) -> None:
    registry = TypeRegistry()
    registry.register(Weights, "tests.Weights")
    encoded = Codec(registry).encode(
        Weights(name="layer", w=torch.arange(6, dtype=torch.float32).view(2, 3), steps=(1, 2))
    )
    r = connect_redis(redis_url)
    store = RedisStateStore(r, Keys(cluster_name), StorageSettings.model_validate({}))
    await store.write(GrainId("Trainer", "job/trainer-0"), encoded, None, 0)
    await r.aclose()
    body = m.GrainState.model_validate(api.get("/api/grains/Trainer/job/trainer-0/state").json())
    assert body.found and body.error is None
    assert (
        body.state["__type__"] == "tests.Weights"
        and body.state["name"] == "layer"
        and body.state["steps"] == [1, 2]
    )
    tensor = body.state["w"]
    assert (tensor["kind"], tensor["dtype"], tensor["shape"]) == ("tensor", "float32", [2, 3])
    assert tensor["summary"]["mean"] == 2.5 and tensor["summary"]["head"] == [
        0.0,
        1.0,
        2.0,
        3.0,
        4.0,
        5.0,
    ]


async def test_event_log_emit_lands_in_the_capped_stream(redis_url: str, cluster_name: str) -> None:
    r = connect_redis(redis_url)
    keys = Keys(cluster_name)
    log = EventLog(r, keys, "tester")
    log.emit("suspect", target="a:1@1", voters=2)
    log.on_event("dead", {"target": "a:1@1"})
    await log.flush()
    events = await read_events(r, keys)
    assert [(e.kind, e.silo, e.data) for e in events] == [
        ("dead", "tester", {"target": "a:1@1"}),
        ("suspect", "tester", {"target": "a:1@1", "voters": 2}),
    ]
    assert log.statistics().written == 2
    await r.aclose()
