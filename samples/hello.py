"""Hello, grains: a greeter grain and a client that calls it.

Run it end to end (starts a private Redis and two silo processes)::

    python samples/hello.py

or against silos you started yourself::

    redgrain silo --redis redis://127.0.0.1:6379 --cluster dev --grains samples.hello &
    redgrain silo --redis redis://127.0.0.1:6379 --cluster dev --grains samples.hello &
    python samples/hello.py --redis redis://127.0.0.1:6379 --cluster dev
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grains import Grain


class Greeter(Grain):
    """One greeter per key; it remembers how many times it greeted."""

    def __init__(self) -> None:
        self.greeted = 0

    async def hello(self, name: str) -> str:
        self.greeted += 1
        return f"Hello {name}, from greeter {self.key!r} on silo {self.silo.endpoint} (greeting #{self.greeted})"


async def greet(redis_url: str, cluster: str) -> list[str]:
    from silo import ClusterClient

    async with await ClusterClient.connect(redis_url, cluster=cluster) as client:
        alice = client.get_grain(Greeter, "alice")  # no create, no lookup
        bob = client.get_grain(Greeter, "bob")
        lines = [await alice.hello("world"), await bob.hello("world"), await alice.hello("again")]
    for line in lines:
        print(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", help="use silos already running against this Redis")
    parser.add_argument("--cluster", default="dev")
    args = parser.parse_args(argv)
    if args.redis:
        asyncio.run(greet(args.redis, args.cluster))
        return 0
    from silo.testing.local import LocalCluster

    print("starting a private Redis and 2 silos ...", flush=True)
    with LocalCluster(grains="samples.hello", silos=2, cluster=args.cluster) as lc:
        print(f"silos: {', '.join(str(s.address) for s in lc.silos)}", flush=True)
        asyncio.run(greet(lc.redis_url, lc.cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
