"""Serving benchmark: ``python -m benchmarks serving [--quick] [--no-ray] [--no-wire] [--front-workers N] [--front-in-flight N]``.

Single-row requests from 1, 8 and 64 concurrent callers, on the digits MLP
(64 → 128 → 10) and the medium MLP (784 → 1024 → 1024 → 10), in one run:

* redgrain: one silo subprocess hosting ``grains.serving``, the model
  deployed from a weights file (dynamic batching, at most 64 rows a batch, no
  batching delay), called from a client in this process two ways: through a
  ``Predictor``, which coalesces the concurrent requests into merged calls
  (the column the goals read; the HTTP front calls through one too), and as
  plain ``ModelGrain.predict`` grain calls, one per request;
* a plain in-process torch loop answering one request at a time (the same
  callers queue on it: what serving without batching gives);
* Ray Serve, one replica with ``@serve.batch`` (same largest batch, no delay),
  called through a ``DeploymentHandle`` (benchmarks/ray_serving.py, its own
  process), when ``ray[serve]`` is installed (``pip install ".[bench]"``).

Then over the wire (benchmarks/serving_wire.py), on the digits MLP: ``redgrain
serve`` called by tritonclient HTTP (binary tensors), tritonclient gRPC (when
the gRPC front exists) and httpx (V2 JSON), from 1, 8, 16 and 64 client
threads in a process of their own, beside a no-op Starlette+uvicorn endpoint
measured by the same clients in the same run, and Ray Serve's HTTP proxy.

Every process runs one BLAS/OpenMP thread. Goals (printed as ratios): at 64
callers ≥ 5× the in-process batch-1 loop on the medium MLP; ≥ 2× Ray Serve at
equal concurrency; p99 ≤ 20 ms at 8 callers; over the wire (issue 29), at 16
tritonclient connections ≥ 0.6× the no-op endpoint, JSON clients faster at
16 than at 1, p99 ≤ 20 ms at 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common, serving_wire
from benchmarks.serving_common import CONCURRENCY, MAX_BATCH, MODELS, drive, requests_for


def save_weights(directory: Path) -> dict[str, str]:
    import torch

    from grains.training.api.job import resolve_path

    paths = {}
    for name, (factory, _) in MODELS.items():
        torch.manual_seed(0)
        path = directory / f"{name}.pt"
        torch.save(resolve_path(factory, "model")().state_dict(), path)
        paths[name] = str(path)
    return paths


async def in_process(weights: dict[str, str], quick: bool) -> dict[str, Any]:
    """One request at a time through the model, in this process; callers queue for it."""
    import torch

    from grains.training.api.job import resolve_path

    out: dict[str, Any] = {}
    for name, (factory, features) in MODELS.items():
        model = resolve_path(factory, "model")()
        model.load_state_dict(torch.load(weights[name], weights_only=True))
        model.eval()
        rows = [torch.randn(1, features) for _ in range(64)]
        lock = asyncio.Lock()

        async def call(row: Any, model: Any = model, lock: asyncio.Lock = lock) -> Any:
            async with lock:  # one at a time, in arrival order
                with torch.inference_mode():
                    return model(row)

        await drive(call, rows, 1, 200)
        out[name] = {str(c): await drive(call, rows, c, requests_for(c, quick)) for c in CONCURRENCY}
        out[name]["batched_rows_per_s"] = batched_forward(model, features, 20 if quick else 300)
    return out


def batched_forward(model: Any, features: int, passes: int) -> float:
    """Rows/s of back-to-back MAX_BATCH-row forward passes, nothing else: what batching can reach."""
    import time

    import torch

    x = torch.randn(MAX_BATCH, features)
    with torch.inference_mode():
        for _ in range(5):
            model(x)
        t0 = time.perf_counter()
        for _ in range(passes):
            model(x)
    return MAX_BATCH * passes / (time.perf_counter() - t0)


async def redgrain(weights: dict[str, str], quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Through a ``Predictor`` (concurrent requests coalesced into one call), and as plain grain calls."""
    import torch

    from grains.serving import ModelGrain, Predictor, ServeSpec, TensorSpec, deploy
    from silo.client import ClusterClient

    coalesced: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    with common.BenchCluster(1, grains="grains.serving") as lc:
        async with await ClusterClient.connect(lc.redis_url, cluster=lc.cluster) as client:
            for name, (factory, features) in MODELS.items():
                spec = ServeSpec(model=factory, weights=weights[name], max_batch_size=MAX_BATCH,
                                 inputs=[TensorSpec(name="input", shape=[-1, features])])  # fmt: skip
                await deploy(client, name, spec)
                ref = client.get_grain(ModelGrain, name)
                predictor = Predictor(client, name)
                rows = [torch.randn(1, features) for _ in range(64)]
                warm = 64 if quick else 400
                await drive(ref.predict, rows, 8, warm)  # activation, load, warm-up
                await drive(predictor.predict, rows, 8, warm)
                coalesced[name] = {str(c): await drive(predictor.predict, rows, c, requests_for(c, quick)) for c in CONCURRENCY}
                plain[name] = {str(c): await drive(ref.predict, rows, c, requests_for(c, quick)) for c in CONCURRENCY}
    return coalesced, plain


