"""``/api/models``: served models, from the records their replicas publish (grains/serving/records.py).

An ``APIRouter`` the app includes; it reads through the app's
:class:`~dashboard.reader.ClusterReader` (``request.app.state.reader``), so it
needs nothing of its own and adds nothing to a call path.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel

from grains.serving.records import BATCH_BUCKETS, WORKLOAD, ModelSummary, read_models

router = APIRouter(tags=["serving"])


class ModelList(BaseModel):
    models: list[ModelSummary]
    batch_buckets: list[int]
    """Upper bounds (rows) of ``batch_rows``; its last count is the overflow."""


async def models_of(request: Request) -> list[ModelSummary]:
    reader = request.app.state.reader
    return await read_models(reader.redis, reader.keys.rendezvous(WORKLOAD, 0))


@router.get("/api/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    """Every served model: replicas and their silos, requests/s, p50/p99, batch sizes, weights versions."""
    return ModelList(models=await models_of(request), batch_buckets=list(BATCH_BUCKETS))


@router.get("/api/models/{name}", response_model=ModelSummary, responses={404: {"description": "No such model"}})
async def model(name: str, request: Request) -> ModelSummary:
    for m in await models_of(request):
        if m.name == name:
            return m
    raise HTTPException(404, f"no served model {name}")
