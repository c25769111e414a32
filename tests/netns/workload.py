"""Client code of the partition scenarios, run as a process in the client's namespace.

``python -m tests.netns.workload --redis URL --cluster C --out FILE --stop-file F
--method add --keys k0,k1 --workers 4 --timeout 3``

Each worker calls ``NetCounter.<method>`` on the keys in turn, each call with
a fresh operation id and the given deadline, until the stop file appears.
Every call writes a ``start`` line before and an ``end`` line after (JSON, one
per line, flushed), so the test can cut a link while a call is in flight and
later check every call's outcome and timing. ``time.monotonic()`` is
machine-wide on Linux, so the test compares these times with its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, TextIO

from silo import errors
from silo.client import ClusterClient

HUNG_AFTER_S = 15.0
"""A call still unanswered this long after its deadline is recorded as never answered."""


class Recorder:
    def __init__(self, out: TextIO) -> None:
        self._out = out

    def line(self, **fields: Any) -> None:
        self._out.write(json.dumps(fields) + "\n")
        self._out.flush()


async def _worker(
    client: ClusterClient, args: argparse.Namespace, w: int, rec: Recorder, keys: list[str]
) -> None:
    i = 0
    while not os.path.exists(args.stop_file):
        key = keys[(w + i) % len(keys)]
        i += 1
        op = f"{args.tag}-w{w}-{i}"
        ref: Any = client.get_grain("NetCounter", key).with_timeout(args.timeout)
        if args.method == "add":
            call = ref.add(op)
        elif args.method == "slow_add":
            call = ref.slow_add(op, args.seconds)
        else:  # add_via: the grain `key` adds to the grain `key`+"-b" (another silo, often)
            call = ref.add_via(f"{key}-b", op, args.timeout)
        t0 = time.monotonic()
        rec.line(ev="start", w=w, key=key, op=op, m=args.method, t0=t0)
        try:
            res = await asyncio.wait_for(call, args.timeout + HUNG_AFTER_S)
            rec.line(ev="end", w=w, key=key, op=op, m=args.method, t0=t0, t1=time.monotonic(), ok=True, res=res)
        except TimeoutError:
            rec.line(ev="end", w=w, key=key, op=op, m=args.method, t0=t0, t1=time.monotonic(), ok=False,
                     err="never answered")  # fmt: skip
        except errors.RedgrainError as exc:
            rec.line(ev="end", w=w, key=key, op=op, m=args.method, t0=t0, t1=time.monotonic(), ok=False,
                     err=type(exc).__name__, msg=str(exc)[:300])  # fmt: skip
            await asyncio.sleep(0.05)
        if args.once:
            return
        await asyncio.sleep(args.gap)


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.netns.workload")
    p.add_argument("--redis", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--method", choices=["add", "slow_add", "add_via"], default="add")
    p.add_argument("--keys", required=True, help="comma-separated grain keys")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3.0, help="deadline of each call")
    p.add_argument("--seconds", type=float, default=1.0, help="slow_add: how long the method sleeps")
    p.add_argument("--gap", type=float, default=0.02, help="pause between one worker's calls")
    p.add_argument("--once", action="store_true", help="each worker makes one call")
    p.add_argument("--tag", default="", help="prefix of operation ids (default: the output file's stem)")
    args = p.parse_args(argv)
    keys = [k for k in args.keys.split(",") if k]
    args.tag = args.tag or os.path.splitext(os.path.basename(args.out))[0]
    with open(args.out, "a") as out:  # noqa: ASYNC230 - line-sized appends, flushed before each call goes out
        rec = Recorder(out)
        client = await ClusterClient.connect(args.redis, cluster=args.cluster)
        rec.line(ev="ready", t=time.monotonic())
        try:
            await asyncio.gather(*(_worker(client, args, w, rec, keys) for w in range(args.workers)))
        finally:
            rec.line(ev="done", t=time.monotonic())
            await client.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