def ray_serve(weights: dict[str, str], quick: bool) -> dict[str, Any] | str:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        return "ray[serve] is not installed (pip install '.[bench]'): Ray Serve columns skipped"
    proc = common.start_subprocess(["-m", "benchmarks.ray_serving", "--weights", json.dumps(weights),
                                    *(["--quick"] if quick else [])])  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    text = proc.stdout.read()
    rc = proc.wait(900)
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if rc != 0 or not last.startswith("{"):
        return f"Ray Serve measurement failed (exit {rc}): {text[-500:]}"
    return json.loads(last)  # type: ignore[no-any-return]


def report(rg: dict[str, Any], calls: dict[str, Any], plain: dict[str, Any], ray: dict[str, Any] | None) -> list[list[str]]:
    rows = []
    for name in MODELS:
        for c in CONCURRENCY:
            r, p, g = rg[name][str(c)], plain[name][str(c)], calls[name][str(c)]
            y = ray[name][str(c)] if ray else None
            rows.append([
                f"{name} x{c}", common.fmt_rate(r["per_s"]), f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f}",
                common.fmt_rate(g["per_s"]), f"{g['p50_ms']:.2f} / {g['p99_ms']:.2f}",
                common.fmt_rate(p["per_s"]), f"{p['p50_ms']:.2f} / {p['p99_ms']:.2f}", common.ratio(r["per_s"], p["per_s"]),
                common.fmt_rate(y["per_s"]) if y else "-", f"{y['p50_ms']:.2f} / {y['p99_ms']:.2f}" if y else "-",
                common.ratio(r["per_s"], y["per_s"]) if y else "-",
            ])  # fmt: skip
    return rows


def _cpu(f: dict[str, Any], n: dict[str, Any] | None) -> str:
    """The server processes' CPU per request, front / no-op (``-`` where /proc could not say), and the clients'."""
    fu, nu = f.get("server_cpu_us"), (n or {}).get("server_cpu_us")
    served = f"{fu:.0f} / {nu:.0f}" if fu is not None and nu is not None else "-"
    fc, nc = f.get("client_cpu_us"), (n or {}).get("client_cpu_us")
    return served + (f" (clients {fc:.0f} / {nc:.0f})" if fc is not None and nc is not None else "")


