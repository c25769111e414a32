"""Grains the benchmarks call (silo subprocesses import this module)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from grains import Grain, random_placement


@random_placement
class BenchEcho(Grain):
    async def echo(self, value: Any) -> Any:
        return value

    async def nbytes(self, value: Any) -> int:
        """Take a tensor (or bytes) and answer only its size: a one-way bulk transfer."""
        if isinstance(value, (bytes, bytearray)):
            return len(value)
        return int(value.numel() * value.element_size())

    async def where(self) -> str:
        return str(self.silo)


@random_placement
class BenchDriver(Grain):
    """Measures grain→grain calls from inside a silo, so no client is in the path."""

    async def where(self) -> str:
        return str(self.silo)

    async def sequential(self, target: str, n: int, payload: bytes) -> list[float]:
        """Latency of each of n back-to-back calls, in seconds."""
        echo = self.get_grain(BenchEcho, target)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await echo.echo(payload)
            out.append(time.perf_counter() - t0)
        return out

    async def pipelined(self, target: str, n: int, payload: bytes) -> float:
        """Seconds for n calls issued at once."""
        echo = self.get_grain(BenchEcho, target)
        t0 = time.perf_counter()
        await asyncio.gather(*(echo.echo(payload) for _ in range(n)))
        return time.perf_counter() - t0

    async def tensor_to(self, target: str, nbytes: int, repeats: int) -> list[float]:
        """Seconds per call that hands a float32 tensor of nbytes to the target."""
        import torch

        echo = self.get_grain(BenchEcho, target)
        t = torch.randn(nbytes // 4)
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = await echo.nbytes(t)
            out.append(time.perf_counter() - t0)
            assert got == nbytes
        return out
