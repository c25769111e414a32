"""Clients of a V2 front over the wire, in their own process: prints one JSON line last.

``python -m benchmarks.wire_clients --plan '[{"kind": "triton-http", "url": "127.0.0.1:8000",
"concurrency": 16, "requests": 4000}, ...]'`` runs each measurement in turn and prints their
results as one JSON list (a plan that alternates the front and the no-op endpoint spreads
the noise of a shared machine over both).

``concurrency`` threads, each with a client of its own, each sending its next
single-row request when the last is answered. A thread per client, not
tritonclient's ``async_infer``: that one queues requests in a greenlet pool
behind one connection pool and measures the pool, not the server (issue 29).
Kinds: ``triton-http`` (binary tensors, tritonclient's default),
``triton-grpc``, ``httpx-json`` (the V2 JSON body, as a plain HTTP client
sends it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

KINDS = ("triton-http", "triton-grpc", "httpx-json")


def _caller(kind: str, url: str, model: str, row: np.ndarray) -> tuple[Callable[[], Any], Callable[[], None]]:
    """One client's request function and its close."""
    if kind == "triton-http":
        import tritonclient.http as th

        c = th.InferenceServerClient(url=url, connection_timeout=30, network_timeout=30)
        inp = th.InferInput("input", list(row.shape), "FP32")
        inp.set_data_from_numpy(row, binary_data=True)
        out = [th.InferRequestedOutput("output", binary_data=True)]

        def call() -> Any:
            return c.infer(model, [inp], outputs=out).as_numpy("output")

        def close() -> None:
            c.close()
            # Each thread that used the client has a gevent hub of its own, and its event loop's
            # descriptors outlive the thread: two a client, so a long run ran out of them.
            import gevent

            gevent.get_hub().destroy(destroy_loop=True)

        return call, close
    if kind == "triton-grpc":
        import tritonclient.grpc as tg

        g = tg.InferenceServerClient(url=url)
        ginp = tg.InferInput("input", list(row.shape), "FP32")
        ginp.set_data_from_numpy(row)

        def gcall() -> Any:
            return g.infer(model, [ginp]).as_numpy("output")

        return gcall, g.close
    if kind == "httpx-json":
        import httpx

        h = httpx.Client(base_url=f"http://{url}", timeout=30)
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(row.shape), "data": row.flatten().tolist()}]}
        path = f"/v2/models/{model}/infer"

        def hcall() -> Any:
            r = h.post(path, json=body)
            r.raise_for_status()
            return r.json()["outputs"][0]["data"]

        return hcall, h.close
    raise SystemExit(f"unknown kind {kind!r}; have {KINDS}")


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a front's ``--workers`` processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:  # gone, or no /proc (not Linux)
            pass
    return out


def cpu_s(pids: list[int]) -> float | None:
    """User + system CPU seconds of the server processes ``pids`` and their children so far; None without /proc."""
    total = 0.0
    try:
        for p in (q for pid in pids for q in _tree(pid)):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


def measure(kind: str, url: str, model: str, features: int, concurrency: int, total: int, warmup: int,
            pids: list[int] | None = None) -> dict[str, Any]:  # fmt: skip
    row = np.random.default_rng(0).random((1, features), dtype=np.float32)
    taken = itertools.count()  # next() on a count is atomic under the GIL
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    failures: list[str] = []
    start = threading.Barrier(concurrency + 1)

    def loop(k: int) -> None:
        # tritonclient's HTTP client runs on gevent: it must be made and used on one thread.
        try:
            call, close = _caller(kind, url, model, row)
            for _ in range(max(1, warmup // concurrency)):  # its connection, opened before the clock
                call()
        except Exception as exc:  # noqa: BLE001 - reported, and the run fails
            failures.append(f"{type(exc).__name__}: {exc}")
            start.abort()
            return
        mine = lat[k]
        start.wait()
        try:
            while next(taken) < total:
                t0 = time.perf_counter()
                call()
                mine.append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            close()

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        raise SystemExit(f"a client could not start: {failures}") from None
    cpu0 = cpu_s(pids) if pids else None
    mine0 = time.process_time()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    cpu1 = cpu_s(pids) if pids else None
    client_us = (time.process_time() - mine0) / max(1, sum(len(x) for x in lat)) * 1e6
    if failures:
        raise SystemExit(f"{len(failures)} client(s) failed: {failures[0]}")
    flat = sorted(x for part in lat for x in part)

    def pct(q: float) -> float:
        return flat[min(len(flat) - 1, round(q * (len(flat) - 1)))] * 1e3 if flat else 0.0

    # The server's CPU per request: unlike the rate, it barely moves with what else runs on the
    # machine, so it compares two servers (or two versions of one) where the rates are noisy.
    server_us = (cpu1 - cpu0) / len(flat) * 1e6 if cpu0 is not None and cpu1 is not None and flat else None
    return {"per_s": len(flat) / elapsed, "p50_ms": pct(0.5), "p99_ms": pct(0.99), "requests": len(flat),
            "client_cores": len(os.sched_getaffinity(0)), "server_cpu_us": server_us, "client_cpu_us": client_us}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True,
                   help="JSON list of {kind, url, concurrency, requests[, model, features, warmup, pids]}; pids: the"
                        " server's processes, whose CPU per request is reported (server_cpu_us)")  # fmt: skip
    plan = json.loads(p.parse_args().plan)
    out = []
    for m in plan:
        out.append(measure(m["kind"], m["url"], m.get("model", "digits"), m.get("features", 64), m["concurrency"],
                           m["requests"], m.get("warmup", 64), m.get("pids")))  # fmt: skip
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
