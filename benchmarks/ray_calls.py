"""Ray's side of bench_calls, run in its own process: prints one JSON line last.

Same shapes as redgrain's: sequential (``ray.get`` per call) and pipelined
(submit n, then ``ray.get`` them all) calls to a sync actor and an async
actor, actor → actor calls, and a float32 tensor handed actor → actor (Ray
puts it in the object store and passes the ObjectRef).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from benchmarks import common
from benchmarks.bench_calls import MB, SMALL, Sizes


def measure(sz: Sizes) -> dict[str, Any]:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)

    @ray.remote
    class SyncEcho:
        def echo(self, v: Any) -> Any:
            return v

        def nbytes(self, t: Any) -> int:
            return int(t.numel() * t.element_size())

    @ray.remote
    class AsyncEcho:
        async def echo(self, v: Any) -> Any:
            return v

    @ray.remote
    class Driver:
        def __init__(self, target: Any) -> None:
            self.target = target

        def sequential(self, n: int, payload: bytes) -> list[float]:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                ray.get(self.target.echo.remote(payload))
                out.append(time.perf_counter() - t0)
            return out

        def pipelined(self, n: int, payload: bytes) -> float:
            t0 = time.perf_counter()
            ray.get([self.target.echo.remote(payload) for _ in range(n)])
            return time.perf_counter() - t0

        def tensor_to(self, nbytes: int, repeats: int) -> list[float]:
            import torch

            torch.set_num_threads(1)
            t = torch.randn(nbytes // 4)
            out = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                assert ray.get(self.target.nbytes.remote(t)) == nbytes
                out.append(time.perf_counter() - t0)
            return out

    def sync_loop(fn: Any, n: int) -> tuple[float, list[float]]:
        lat = []
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            fn()
            lat.append(time.perf_counter() - t)
        return n / (time.perf_counter() - t0), lat

    def rep(fn: Any) -> dict[str, Any]:
        fn()
        return common.summarize([fn() for _ in range(sz.repeats)])

    out: dict[str, Any] = {}
    sync_a, async_a = SyncEcho.remote(), AsyncEcho.remote()  # type: ignore[attr-defined]
    driver = Driver.remote(SyncEcho.remote())  # type: ignore[attr-defined]
    ray.get([sync_a.echo.remote(1), async_a.echo.remote(1), driver.pipelined.remote(1, SMALL)])
    def shapes(label: str, payload: bytes, n_seq: int, n_pipe: int) -> None:
        for kind, actor in (("sync", sync_a), ("async", async_a)):
            lat: list[float] = []

            def seq(actor: Any = actor, lat: list[float] = lat) -> float:
                rate, got = sync_loop(lambda: ray.get(actor.echo.remote(payload)), n_seq)
                lat[:] = got
                return rate

            runs = rep(seq)
            out[f"{kind}_seq_{label}"] = {"per_s": runs, "p50_ms": common.percentile(lat, 0.5) * 1e3,
                                          "p99_ms": common.percentile(lat, 0.99) * 1e3}  # fmt: skip

            def pipe(actor: Any = actor) -> float:
                t0 = time.perf_counter()
                ray.get([actor.echo.remote(payload) for _ in range(n_pipe)])
                return n_pipe / (time.perf_counter() - t0)

            out[f"{kind}_pipe_{label}"] = {"per_s": rep(pipe)}
        glat: list[float] = []

        def a_seq() -> float:
            got = ray.get(driver.sequential.remote(n_seq, payload))
            glat[:] = got
            return len(got) / sum(got)

        runs = rep(a_seq)
        out[f"actor_actor_seq_{label}"] = {"per_s": runs, "p50_ms": common.percentile(glat, 0.5) * 1e3,
                                           "p99_ms": common.percentile(glat, 0.99) * 1e3}  # fmt: skip
        out[f"actor_actor_pipe_{label}"] = {"per_s": rep(lambda: n_pipe / ray.get(driver.pipelined.remote(n_pipe, payload)))}

    shapes("100B", SMALL, sz.seq, sz.pipe)
    shapes("1MB", b"y" * MB, sz.seq_1mb, sz.pipe_1mb)
    for nbytes in sz.tensor_sizes:
        times = ray.get(driver.tensor_to.remote(nbytes, sz.tensor_repeats + 1))
        out[f"tensor_{nbytes // MB}MB"] = {"gb_per_s": common.summarize([nbytes / t / 1e9 for t in times[1:]])}
    ray.shutdown()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    common.fix_torch_threads()
    result = measure(Sizes(args.quick))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
