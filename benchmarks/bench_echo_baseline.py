"""The baseline every call benchmark is compared with: a bare asyncio + msgpack echo.

``python -m benchmarks echo_baseline [--quick]``. A server subprocess (uvloop,
``asyncio.Protocol``, u32-length-prefixed msgpack ``[id, value]`` frames) echoes
each request; the client issues calls the way a redgrain client does (one
coroutine per call, ``asyncio.gather`` for the pipelined case). No request
routing, no deadlines, no turn scheduling: the floor of what Python plus asyncio
plus msgpack costs per round trip on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import struct
import sys
import time
from typing import Any

import msgpack

from benchmarks import common

LEN = struct.Struct("<I")


class _Framed(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        pos, n = 0, len(self.buf)
        while n - pos >= 4:
            (size,) = LEN.unpack_from(self.buf, pos)
            if n - pos - 4 < size:
                break
            self.on_message(msgpack.unpackb(self.buf[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        del self.buf[:pos]

    def send(self, msg: Any) -> None:
        body = msgpack.packb(msg)
        assert self.transport is not None
        self.transport.write(LEN.pack(len(body)) + body)

    def on_message(self, msg: Any) -> None:
        raise NotImplementedError


class _Server(_Framed):
    def on_message(self, msg: Any) -> None:
        self.send(msg)


class _Client(_Framed):
    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.ids = itertools.count()
        self.loop = asyncio.get_running_loop()

    def on_message(self, msg: Any) -> None:
        self.pending.pop(msg[0]).set_result(msg[1])

    def request(self, value: Any) -> asyncio.Future[Any]:
        i = next(self.ids)
        fut = self.pending[i] = self.loop.create_future()
        self.send([i, value])
        return fut

    async def echo(self, value: Any) -> Any:
        return await self.request(value)


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Server, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin


async def measure(port: int, quick: bool) -> dict[str, Any]:
    """Sequential round trips/s (and p50/p99) and pipelined round trips/s against the server."""
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(_Client, "127.0.0.1", port)
    payload = b"x" * 100
    n_seq = 200 if quick else 5000
    n_pipe = 200 if quick else 10_000
    repeats = 2 if quick else 5
    lat: list[float] = []

    sequential, pipelined = common.call_rates(lambda: client.echo(payload), n_seq, n_pipe, lat)

    async def pipelined_futures() -> float:
        # No task per call: the most a pipelined asyncio client can do.
        t0 = time.perf_counter()
        await asyncio.gather(*[client.request(payload) for _ in range(n_pipe)])
        return n_pipe / (time.perf_counter() - t0)

    seq = await common.repeat(sequential, repeats)
    p50, p99 = common.percentile(lat, 0.5), common.percentile(lat, 0.99)
    pipe = await common.repeat(pipelined, repeats)
    pipe_raw = await common.repeat(pipelined_futures, repeats)
    assert client.transport is not None
    client.transport.close()
    return {"sequential_per_s": seq, "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "pipelined_per_s": pipe,
            "pipelined_futures_per_s": pipe_raw,
            "n_sequential": n_seq, "n_pipelined": n_pipe}  # fmt: skip


def measure_in_subprocess(quick: bool) -> dict[str, Any]:
    """Start the echo server in its own process, measure from this one, stop it."""
    server = common.start_subprocess(["-m", "benchmarks.bench_echo_baseline", "--serve"])
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        return common.run(measure(port, quick))
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(10)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks echo_baseline")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        common.run(_serve())
        return 0
    facts = common.machine_facts()
    common.print_header("bare asyncio + msgpack echo (client process -> server process)", facts, args.quick)
    r = measure_in_subprocess(args.quick)
    common.print_table(
        ["measure", "median", "spread"],
        [
            ["sequential round trips/s", common.fmt_rate(r["sequential_per_s"]["median"]), common.fmt_spread(r["sequential_per_s"])],
            ["sequential p50 / p99 ms", f"{r['p50_ms']:.3f} / {r['p99_ms']:.3f}", ""],
            ["pipelined round trips/s (a coroutine per call)", common.fmt_rate(r["pipelined_per_s"]["median"]), common.fmt_spread(r["pipelined_per_s"])],
            ["pipelined round trips/s (bare futures)", common.fmt_rate(r["pipelined_futures_per_s"]["median"]), common.fmt_spread(r["pipelined_futures_per_s"])],
        ],
    )  # fmt: skip
    common.write_result("echo_baseline", {"machine": facts, "quick": args.quick, "echo": r})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
