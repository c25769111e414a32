"""bench_serving's over-the-wire rows: ``redgrain serve`` called by real V2 clients, beside a no-op endpoint.

One silo subprocess hosts the digits MLP; ``redgrain serve`` (its own
process, ``--workers`` front processes) answers V2 REST on one port and
gRPC on another; a no-op
endpoint (benchmarks/noop_front.py: the same uvicorn configuration, a fixed
answer) on a third. The clients (benchmarks/wire_clients.py: a thread and a
client each, sequential requests) run in one more process, measuring the
front and the no-op endpoint alternately with the same clients, so their
ratio is what the front keeps of what the HTTP stack allows on this machine
at that moment. Each measurement also reports the server side's CPU per
request (``server_cpu_us``: the front's process tree, or the no-op's, read
from /proc over the same window), which other work on a shared machine moves
far less than the rates. Ray Serve's HTTP proxy, when ray is installed, is
measured by the same clients afterwards (benchmarks/ray_serving.py ``--http``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from typing import Any

import httpx

from benchmarks import common
from benchmarks.serving_common import MAX_BATCH, MODELS

WIRE_CONCURRENCY = (1, 8, 16, 64)
"""8 for the p99 goal; 1, 16 and 64 for the rates."""
MODEL = "digits"


def requests_for(concurrency: int, quick: bool) -> int:
    if quick:
        return 2 * concurrency + 16
    return {1: 1000, 8: 3000, 16: 4000, 64: 6000}.get(concurrency, 3000)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[str], path: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode}")
        try:
            if httpx.get(f"http://{url}{path}", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}{path} not ready after {timeout_s} s")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_clients(plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = common.start_subprocess(["-m", "benchmarks.wire_clients", "--plan", json.dumps(plan)])
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    text = proc.stdout.read()
    rc = proc.wait()
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if rc != 0 or not last.startswith("["):
        raise RuntimeError(f"the clients failed (exit {rc}): {text[-800:]}")
    return json.loads(last)  # type: ignore[no-any-return]


def kinds_available() -> tuple[list[str], str | None]:
    """The client kinds to run, and why gRPC is absent (None when present)."""
    if importlib.util.find_spec("tritonclient.grpc") is None:
        return ["triton-http", "httpx-json"], "tritonclient[grpc] is not installed"
    return ["triton-http", "triton-grpc", "httpx-json"], None


def measure(weights: str, quick: bool, *, workers: int = 1, in_flight: int | None = None) -> dict[str, Any]:
    """Requests/s and latency of each client kind at each concurrency, against the front and the no-op."""
    factory, features = MODELS[MODEL]
    kinds, grpc_note = kinds_available()
    port, grpc_port, noop_port, noop_grpc_port = _free_port(), _free_port(), _free_port(), _free_port()
    with common.BenchCluster(1, grains="grains.serving") as lc:
        serve = ["-m", "grains.cli", "serve", "--redis", lc.redis_url, "--cluster", lc.cluster, "--name", MODEL,
                 "--model", factory, "--weights", weights, "--input", f"input:FP32:-1,{features}",
                 "--max-batch-size", str(MAX_BATCH), "--port", str(port)]  # fmt: skip
        if workers > 1:
            serve += ["--workers", str(workers)]
        if in_flight is not None:
            serve += ["--in-flight", str(in_flight)]
        if "triton-grpc" in kinds:
            serve += ["--grpc-port", str(grpc_port)]
        front = common.start_subprocess(serve)
        noop = common.start_subprocess(["-m", "benchmarks.noop_front", "--port", str(noop_port),
                                        *(["--grpc-port", str(noop_grpc_port)] if "triton-grpc" in kinds else [])])  # fmt: skip
        try:
            _wait_ready(f"127.0.0.1:{port}", front, f"/v2/models/{MODEL}/ready")
            assert noop.stdout is not None
            if noop.stdout.readline().strip() != "ready":
                raise RuntimeError("the no-op endpoint did not start")
            plan: list[dict[str, Any]] = []
            for kind in kinds:
                for c in WIRE_CONCURRENCY:
                    n = requests_for(c, quick)
                    url = f"127.0.0.1:{grpc_port if kind == 'triton-grpc' else port}"
                    plan.append({"kind": kind, "url": url, "concurrency": c, "requests": n, "features": features,
                                 "target": "front", "pids": [front.pid]})  # fmt: skip
                    noop_url = f"127.0.0.1:{noop_grpc_port if kind == 'triton-grpc' else noop_port}"
                    plan.append({"kind": kind, "url": noop_url, "concurrency": c, "requests": n,
                                 "features": features, "target": "noop", "pids": [noop.pid]})  # fmt: skip
            results = run_clients(plan)
        finally:
            _stop(front)
            _stop(noop)
    out: dict[str, Any] = {"kinds": kinds, "grpc_note": grpc_note, "workers": workers, "in_flight": in_flight,
                           "server_cores": os.cpu_count()}  # fmt: skip
    for m, r in zip(plan, results):
        out.setdefault(m["target"], {}).setdefault(m["kind"], {})[str(m["concurrency"])] = r
    return out


def ray_http(weights: str, quick: bool) -> dict[str, Any] | str:
    """The same clients against Ray Serve's HTTP proxy (one replica, @serve.batch), JSON and binary.

    An eighth of the requests of the front's rows: at ~100 /s a full count would take minutes.
    """
    if importlib.util.find_spec("ray") is None:
        return "ray[serve] is not installed (pip install '.[bench]'): the Ray Serve HTTP row is absent"
    port = _free_port()
    proc = common.start_subprocess(["-m", "benchmarks.ray_serving", "--http", str(port),
                                    "--weights", json.dumps({MODEL: weights})])  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    try:
        line = proc.stdout.readline().strip()
        if line != "ready":
            return f"Ray Serve's HTTP proxy did not start: {line!r}"
        _, features = MODELS[MODEL]
        plan = [{"kind": kind, "url": f"127.0.0.1:{port}", "concurrency": c, "features": features,
                 "requests": max(2 * c + 8, requests_for(c, quick) // 8)}
                for kind in ("triton-http", "httpx-json") for c in WIRE_CONCURRENCY]  # fmt: skip
        results = run_clients(plan)
    finally:
        proc.stdin.close()  # it shuts Ray down when its stdin closes
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    out: dict[str, Any] = {}
    for m, r in zip(plan, results):
        out.setdefault(m["kind"], {})[str(m["concurrency"])] = r
    return out
