"""Train an MLP on the 8x8 digits with 2 silos, 2 trainers and 2 parameter shards.

Run it end to end (starts a private Redis and two silo processes)::

    python samples/train_digits.py

or against silos you started yourself (``redgrain silo --grains grains.training``)::

    python samples/train_digits.py --redis redis://127.0.0.1:6379 --cluster dev

The job is ``samples/digits.toml``; the same runs with ``redgrain train samples/digits.toml``.
Exits 0 when the test accuracy reaches 95%.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from grains.training import CoordinatorGrain, TrainingStatus, load_job_file
from grains.training.console import watch

JOB_FILE = os.path.join(ROOT, "samples", "digits.toml")
TARGET = 0.95


async def train(redis_url: str, cluster: str, job_file: str = JOB_FILE) -> TrainingStatus:
    from silo import ClusterClient

    job_id, spec = load_job_file(job_file)
    async with await ClusterClient.connect(redis_url, cluster=cluster) as client:
        coord = client.get_grain(CoordinatorGrain, job_id or "digits")
        await coord.start(spec)
        return await watch(coord, timeout_s=300)  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", help="use this Redis and its silos instead of starting a local cluster")
    parser.add_argument("--cluster", default="dev")
    args = parser.parse_args()
    if args.redis:
        st = asyncio.run(train(args.redis, args.cluster))
    else:
        from silo.testing.local import LocalCluster

        os.chdir(ROOT)  # the silos import grains.training from here
        with LocalCluster("grains.training", silos=2, cluster="digits-sample") as lc:
            st = asyncio.run(train(lc.redis_url, lc.cluster))
    acc = st.accuracy or 0.0
    print(f"job {st.job}: {st.status}, test accuracy {acc:.2%} after {st.step} steps "
          f"({st.samples_per_s:,.0f} samples/s, {st.bytes_per_step / 1024:.1f} KB/step)")  # fmt: skip
    return 0 if st.status == "completed" and acc >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
