"""A script that raises without closing its client (or silo) still exits, with its traceback.

Before silo/shutdown.py, ``asyncio.run``'s shutdown hung in 2 of 3 such runs:
the cancel it sent the membership view's listener was swallowed inside
redis-py, and the loop went on polling. The bound is the subprocess timeout;
what is asserted is the exit and the traceback, not the speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow

CLIENT_SCRIPT = """
import asyncio, sys
from silo.client import ClusterClient

async def main(url, cluster):
    client = await ClusterClient.connect(url, cluster=cluster)
    raise RuntimeError("raised right after connecting")

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

SILO_SCRIPT = """
import asyncio, sys
from silo.settings import MembershipSettings, SiloSettings
from silo.silo import Silo

async def main(url, cluster):
    fast = MembershipSettings(heartbeat_s=0.2, suspect_after_s=0.8, probe_timeout_s=0.3, dead_after_s=1.2, refresh_s=0.5)
    silo = await Silo(SiloSettings(redis_url=url, cluster=cluster, grains=("samples.hello",), membership=fast)).start()
    raise RuntimeError("raised right after the silo started")

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _run_all(script: Path, redis_url: str, cluster: str, n: int, timeout_s: float) -> list[tuple[int | None, str]]:
    """Start ``n`` runs at once; each gets ``timeout_s`` from the start of all (killed past it)."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), redis_url, f"{cluster}-{i}"],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + timeout_s
    results: list[tuple[int | None, str]] = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, err))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            results.append((None, err))
    return results


def test_script_raising_after_connect_always_exits_with_its_traceback(
    redis_url: str, cluster_name: str, tmp_path: Path
) -> None:
    script = tmp_path / "raise_after_connect.py"
    script.write_text(textwrap.dedent(CLIENT_SCRIPT))
    results = _run_all(script, redis_url, cluster_name, n=20, timeout_s=90)
    hung = [err for code, err in results if code is None]
    assert not hung, f"{len(hung)} of 20 runs did not exit; the first one's stderr:\n{hung[0][-3000:]}"
    for code, err in results:
        assert code == 1, err
        assert "Traceback (most recent call last)" in err, err
        assert err.rstrip().endswith("RuntimeError: raised right after connecting"), err[-2000:]


def test_script_raising_after_silo_start_exits_and_the_silo_leaves(
    redis_url: str, cluster_name: str, tmp_path: Path
) -> None:
    import redis

    from silo.keys import Keys

    script = tmp_path / "raise_after_silo.py"
    script.write_text(textwrap.dedent(SILO_SCRIPT))
    results = _run_all(script, redis_url, cluster_name, n=4, timeout_s=90)
    for code, err in results:
        assert code == 1, err[-3000:]
        assert err.rstrip().endswith("RuntimeError: raised right after the silo started"), err[-2000:]
    # Each silo stopped (without the hand-off) as its loop ended: its row says Dead.
    r = redis.Redis.from_url(redis_url)
    try:
        for i in range(4):
            rows = r.hvals(Keys(f"{cluster_name}-{i}").members)
            assert rows and all(b'"Dead"' in row for row in rows), rows
    finally:
        r.close()
