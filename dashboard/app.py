"""The dashboard: a FastAPI app over what silos publish to Redis.

``create_app(redis_url, cluster, admin_token=None)`` returns the app: the JSON
API under ``/api/`` (OpenAPI at ``/docs``), Prometheus text at ``/metrics``
and the single page at ``/``. It reads only the records silos write once a
second, so an open dashboard adds nothing to any call path. Without an
admin token it is read-only; with one, POST ``/api/silos/{address}/drain``
and ``/api/jobs/{job}/cancel`` need ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from dashboard import models as m
from dashboard import reader as rd
from dashboard.metrics import ClusterCollector
from dashboard.serving import router as serving_router
from dashboard.state_view import decoder, to_json
from grains.ids import GrainId
from grains.serving.records import WORKLOAD as SERVING
from grains.serving.records import read_models
from grains.training.api.records import JobPoint, JobProgress, read_jobs
from silo import errors
from silo.keys import Keys
from silo.records.control import request_cancel, request_drain
from silo.records.events import EventLog, read_events
from silo.records.logs import read_logs
from silo.records.membership import LIVE
from silo.records.reminders import read_reminders
from silo.records.streams import read_dead_letters, read_streams
from silo.redis_util import connect_redis, open_redis, redis_errors
from silo.settings import StorageSettings
from silo.storage.store import RedisStateStore

STATIC = resources.files("dashboard") / "static"
MAX_STATE_BYTES = 64 << 20
"""Larger persisted states are described, not decoded (the viewer is for looking, not dumping)."""


def _reader(request: Request) -> rd.ClusterReader:
    return request.app.state.reader  # type: ignore[no-any-return]


Reader = Annotated[rd.ClusterReader, Depends(_reader)]


def create_app(
    redis_url: str,
    cluster: str,
    admin_token: str | None = None,
    *,
    poll_ms: int = 1000,
    cache_s: float = 0.5,
    redis_timeout_s: float = 1.0,
) -> FastAPI:
    keys = Keys(cluster)
    collector = ClusterCollector(cluster)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The client is made on the server's own loop, and short timeouts
        # make a dead Redis show within a poll instead of hanging the page.
        try:  # a redis:// URL of a Redis Cluster node gives the cluster client
            redis = await open_redis(redis_url, "dashboard connect", timeout_s=redis_timeout_s)
        except errors.StorageError:  # Redis down: the pages say so (503) until it is back
            redis = connect_redis(redis_url, timeout_s=redis_timeout_s)
        app.state.reader = rd.ClusterReader(redis, keys, cache_s=cache_s)
        app.state.events = EventLog(redis, keys, "dashboard")
        try:
            yield
        finally:
            await app.state.events.flush()
            await redis.aclose()

    app = FastAPI(
        title="redgrain dashboard",
        description=f"Cluster '{cluster}': silos, grains, calls and training, from what silos publish.",
        version="1",
        lifespan=lifespan,
    )

    @app.exception_handler(errors.StorageError)
    async def _redis_down(request: Request, exc: errors.StorageError) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "redis": False}, status_code=503)

    @app.exception_handler(errors.ConfigError)
    async def _bad_input(request: Request, exc: errors.ConfigError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    def require_admin(request: Request) -> None:
        """Checked on every admin request: a configured token, sent as a Bearer header."""
        if admin_token is None:
            raise HTTPException(
                403, "read-only dashboard: start it with --admin-token to allow admin actions"
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), admin_token.encode()
        ):
            raise HTTPException(403, "admin token missing or wrong")

    # --- read-only API -------------------------------------------------------

    @app.get("/api/config", response_model=m.Config, tags=["cluster"])
    async def config() -> m.Config:
        return m.Config(cluster=cluster, admin=admin_token is not None, poll_ms=poll_ms)

    @app.get("/api/overview", response_model=m.Overview, tags=["cluster"])
    async def overview(r: Reader) -> m.Overview:
        """Always 200: when Redis is down, ``redis.ok`` is false and says why."""
        try:
            snap = await r.snapshot()
        except errors.StorageError as exc:
            return m.Overview(cluster=cluster, at=time.time(), redis=rd.redis_down(exc),
                              message="Redis unreachable: " + str(exc))  # fmt: skip
        return rd.overview(
            cluster, snap, m.RedisStatus(ok=True, latency_ms=round(snap.latency_ms, 3))
        )

    @app.get("/api/silos", response_model=m.SiloList, tags=["cluster"])
    async def silos(r: Reader) -> m.SiloList:
        snap = await r.snapshot()
        rows = sorted(snap.members.values(), key=lambda x: (x.status not in LIVE, x.address))
        return m.SiloList(
            redis=m.RedisStatus(ok=True, latency_ms=round(snap.latency_ms, 3)),
            silos=[rd.silo_summary(row, snap.records.get(row.address), snap.at) for row in rows],
        )

    @app.get("/api/silos/{address}", response_model=m.SiloDetail, tags=["cluster"],
             responses={404: {"description": "No such silo"}})  # fmt: skip
    async def silo(address: str, r: Reader) -> m.SiloDetail:
        snap = await r.snapshot()
        row = snap.members.get(address)
        if row is None:
            raise HTTPException(404, f"no silo {address} in cluster {cluster}")
        rec = snap.records.get(address) if row.status in LIVE else None
        return m.SiloDetail(
            silo=rd.silo_summary(row, rec, snap.at),
            by_type=rec.by_type if rec else {},
            history=await r.history(address),
            components=rec.components if rec else {},
        )

    @app.get("/api/grains", response_model=m.Grains, tags=["grains"])
    async def grains(r: Reader) -> m.Grains:
        snap = await r.snapshot()
        with redis_errors("read state types"):
            raw = await r.redis.smembers(keys.state_types())
        return rd.grains(snap, {t.decode() if isinstance(t, bytes) else t for t in raw})

    @app.get("/api/grains/{type_name}", response_model=m.GrainKeys, tags=["grains"])
    async def grain_keys(
        type_name: str, r: Reader, limit: int = Query(200, ge=1, le=5000)
    ) -> m.GrainKeys:
        snap = await r.snapshot()
        active = sorted(
            {k for rec in snap.live_records() for k in rec.keys_sample.get(type_name, [])}
        )
        persisted: list[str] = []
        with redis_errors("read state index"):
            async for k in r.redis.sscan_iter(keys.state_index(type_name), count=500):
                persisted.append(k.decode() if isinstance(k, bytes) else k)
                if len(persisted) >= limit:
                    break
        return m.GrainKeys(type=type_name, active=active[:limit], persisted=sorted(persisted))

    @app.get(
        "/api/grains/{type_name}/{key:path}/state", response_model=m.GrainState, tags=["grains"]
    )
    async def grain_state(type_name: str, key: str, r: Reader) -> m.GrainState:
        """The persisted state, decoded without the grain's classes (see GrainState.state)."""
        grain = GrainId(type_name, key)
        with redis_errors("read state head"):
            etag, size = await r.redis.hmget(keys.state_head(str(grain)), ["etag", "size"])
        if etag is None:
            return m.GrainState(type=type_name, key=key, found=False)
        etag_text = etag.decode() if isinstance(etag, bytes) else str(etag)
        base = m.GrainState(
            type=type_name, key=key, found=True, etag=etag_text, size=int(size or 0)
        )
        if base.size > MAX_STATE_BYTES:
            return base.model_copy(update={"error": f"state is {base.size} bytes, over the viewer's "
                                                    f"{MAX_STATE_BYTES} byte limit"})  # fmt: skip
        stored = await RedisStateStore(
            r.redis, keys, StorageSettings.model_validate({"retries": 0})
        ).read(grain)
        if stored is None:
            return m.GrainState(type=type_name, key=key, found=False)
        try:
            value = to_json(decoder().decode(stored.meta, stored.buffers))
        except errors.CodecError as exc:
            return base.model_copy(update={"error": f"cannot decode: {exc}"})
        return base.model_copy(update={"etag": stored.etag, "state": value})

    @app.get("/api/methods", response_model=m.Methods, tags=["calls"])
    async def methods(
        r: Reader,
        sort: str = Query(
            "calls", description="Any MethodRow field: " + ", ".join(rd.METHOD_SORTS)
        ),
        order: Literal["asc", "desc"] = "desc",
        grain_type: str | None = Query(None, description="Only this grain type's methods."),
        silo: str | None = Query(None, description="Only calls served by this silo (its address)."),
    ) -> m.Methods:
        """Per-method stats merged over live silos; each column sorts by its own value."""
        rows = rd.methods(await r.snapshot(), sort, order, grain_type=grain_type, silo=silo)
        return m.Methods(sort=sort, order=order, rows=rows)

    async def _jobs(r: rd.ClusterReader) -> list[JobProgress]:
        return await read_jobs(r.redis, keys)

    @app.get("/api/jobs", response_model=m.JobList, tags=["training"])
    async def jobs(r: Reader) -> m.JobList:
        return m.JobList(jobs=await _jobs(r))

    @app.get("/api/jobs/{job}", response_model=m.JobDetail, tags=["training"],
             responses={404: {"description": "No such job"}})  # fmt: skip
    async def job(job: str, r: Reader, points: int = Query(2000, ge=1, le=10_000)) -> m.JobDetail:
        """Latest progress plus the last ``points`` curve points (train and eval) for the curves."""
        with redis_errors("read job"):
            async with r.redis.pipeline(transaction=False) as pipe:
                pipe.get(keys.job_progress(job))
                pipe.xrevrange(keys.job_history(job), count=points)
                pipe.exists(keys.job_cancel(job))
                raw, entries, cancel = await pipe.execute()
        if raw is None:
            raise HTTPException(404, f"no progress published for job {job}")
        history = []
        for _, fields in reversed(entries):
            try:
                history.append(JobPoint.from_fields(fields))
            except ValidationError:
                continue
        progress = JobProgress.model_validate_json(raw)
        if progress.status in ("completed", "failed", "cancelled"):
            # The stream is append-only: an early stop publishes its end after points of the
            # steps it then abandoned. The job's history ends at its last step; so do its curves.
            history = [p for p in history if p.step <= progress.step]
        return m.JobDetail(
            progress=progress,
            history=history,
            metric_names=rd.job_metric_names(progress, history),
            cancel_requested=bool(cancel),
        )

    @app.get("/api/events", response_model=m.EventList, tags=["cluster"])
    async def events(
        r: Reader,
        count: int = Query(200, ge=1, le=2000),
        kind: str | None = Query(None, description="Only events of this kind."),
        before: str | None = Query(
            None, description="Only events older than this stream id (paging)."
        ),
    ) -> m.EventList:
        found = await read_events(
            r.redis, keys, count=count if kind is None else 2000, before=before
        )
        if kind is not None:
            found = [e for e in found if e.kind == kind][:count]
        return m.EventList(events=found)

    @app.get("/api/reminders", response_model=m.ReminderList, tags=["grains"])
    async def reminders(
        r: Reader,
        type: str | None = Query(None, description="Only reminders of this grain type."),
    ) -> m.ReminderList:
        """Every reminder: period, next due, and when and on which silo its last tick ran."""
        every = await read_reminders(r.redis, keys)
        return m.ReminderList(
            reminders=[x for x in every if type is None or x.type == type],
            types=sorted({x.type for x in every}),
        )

    @app.get("/api/streams", response_model=m.StreamList, tags=["grains"])
    async def streams(
        r: Reader,
        namespace: str | None = Query(None, description="Only streams of this namespace."),
        limit: int = Query(200, ge=1, le=2000, description="Most streams listed."),
    ) -> m.StreamList:
        """Streams: items kept, the newest token, and per subscribing grain type (consumer group)
        its lag, pending items, the silo delivering it and the group's consumers; and each
        namespace's dead letters (items no turn took after ``streams.max_attempts``)."""
        found, namespaces, truncated = await read_streams(r.redis, keys, namespace, limit)
        wanted = [n for n in namespaces if namespace is None or n == namespace]
        dead = await read_dead_letters(r.redis, keys, wanted)
        return m.StreamList(streams=found, namespaces=namespaces, truncated=truncated, dead_letters=dead)

    @app.get("/api/logs", response_model=m.LogList, tags=["cluster"])
    async def logs(
        r: Reader,
        since: str | None = Query(
            None,
            pattern=r"^\d+(-\d+)?$",
            description="A stream id (entries after it) or unix milliseconds (entries from then).",
        ),
        silo: str | None = Query(None, description="Only records of this silo."),
        level: str | None = Query(None, description="This level and above: DEBUG ... CRITICAL."),
        limit: int = Query(200, ge=1, le=2000),
    ) -> m.LogList:
        """Silos' published log records, newest last; tail with ``since`` = the last ``last_id``."""
        entries, last = await read_logs(
            r.redis, keys, since=since, silo=silo, level=level, limit=limit
        )
        return m.LogList(entries=entries, last_id=last)

    # --- admin ----------------------------------------------------------------

    @app.post("/api/silos/{address}/drain", response_model=m.AdminResult, tags=["admin"],
              dependencies=[Depends(require_admin)],
              responses={403: {"description": "No admin token configured, or a wrong one"}})  # fmt: skip
    async def drain(address: str, request: Request, r: Reader) -> m.AdminResult:
        """Push ``{"command": "drain"}`` to the silo's control list; the silo drains itself."""
        snap = await r.snapshot()
        row = snap.members.get(address)
        if row is None or row.status not in LIVE:
            raise HTTPException(404, f"no live silo {address}")
        await request_drain(r.redis, keys, address, by="dashboard")
        request.app.state.events.emit("drain", target=address, by="dashboard")
        return m.AdminResult(ok=True, detail=f"drain requested for {address}")

    @app.post("/api/jobs/{job}/cancel", response_model=m.AdminResult, tags=["admin"],
              dependencies=[Depends(require_admin)],
              responses={403: {"description": "No admin token configured, or a wrong one"}})  # fmt: skip
    async def cancel(job: str, request: Request, r: Reader) -> m.AdminResult:
        """Set the job's cancel flag; the coordinator sees it on its next progress publish."""
        with redis_errors("read job"):
            known = await r.redis.exists(keys.job_progress(job))
        if not known:
            raise HTTPException(404, f"no job {job}")
        await request_cancel(r.redis, keys, job, "cancelled from the dashboard")
        request.app.state.events.emit("cancel", job=job, by="dashboard")
        return m.AdminResult(ok=True, detail=f"cancel requested for job {job}")

    # --- metrics and the page ----------------------------------------------------

    @app.get("/metrics", tags=["metrics"], response_class=Response)
    async def metrics(r: Reader) -> Response:
        """Prometheus text (exposition format 0.0.4)."""
        try:
            collector.snapshot = await r.snapshot()
            collector.jobs = await _jobs(r)
            collector.models = await read_models(r.redis, keys.rendezvous(SERVING, 0))
            collector.redis_up = True
        except errors.StorageError:
            collector.redis_up = False
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(serving_router)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(str(STATIC / "index.html"), headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
    return app
