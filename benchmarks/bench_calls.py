"""Call-path benchmark: ``python -m benchmarks calls [--quick] [--no-ray]``.

In one run, each measurement warmed up and repeated (median and spread):

* the bare asyncio + msgpack echo baseline (bench_echo_baseline.py), in a subprocess;
* redgrain client → grain (silo subprocess): sequential latency p50/p99 and
  calls/s, pipelined calls/s, with 100 B and 1 MB arguments;
* grain → grain on one silo and across two silos (measured inside a silo);
* 16 MB and 64 MB float32 tensor arguments grain → grain across silos (GB/s),
  and a 64 MB tensor echo client → grain (both directions counted);
* client→grain 100 B calls with the dashboard open and polling vs without
  (bench_dashboard.py's alternating phases), with the silos' CPU per call;
* tracing off vs on (every call sampled, spans batched to an exporter that
  drops them): client→grain and grain→grain across two silos of this process,
  phases alternating, and the off path's own checks timed alone;
* the same shapes on Ray (sync actor, async actor, actor → actor ObjectRef)
  when ``ray`` is installed (``pip install ".[bench]"``), in a subprocess;
* 1 MB calls: pipelined over sequential, and the pipelined echo's bytes/s (both
  directions) over the tensor echo's;
* mutual TLS (a private CA made with the ``openssl`` command): client→grain
  sequential and pipelined 100 B, pipelined 1 MB, the tensor rows, on two TLS
  silos of the same run, as ratios to the plaintext rows.

Ratios printed: redgrain / bare echo and redgrain / Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.bench_dashboard import run_phases as dashboard_phases
from benchmarks.bench_dashboard import table as dashboard_table
from benchmarks.bench_dashboard import verdict as dashboard_verdict
from benchmarks.bench_echo_baseline import measure_in_subprocess as measure_echo

SMALL = b"x" * 100
MB = 1 << 20


class Sizes:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.repeats = 2 if quick else 5
        self.seq = 100 if quick else 3000
        self.pipe = 200 if quick else 10_000
        self.seq_1mb = 5 if quick else 100
        self.pipe_1mb = 8 if quick else 64
        self.tensor_sizes = [1 * MB] if quick else [16 * MB, 64 * MB]
        self.tensor_repeats = 2 if quick else 5


# The rows measure calls between grains placed on purpose (on the driver's silo, on the
# other); the rebalancer evening out the 48 randomly placed activations would move some
# mid-run, and a "one silo" row would then measure calls across silos (seen: 1,036/s
# for 1 MB "on one silo", the cross-silo figure, in one run of four).
PINNED = {"REDGRAIN_REBALANCER__MAX_MOVES_PER_PERIOD": "0"}


async def _place(client: Any, grain: type, n: int) -> dict[str, list[str]]:
    """Activate n keys of a randomly placed grain type; group them by silo."""
    by_silo: dict[str, list[str]] = {}
    keys = [f"{grain.__name__}-{i}" for i in range(n)]
    wheres = await asyncio.gather(*(client.get_grain(grain, k).where() for k in keys))
    for k, w in zip(keys, wheres):
        by_silo.setdefault(w, []).append(k)
    return by_silo


def _seq_result(lat: list[float], runs: dict[str, Any]) -> dict[str, Any]:
    return {"per_s": runs, "p50_ms": common.percentile(lat, 0.5) * 1e3, "p99_ms": common.percentile(lat, 0.99) * 1e3}


async def _shapes(
    echo: Any, driver: Any, same: str, other: str, label: str, payload: bytes, n_seq: int, n_pipe: int, repeats: int
) -> dict[str, Any]:
    """Client→grain and grain→grain (one silo, across silos), sequential and pipelined."""
    out: dict[str, Any] = {}
    lat: list[float] = []

    sequential, pipelined = common.call_rates(lambda: echo.echo(payload), n_seq, n_pipe, lat)

    runs = await common.repeat(sequential, repeats)
    out[f"client_grain_seq_{label}"] = _seq_result(lat, runs)
    out[f"client_grain_pipe_{label}"] = {"per_s": await common.repeat(pipelined, repeats)}
    for where, target in (("one_silo", same), ("across", other)):
        glat: list[float] = []

        async def g_sequential(target: str = target, glat: list[float] = glat) -> float:
            got = await driver.sequential(target, n_seq, payload)
            glat[:] = got
            return len(got) / sum(got)

        async def g_pipelined(target: str = target) -> float:
            return n_pipe / await driver.pipelined(target, n_pipe, payload)

        runs = await common.repeat(g_sequential, repeats)
        out[f"grain_grain_{where}_seq_{label}"] = _seq_result(glat, runs)
        out[f"grain_grain_{where}_pipe_{label}"] = {"per_s": await common.repeat(g_pipelined, repeats)}
    return out


async def _pick(client: Any) -> tuple[Any, str, str]:
    """A driver grain, an echo key on the driver's silo and one on the other silo."""
    from benchmarks.grains import BenchDriver, BenchEcho

    echoes = await _place(client, BenchEcho, 24)
    drivers = await _place(client, BenchDriver, 24)
    silo_a = next(s for s in drivers if s in echoes and len(echoes) > 1)
    silo_b = next(s for s in echoes if s != silo_a)
    return client.get_grain(BenchDriver, drivers[silo_a][0]), echoes[silo_a][0], echoes[silo_b][0]


