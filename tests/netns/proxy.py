"""A TCP relay that makes a link slow and lossy, for kernels without ``tc netem``.

Run inside a namespace: ``python -m tests.netns.proxy LISTEN_HOST:PORT=TARGET_HOST:PORT ...
--delay-ms 200 --loss 0.05``. Every byte relayed (both directions) is held
``delay-ms`` before it is written on. Loss is emulated the way TCP above the
kernel experiences it: not as missing or corrupt bytes but as a retransmission
delay. Each chunk read is "lost" with probability ``loss`` and then waits one
more retransmission timeout (``rto-ms``, at least 200 ms as in Linux; doubled
each time the retransmission is lost again), and, as in TCP, everything behind
it waits too (in-order delivery). A chunk is one read of up to ``chunk`` bytes,
so big transfers see fewer losses than per-segment loss would give them; the
module says so rather than pretend to be netem.

The impairment is off until the process gets SIGUSR1 (or starts with ``--on``);
SIGUSR2 turns it off again, so a cluster can start at full speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Impairment:
    delay_s: float
    loss: float
    rto_s: float
    on: bool = False

    def hold_s(self, rng: random.Random) -> float:
        """How long one chunk is held before it goes on."""
        if not self.on:
            return 0.0
        extra, rto = 0.0, self.rto_s
        while rng.random() < self.loss:
            extra += rto
            rto *= 2
        return self.delay_s + extra


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    imp: Impairment,
    rng: random.Random,
    chunk: int,
) -> None:
    loop = asyncio.get_running_loop()
    line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=256)

    async def feed() -> None:
        try:
            while data := await reader.read(chunk):
                await line.put((loop.time() + imp.hold_s(rng), data))
        except (ConnectionError, OSError):
            pass
        await line.put((loop.time() + imp.hold_s(rng), b""))

    feeder = asyncio.ensure_future(feed())
    last = 0.0
    try:
        while True:
            due, data = await line.get()
            due = max(due, last)  # in order: a held chunk holds everything behind it
            last = due
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await feeder


async def _relay(
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
    target: tuple[str, int],
    imp: Impairment,
    rng: random.Random,
    chunk: int,
) -> None:
    try:
        up_r, up_w = await asyncio.wait_for(asyncio.open_connection(*target), 10.0)
    except (OSError, TimeoutError):
        client_w.close()
        return
    try:
        await asyncio.gather(_pump(client_r, up_w, imp, rng, chunk), _pump(up_r, client_w, imp, rng, chunk))
    finally:
        for w in (up_w, client_w):
            w.close()


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.netns.proxy")
    p.add_argument("routes", nargs="+", help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    p.add_argument("--delay-ms", type=float, default=200.0, help="one-way delay added in each direction")
    p.add_argument("--loss", type=float, default=0.05, help="probability a chunk needs a retransmission")
    p.add_argument("--rto-ms", type=float, default=200.0, help="first retransmission timeout (Linux: >= 200)")
    p.add_argument("--chunk", type=int, default=16384, help="largest read relayed as one unit")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--on", action="store_true", help="impair from the start (else wait for SIGUSR1)")
    p.add_argument("--ready-file", default=None)
    args = p.parse_args(argv)
    imp = Impairment(args.delay_ms / 1000.0, args.loss, max(0.2, args.rto_ms / 1000.0), on=args.on)
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(imp, "on", True))
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(imp, "on", False))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    servers = []
    for route in args.routes:
        listen, _, target = route.partition("=")
        host, port = _endpoint(listen)
        dest = _endpoint(target)

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter, dest: tuple[str, int] = dest) -> None:
            await _relay(r, w, dest, imp, rng, args.chunk)

        servers.append(await asyncio.start_server(handle, host, port, reuse_address=True))
    if args.ready_file:
        Path(args.ready_file).write_text("ready")  # once, before any traffic: blocking is harmless
    await stop.wait()
    for s in servers:
        s.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(sys.argv[1:]))