def report_wire(wire: dict[str, Any], ray_http: dict[str, Any] | None) -> None:
    rows = []
    for kind in wire["kinds"]:
        for c in serving_wire.WIRE_CONCURRENCY:
            f = wire["front"][kind][str(c)]
            n = wire.get("noop", {}).get(kind, {}).get(str(c))
            # Ray Serve has no gRPC proxy of the V2 protocol: gRPC is compared with its HTTP proxy
            # at equal concurrency (binary tensors, as tritonclient sends them).
            y = (ray_http or {}).get("triton-http" if kind == "triton-grpc" else kind, {}).get(str(c))
            rows.append([
                f"{kind} x{c}", common.fmt_rate(f["per_s"]), f"{f['p50_ms']:.2f} / {f['p99_ms']:.2f}",
                common.fmt_rate(n["per_s"]) if n else "-", f"{n['p50_ms']:.2f} / {n['p99_ms']:.2f}" if n else "-",
                common.ratio(f["per_s"], n["per_s"]) if n else "-", _cpu(f, n),
                common.fmt_rate(y["per_s"]) if y else "-", f"{y['p50_ms']:.2f} / {y['p99_ms']:.2f}" if y else "-",
                common.ratio(f["per_s"], y["per_s"]) if y else "-",
            ])  # fmt: skip
    in_flight = f", --in-flight {wire['in_flight']}" if wire.get("in_flight") is not None else ""
    print(f"# over the wire, digits MLP: redgrain serve ({wire['workers']} front process(es){in_flight}, 1 silo), a no-op"
          f" Starlette+uvicorn endpoint (for gRPC a no-op servicer on the front's gRPC server) and Ray Serve's HTTP proxy, all on this machine's {wire['server_cores']} cores;"
          f" the clients: 1 process, a thread and a client each, on the same cores; server CPU µs/req: the front's"
          f" (or the no-op's) processes' user+system CPU over the measurement per request, steadier than the rates"
          f" when other work shares the machine; (clients ...): the client process's CPU per request")  # fmt: skip
    common.print_table(["client x in flight", "front /s", "p50 / p99 ms", "no-op /s", "p50 / p99 ms", "front / no-op",
                        "CPU µs/req front / no-op", "Ray HTTP /s", "p50 / p99 ms", "front / Ray"], rows)  # fmt: skip
    if wire["grpc_note"]:
        print(f"# tritonclient gRPC row absent: {wire['grpc_note']}")
    f16, n16 = wire["front"]["triton-http"]["16"]["per_s"], wire["noop"]["triton-http"]["16"]["per_s"]
    print(f"# goal: tritonclient HTTP at 16 in flight >= 0.6x the no-op endpoint: {f16 / n16:.2f}x"
          f" {'met' if f16 / n16 >= 0.6 else 'MISSED'}")  # fmt: skip
    j1, j16 = wire["front"]["httpx-json"]["1"]["per_s"], wire["front"]["httpx-json"]["16"]["per_s"]
    print(f"# goal: JSON clients gain from concurrency: {j16 / j1:.2f}x at 16 over 1 in flight {'met' if j16 > 1.2 * j1 else 'MISSED'}")
    p99 = wire["front"]["triton-http"]["8"]["p99_ms"]
    print(f"# goal: p99 <= 20 ms at 8 in flight over HTTP: {p99:.2f} ms {'met' if p99 <= 20 else 'MISSED'}")
    if "triton-grpc" in wire["kinds"]:
        g16, gn16 = wire["front"]["triton-grpc"]["16"]["per_s"], wire["noop"]["triton-grpc"]["16"]["per_s"]
        print(f"# goal: gRPC at 16 in flight >= the HTTP figure: {g16:,.0f} /s vs {f16:,.0f} /s = {g16 / f16:.2f}x"
              f" {'met' if g16 >= f16 else 'MISSED'} (the gRPC stack alone, a no-op servicer with the same clients:"
              f" {gn16:,.0f} /s = {gn16 / n16:.2f}x the no-op HTTP endpoint; the front keeps {g16 / gn16:.2f}x of it)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serving")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--no-wire", action="store_true", help="skip the over-the-wire rows")
    parser.add_argument("--front-workers", type=int, default=1, help="redgrain serve --workers for the wire rows")
    parser.add_argument("--front-in-flight", type=int, default=None,
                        help="redgrain serve --in-flight for the wire rows (default: serve's own default)")  # fmt: skip
    args = parser.parse_args(argv)
    facts = common.machine_facts()
    common.print_header("serving: single-row requests, dynamic batching vs batch-1 and Ray Serve", facts, args.quick)
    common.fix_torch_threads()
    with tempfile.TemporaryDirectory(prefix="rg-serving-") as tmp:
        weights = save_weights(Path(tmp))
        rg, calls = common.run(redgrain(weights, args.quick))
        plain = asyncio.run(in_process(weights, args.quick))
        ray_result = "skipped (--no-ray)" if args.no_ray else ray_serve(weights, args.quick)
        wire = None if args.no_wire else serving_wire.measure(weights["digits"], args.quick, workers=args.front_workers,
                                                             in_flight=args.front_in_flight)  # fmt: skip
        ray_http: dict[str, Any] | str = "skipped (--no-ray or --no-wire)"
        if not args.no_ray and not args.no_wire:
            ray_http = serving_wire.ray_http(weights["digits"], args.quick)
    ray = ray_result if isinstance(ray_result, dict) else None
    if ray is None:
        print(f"# {ray_result}")
    common.print_table(
        ["model x callers", "Predictor /s", "p50 / p99 ms", "grain call /s", "p50 / p99 ms", "batch-1 loop /s",
         "p50 / p99 ms", "vs loop", "Ray Serve /s", "p50 / p99 ms", "vs Ray"],
        report(rg, calls, plain, ray),
    )  # fmt: skip
    m64 = rg["medium"]["64"]["per_s"] / plain["medium"]["64"]["per_s"]
    print(f"# goal: medium MLP at 64 callers >= 5x the batch-1 loop: {m64:.2f}x {'met' if m64 >= 5 else 'MISSED'}")
    for name in MODELS:
        bound = plain[name]["batched_rows_per_s"]
        print(f"# {name}: {MAX_BATCH}-row forward passes back to back, in-process: {common.fmt_rate(bound)} rows/s"
              f" = {bound / plain[name]['64']['per_s']:.2f}x the batch-1 loop (batching's ceiling here);"
              f" the Predictor at 64 callers reaches {rg[name]['64']['per_s'] / bound:.0%} of it")  # fmt: skip
    if ray is not None:
        worst = min(rg[n][str(c)]["per_s"] / ray[n][str(c)]["per_s"] for n in MODELS for c in CONCURRENCY)
        print(f"# goal: >= 2x Ray Serve at equal concurrency: lowest ratio {worst:.2f}x {'met' if worst >= 2 else 'MISSED'}")
    p99 = max(rg[n]["8"]["p99_ms"] for n in MODELS)
    print(f"# goal: p99 <= 20 ms at 8 callers: {p99:.2f} ms {'met' if p99 <= 20 else 'MISSED'}")
    m64_calls = calls["medium"]["64"]["per_s"] / plain["medium"]["64"]["per_s"]
    print(f"# (plain grain calls, one per request, no client-side coalescing: {m64_calls:.2f}x)")
    if wire is not None:
        if isinstance(ray_http, str):
            print(f"# Ray Serve HTTP row absent: {ray_http}")
        report_wire(wire, ray_http if isinstance(ray_http, dict) else None)
    common.write_result("serving", {"machine": facts, "quick": args.quick, "redgrain": rg, "grain_calls": calls, "in_process": plain,
                                    "ray_serve": ray_result, "wire": wire, "ray_http": ray_http})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
