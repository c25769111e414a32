"""A persistent counter: its state comes back with the grain after a silo dies.

    python samples/counter.py            # private Redis + 2 silos; kills one mid-way
    python samples/counter.py --redis redis://127.0.0.1:6379 --cluster dev
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pydantic import BaseModel

from grains import Grain


class Counter(Grain):
    class State(BaseModel):
        value: int = 0

    async def add(self, n: int = 1) -> int:
        self.state.value += n
        await self.write_state()  # acknowledged only once durable
        return self.state.value

    async def get(self) -> int:
        return self.state.value

    async def where(self) -> str:
        return self.silo.endpoint


async def count(redis_url: str, cluster: str, kill: object = None) -> int:
    from silo import ClusterClient, errors

    async with await ClusterClient.connect(redis_url, cluster=cluster) as client:
        counter = client.get_grain(Counter, "visits")
        for _ in range(5):
            await counter.add(1)
        host = await counter.where()
        print(f"counter = {await counter.get()} (hosted on {host})")
        if callable(kill):
            kill(host)
            print(f"killed the silo at {host} (SIGKILL)")
        value = None
        for _ in range(100):
            try:
                value = await counter.add(1)
                break
            except errors.SiloUnavailableError:
                await asyncio.sleep(0.1)  # the cluster is declaring the silo dead
        print(f"counter = {value} (now on {await counter.where()}): state came back with the grain")
        return int(value or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis")
    parser.add_argument("--cluster", default="dev")
    args = parser.parse_args(argv)
    if args.redis:
        asyncio.run(count(args.redis, args.cluster))
        return 0
    from silo.testing.local import LocalCluster

    with LocalCluster(grains="samples.counter", silos=2, cluster=args.cluster) as lc:

        def kill(endpoint: str) -> None:
            for s in lc.silos:
                if s.address is not None and s.address.endpoint == endpoint:
                    s.kill()

        value = asyncio.run(count(lc.redis_url, lc.cluster, kill))
    return 0 if value == 6 else 1


if __name__ == "__main__":
    sys.exit(main())
