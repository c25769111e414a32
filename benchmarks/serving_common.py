"""What bench_serving.py and ray_serving.py share: the models, the load shape, the statistics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks import common

MODELS: dict[str, tuple[str, int]] = {
    "digits": ("grains.training.models:mlp", 64),
    "medium": ("grains.training.models:medium_mlp", 784),
}
"""Name -> (factory, features of one row)."""
CONCURRENCY = (1, 8, 64)
MAX_BATCH = 64


def requests_for(concurrency: int, quick: bool) -> int:
    if quick:
        return 64 * max(1, concurrency // 8) + 32
    return {1: 1500, 8: 4000, 64: 8000}.get(concurrency, 4000)


async def drive(call: Callable[[Any], Awaitable[Any]], rows: list[Any], concurrency: int, total: int) -> dict[str, float]:
    """``concurrency`` callers, each sending its next single-row request when the last is answered,
    until ``total`` are answered: requests/s and the latency percentiles."""
    lat: list[float] = []
    sent = 0

    async def caller() -> None:
        nonlocal sent
        while sent < total:
            row = rows[sent % len(rows)]
            sent += 1
            t0 = time.perf_counter()
            await call(row)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {
        "per_s": len(lat) / elapsed,
        "p50_ms": common.percentile(lat, 0.5) * 1e3,
        "p99_ms": common.percentile(lat, 0.99) * 1e3,
        "requests": float(len(lat)),
    }