async def _tensors_across(driver: Any, other: str, sz: Sizes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for nbytes in sz.tensor_sizes:
        times = await driver.tensor_to(other, nbytes, sz.tensor_repeats + 1)
        out[f"tensor_across_{nbytes // MB}MB"] = {
            "gb_per_s": common.summarize([nbytes / t / 1e9 for t in times[1:]]), "bytes": nbytes
        }
    return out


async def measure_tcp(cluster: common.BenchCluster, sz: Sizes) -> dict[str, Any]:
    """The cross-silo rows again on silos with same-host Unix sockets turned off (loopback TCP)."""
    from silo.client import ClusterClient
    from silo.settings import ClientSettings, TransportSettings

    settings = ClientSettings(transport=TransportSettings(local_sockets=False))
    async with await ClusterClient.connect(cluster.redis_url, cluster=cluster.cluster, settings=settings) as client:
        driver, _, other = await _pick(client)
        out = await _tensors_across(driver, other, sz)
        lat: list[float] = []

        async def sequential() -> float:
            got = await driver.sequential(other, sz.seq, SMALL)
            lat[:] = got
            return len(got) / sum(got)

        out["grain_grain_across_seq_100B"] = _seq_result(lat, await common.repeat(sequential, sz.repeats))
    return out


def local_socket_table(rg: dict[str, Any], tcp: dict[str, Any]) -> list[list[str]]:
    rows = []
    for key, unit in [*((k, "GB/s") for k in tcp if k.startswith("tensor_across_")), ("grain_grain_across_seq_100B", "/s")]:
        field = "gb_per_s" if unit == "GB/s" else "per_s"
        ours, theirs = _med(rg, key, field), _med(tcp, key, field)
        name = key.replace("tensor_across_", "tensor ").replace("grain_grain_across_seq_100B", "100 B sequential")
        fmt = (lambda v: f"{v:.2f} GB/s") if unit == "GB/s" else (lambda v: f"{v:,.0f} /s")
        rows.append([f"{name} grain→grain across silos", fmt(ours) if ours else "-", fmt(theirs) if theirs else "-",
                     common.ratio(ours, theirs)])  # fmt: skip
    return rows


async def measure_redgrain(cluster: common.BenchCluster, sz: Sizes) -> dict[str, Any]:

    from benchmarks.grains import BenchEcho
    from silo.client import ClusterClient

    out: dict[str, Any] = {}
    async with await ClusterClient.connect(cluster.redis_url, cluster=cluster.cluster) as client:
        driver, same, other = await _pick(client)
        echo = client.get_grain(BenchEcho, other)

        for label, payload, n_seq, n_pipe in (
            ("100B", SMALL, sz.seq, sz.pipe),
            ("1MB", b"y" * MB, sz.seq_1mb, sz.pipe_1mb),
        ):
            out.update(await _shapes(echo, driver, same, other, label, payload, n_seq, n_pipe, sz.repeats))

        out.update(await _tensors_across(driver, other, sz))
        out.update(await _tensor_echo(echo, sz))
    return out


async def _tensor_echo(echo: Any, sz: Sizes) -> dict[str, Any]:
    import torch

    nbytes = sz.tensor_sizes[-1]
    t = torch.randn(nbytes // 4)

    async def tensor_echo() -> float:
        t0 = time.perf_counter()
        back = await echo.echo(t)
        dt = time.perf_counter() - t0
        assert back.shape == t.shape
        return 2 * nbytes / dt / 1e9

    return {f"tensor_echo_client_{nbytes // MB}MB": {
        "gb_per_s": await common.repeat(tensor_echo, sz.tensor_repeats), "bytes": nbytes
    }}  # fmt: skip


def _certificates(directory: Path) -> dict[str, str]:
    """A private CA and one certificate it signs for 127.0.0.1 (silos and the client share it),
    as the REDGRAIN_TRANSPORT__TLS_* variables."""
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the TLS rows need the openssl command")

    def openssl(*args: str) -> None:
        subprocess.run([exe, *args], cwd=directory, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=bench-ca")
    openssl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=bench-node")
    (directory / "node.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "node.crt", "-days", "2", "-extfile", "node.ext")  # fmt: skip
    return {
        "REDGRAIN_TRANSPORT__TLS_CERT": str(directory / "node.crt"),
        "REDGRAIN_TRANSPORT__TLS_KEY": str(directory / "node.key"),
        "REDGRAIN_TRANSPORT__TLS_CA": str(directory / "ca.crt"),
    }


async def measure_tls(cluster: common.BenchCluster, tls_env: dict[str, str], sz: Sizes) -> dict[str, Any]:
    """The client→grain and tensor rows again with mutual TLS on every link (two TLS silos)."""
    from benchmarks.grains import BenchEcho
    from silo.client import ClusterClient
    from silo.settings import ClientSettings, TransportSettings

    transport = TransportSettings(tls_cert=Path(tls_env["REDGRAIN_TRANSPORT__TLS_CERT"]),
                                  tls_key=Path(tls_env["REDGRAIN_TRANSPORT__TLS_KEY"]),
                                  tls_ca=Path(tls_env["REDGRAIN_TRANSPORT__TLS_CA"]))  # fmt: skip
    settings = ClientSettings(transport=transport)
    out: dict[str, Any] = {}
    async with await ClusterClient.connect(cluster.redis_url, cluster=cluster.cluster, settings=settings) as client:
        driver, _, other = await _pick(client)
        echo = client.get_grain(BenchEcho, other)
        for label, payload, n_seq, n_pipe in (("100B", SMALL, sz.seq, sz.pipe), ("1MB", b"y" * MB, sz.seq_1mb, sz.pipe_1mb)):
            lat: list[float] = []
            sequential, pipelined = common.call_rates(functools.partial(echo.echo, payload), n_seq, n_pipe, lat)
            out[f"client_grain_seq_{label}"] = _seq_result(lat, await common.repeat(sequential, sz.repeats))
            out[f"client_grain_pipe_{label}"] = {"per_s": await common.repeat(pipelined, sz.repeats)}
        out.update(await _tensors_across(driver, other, sz))
        out.update(await _tensor_echo(echo, sz))
    return out


def tls_table(rg: dict[str, Any], tl: dict[str, Any]) -> list[list[str]]:
    rows = []
    for key in tl:
        unit = "GB/s" if key.startswith("tensor_") else "/s"
        field = "gb_per_s" if unit == "GB/s" else "per_s"
        plain, secure = _med(rg, key, field), _med(tl, key, field)
        name = (key.replace("client_grain_seq_", "client→grain sequential ").replace("client_grain_pipe_", "client→grain pipelined ")
                .replace("tensor_across_", "tensor grain→grain across silos ").replace("tensor_echo_client_", "tensor echo client→grain (2× bytes) "))  # fmt: skip
        fmt = (lambda v: f"{v:.2f} GB/s") if unit == "GB/s" else (lambda v: f"{v:,.0f} /s")
        rows.append([name, fmt(plain) if plain else "-", fmt(secure) if secure else "-", common.ratio(secure, plain)])
    return rows


def one_mb_table(rg: dict[str, Any]) -> list[list[str]]:
    """Issue 21's two 1 MB goals: pipelined at least as fast as sequential, and its bytes/s
    (an echo moves the megabyte both ways) at least half the big tensor echo's."""
    seq, pipe = _med(rg, "client_grain_seq_1MB", "per_s"), _med(rg, "client_grain_pipe_1MB", "per_s")
    tensor_key = next((k for k in rg if k.startswith("tensor_echo_client_")), None)
    tensor = _med(rg, tensor_key, "gb_per_s") if tensor_key else None
    agg = 2 * MB * pipe / 1e9 if pipe else None
    rows = [["client→grain 1MB, pipelined / sequential", f"{pipe:,.0f} / {seq:,.0f} /s" if pipe and seq else "-",
             common.ratio(pipe, seq), "≥ 1"]]  # fmt: skip
    if tensor_key is not None:
        name = tensor_key.removeprefix("tensor_echo_client_")
        rows.append([f"1MB pipelined echo bytes/s vs tensor echo {name}", f"{agg:.2f} / {tensor:.2f} GB/s" if agg and tensor else "-",
                     common.ratio(agg, tensor), "≥ 0.5"])  # fmt: skip
    return rows


async def measure_tracing(redis_url: str, sz: Sizes) -> dict[str, Any]:
    """Sequential 100 B calls with tracing off and on, alternating, on two silos of this process.

    The silos run here (not as subprocesses) so that tracing can be switched on and off
    between phases on the same activations; a traced call makes a CLIENT span (the client's)
    and a SERVER span (the silo's), and a grain→grain call one SERVER span.
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from benchmarks.grains import BenchDriver, BenchEcho
    from grains.ids import GrainId
    from grains.placement import grain_options
    from silo.client import ClusterClient
    from silo.settings import RebalancerSettings, SiloSettings
    from silo.silo import Silo
    from silo.tracing import Tracing

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()  # the default sampler records every span
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    tracing = Tracing(provider)
    settings = SiloSettings(
        redis_url=redis_url, cluster="bench-tracing", grains=("benchmarks.grains",),
        rebalancer=RebalancerSettings(max_moves_per_period=0),
    )  # fmt: skip
    silos = [await Silo(settings).start() for _ in range(2)]
    try:
        for s in silos:
            await s.view.refresh()
        one, two = silos
        echo_type, driver_type = grain_options(BenchEcho).type_name, grain_options(BenchDriver).type_name
        await one.router.activate(GrainId(driver_type, "d"), target=one.address)
        await two.router.activate(GrainId(echo_type, "e"), target=two.address)
        plain = await ClusterClient.connect(redis_url, cluster="bench-tracing")
        traced = await ClusterClient.connect(redis_url, cluster="bench-tracing", tracing=tracing)
        try:
            samples: dict[str, list[float]] = {}
            n = sz.seq * 2
            for _ in range(2 if sz.quick else 5):
                for on in (False, True):
                    for s in silos:
                        s.router.tracing = s.dispatcher.tracing = tracing if on else None
                    client = traced if on else plain
                    echo, driver = client.get_grain(BenchEcho, "e"), client.get_grain(BenchDriver, "d")
                    state = "on" if on else "off"
                    t0 = time.perf_counter()
                    for _ in range(n):
                        await echo.echo(SMALL)
                    samples.setdefault(f"client_grain_{state}", []).append(n / (time.perf_counter() - t0))
                    lat = await driver.sequential("e", n, SMALL)
                    samples.setdefault(f"grain_grain_{state}", []).append(len(lat) / sum(lat))
        finally:
            await plain.close()
            await traced.close()
    finally:
        for s in reversed(silos):
            await s.stop(graceful=False)
        provider.shutdown()
    out: dict[str, Any] = {k: common.summarize(v[1:] if len(v) > 2 else v) for k, v in samples.items()}
    for s in silos:
        s.router.tracing = s.dispatcher.tracing = None
    out["off_checks_ns"] = _off_checks_ns(silos[0])
    return out


def _off_checks_ns(silo: Any) -> float:
    """What tracing off adds to a call, timed alone: the router's and the dispatcher's tests."""
    import timeit

    router, dispatcher, header = silo.router, silo.dispatcher, [1, 1, "T", "k", "m", 1000, [], 0]

    def checks() -> None:
        _ = None if router.tracing is None else router.tracing.current_carrier()
        _ = len(header) > 8
        _ = None if dispatcher.tracing is None else dispatcher

    number = 200_000
    return min(timeit.repeat(checks, number=number, repeat=5)) / number * 1e9


def tracing_table(tr: dict[str, Any]) -> list[list[str]]:
    rows = []
    for shape, name in (("client_grain", "client→grain sequential 100B"), ("grain_grain", "grain→grain across silos sequential 100B")):
        off, on = _med(tr, f"{shape}_off"), _med(tr, f"{shape}_on")
        cost = f"+{(1 / on - 1 / off) * 1e6:.1f} µs/call" if off and on else "-"
        rows.append([name, f"{off:,.0f} /s" if off else "-", f"{on:,.0f} /s" if on else "-", common.ratio(on, off), cost])
    return rows


def measure_ray(sz: Sizes) -> dict[str, Any] | str:
    """Ray's numbers from a subprocess (its own event loops and workers), or why not."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install '.[bench]'): Ray columns skipped"
    proc = common.start_subprocess(["-m", "benchmarks.ray_calls", *(["--quick"] if sz.quick else [])])
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    text = proc.stdout.read()
    rc = proc.wait(600)
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if rc != 0 or not last.startswith("{"):
        return f"ray measurement failed (exit {rc}): {text[-500:]}"
    return json.loads(last)  # type: ignore[no-any-return]


def _med(d: dict[str, Any] | None, *path: str) -> float | None:
    cur: Any = d
    for p in path:
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    return float(cur["median"]) if isinstance(cur, dict) else float(cur)


def report(echo: dict[str, Any], rg: dict[str, Any], ray: dict[str, Any] | None) -> list[list[str]]:
    rows: list[list[str]] = []

    def row(name: str, value: float | None, spread: dict[str, Any] | None, unit: str,
            base: float | None, ray_value: float | None, ray_name: str = "") -> None:  # fmt: skip
        rows.append([
            name,
            f"{value:,.0f} {unit}" if value is not None and unit == "/s" else f"{value:.2f} {unit}" if value else "-",
            common.fmt_spread(spread) if spread else "",
            common.ratio(value, base),
            f"{ray_value:,.0f}" if ray_value and unit == "/s" else f"{ray_value:.2f}" if ray_value else "-",
            common.ratio(value, ray_value) + (f" ({ray_name})" if ray_name and ray_value else ""),
        ])  # fmt: skip

    # Like for like: redgrain's pipelined calls are coroutines gathered (a task each), as are the
    # echo's "coroutine per call" ones; the bare-futures echo, which no coroutine API can match,
    # gets its own ratio row.
    e_seq, e_pipe = _med(echo, "sequential_per_s"), _med(echo, "pipelined_per_s")
    e_fut = _med(echo, "pipelined_futures_per_s")
    row("bare asyncio+msgpack echo, sequential", e_seq, echo["sequential_per_s"], "/s", e_seq, None)
    row("bare echo, pipelined, a coroutine per call", e_pipe, echo["pipelined_per_s"], "/s", e_pipe, None)
    row("bare echo, pipelined, bare futures", e_fut, echo["pipelined_futures_per_s"], "/s", e_fut, None)
    for label in ("100B", "1MB"):
        seq = rg[f"client_grain_seq_{label}"]
        pipe = rg[f"client_grain_pipe_{label}"]
        row(f"client→grain sequential {label}", _med(seq, "per_s"), seq["per_s"], "/s", e_seq if label == "100B" else None,
            _med(ray, f"sync_seq_{label}", "per_s"), "sync actor")  # fmt: skip
        rows.append([f"  p50 / p99 latency {label}", f"{seq['p50_ms']:.3f} / {seq['p99_ms']:.3f} ms", "", "",
                     f"{ray[f'sync_seq_{label}']['p50_ms']:.3f} / {ray[f'sync_seq_{label}']['p99_ms']:.3f}" if ray else "-", ""])  # fmt: skip
        row(f"client→grain pipelined {label}", _med(pipe, "per_s"), pipe["per_s"], "/s", e_pipe if label == "100B" else None,
            _med(ray, f"async_pipe_{label}", "per_s"), "async actor")  # fmt: skip
        if label == "100B":
            rows.append(["  vs bare futures echo", "", "", common.ratio(_med(pipe, "per_s"), e_fut), "", ""])
        for where in ("one_silo", "across"):
            seq = rg[f"grain_grain_{where}_seq_{label}"]
            pipe = rg[f"grain_grain_{where}_pipe_{label}"]
            w = "on one silo" if where == "one_silo" else "across silos"
            row(f"grain→grain {w} sequential {label}", _med(seq, "per_s"), seq["per_s"], "/s", None,
                _med(ray, f"actor_actor_seq_{label}", "per_s"), "actor→actor")  # fmt: skip
            rows.append([f"  p50 / p99 latency {label}", f"{seq['p50_ms']:.3f} / {seq['p99_ms']:.3f} ms", "", "", "", ""])
            row(f"grain→grain {w} pipelined {label}", _med(pipe, "per_s"), pipe["per_s"], "/s", None,
                _med(ray, f"actor_actor_pipe_{label}", "per_s"), "actor→actor")  # fmt: skip
    for key, val in rg.items():
        if key.startswith("tensor_across_"):
            mb = key.removeprefix("tensor_across_")
            row(f"tensor {mb} grain→grain across silos", _med(val, "gb_per_s"), val["gb_per_s"], "GB/s", None,
                _med(ray, f"tensor_{mb}", "gb_per_s"), "ObjectRef actor→actor")  # fmt: skip
        elif key.startswith("tensor_echo_client_"):
            mb = key.removeprefix("tensor_echo_client_")
            row(f"tensor {mb} echo client→grain (2× bytes)", _med(val, "gb_per_s"), val["gb_per_s"], "GB/s", None, None)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks calls")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray columns")
    args = parser.parse_args(argv)
    sz = Sizes(args.quick)
    common.fix_torch_threads()
    from silo.messaging.frame import retain_freed_memory

    # The documented opt-in for clients that receive big tensors (silos always do it).
    retained = retain_freed_memory()
    print(f"# client process: retain_freed_memory() -> {retained}")
    facts = common.machine_facts()
    common.print_header("calls: client→grain, grain→grain, tensors; vs bare echo and Ray", facts, args.quick)
    echo = measure_echo(args.quick)
    with common.BenchCluster(2, env=PINNED) as cluster:
        rg = common.run(measure_redgrain(cluster, sz))
        # Issue 6's row: the same calls with the dashboard open and polling, phases alternating.
        rounds, seconds = (1, 0.3) if args.quick else (4, 2.0)
        board, board_cpu = common.run(dashboard_phases(cluster, rounds, seconds))
        traces = common.run(measure_tracing(cluster.redis_url, sz))
    # The same machine's loopback TCP, for the same-host Unix socket rows.
    with common.BenchCluster(2, env={**PINNED, "REDGRAIN_TRANSPORT__LOCAL_SOCKETS": "false"}) as cluster:
        tcp = common.run(measure_tcp(cluster, sz))
    # Mutual TLS on every link, same machine and run, for the TLS/plain ratios.
    with tempfile.TemporaryDirectory(prefix="redgrain-bench-tls-") as pki:
        tls_env = _certificates(Path(pki))
        with common.BenchCluster(2, env={**PINNED, **tls_env}) as cluster:
            secure = common.run(measure_tls(cluster, tls_env, sz))
    ray: dict[str, Any] | None = None
    ray_note = "skipped (--no-ray)"
    if not args.no_ray:
        got = measure_ray(sz)
        if isinstance(got, str):
            ray_note = got
        else:
            ray, ray_note = got, f"ray {facts['ray']}"
    print(f"# Ray: {ray_note}")
    common.print_table(["measure", "redgrain", "spread", "/bare echo", "Ray", "redgrain/Ray"], report(echo, rg, ray))
    print()
    board_rows, board_out = dashboard_table(board)
    common.print_table(["with the dashboard", "no dashboard", "spread", "dashboard open", "spread", "open/none",
                        "diff"], board_rows)  # fmt: skip
    print(dashboard_verdict(board, board_out))
    print(f"# dashboard + poller processes used {board_cpu:.1f}% of one core while open;"
          f" median of {rounds} alternating {seconds:g} s phases per side")  # fmt: skip
    print()
    common.print_table(["same host, two silos", "Unix socket (default)", "loopback TCP", "socket/TCP"],
                       local_socket_table(rg, tcp))  # fmt: skip
    print()
    common.print_table(["1 MB calls (issue 21)", "redgrain", "ratio", "goal"], one_mb_table(rg))
    print()
    common.print_table(["mutual TLS, same run (2 silos)", "plaintext", "TLS", "TLS/plain"], tls_table(rg, secure))
    print("# TLS: every link (client→silo, silo→silo, Unix sockets too) runs TLS 1.3 with certificates"
          " from a private CA; the plaintext column is the first table's cluster")
    print()
    common.print_table(["tracing (silos in one process)", "off", "on, 100% sampled", "on/off", "cost"],
                       tracing_table(traces))  # fmt: skip
    print(f"# tracing off: its checks on a call's path take {traces['off_checks_ns']:.0f} ns (timed alone);"
          " on: a CLIENT and a SERVER span per client call, a SERVER span per grain call, batched to a"
          " discarding exporter")  # fmt: skip
    common.write_result("calls", {"machine": facts, "quick": args.quick, "echo": echo, "redgrain": rg,
                                  "ray": ray, "ray_note": ray_note, "dashboard": board_out, "dashboard_added_cpu": board["added_cpu"],
                                  "dashboard_cpu_percent": board_cpu, "tcp": tcp, "tls": secure,
                                  "tracing": traces})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
