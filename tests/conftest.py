"""Root fixtures: a private redis-server per session, flushed per test."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from silo.client import ClusterClient
from silo.settings import MembershipSettings, SiloSettings
from silo.silo import Silo
from silo.testing.embedded import RedisServer
from silo.testing.redis_cluster import RedisClusterGroup
from tests.helpers import SiloProcess

_cluster_names = itertools.count()

# Fast failure detection for tests; the defaults are in silo/settings.py.
FAST_MEMBERSHIP = MembershipSettings(
    heartbeat_s=0.2, suspect_after_s=0.8, probe_timeout_s=0.3, dead_after_s=1.2, refresh_s=0.5
)
FAST_ENV = {
    "REDGRAIN_MEMBERSHIP__HEARTBEAT_S": "0.2",
    "REDGRAIN_MEMBERSHIP__SUSPECT_AFTER_S": "0.8",
    "REDGRAIN_MEMBERSHIP__PROBE_TIMEOUT_S": "0.3",
    "REDGRAIN_MEMBERSHIP__DEAD_AFTER_S": "1.2",
    "REDGRAIN_MEMBERSHIP__REFRESH_S": "0.5",
    # Longer than dead_after_s, as by default, so a silo cut off is fenced by its monitors' silence
    # (Liveness), not by its lease; short enough that a silo cut from Redis fences within seconds.
    "REDGRAIN_MEMBERSHIP__LEASE_S": "3.0",
    "REDGRAIN_MEMBERSHIP__IDLE_READ_S": "2.0",
}


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server on a free port for the whole session (never the machine's 6379)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session server, emptied before the test."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterGroup]:
    """A real 3-master Redis Cluster (redis-server --cluster-enabled yes x 3) for the whole session."""
    with RedisClusterGroup(tmp_path_factory.mktemp("redis-cluster"), masters=3) as group:
        yield group


@pytest.fixture
def redis_cluster_url(redis_cluster_group: RedisClusterGroup) -> str:
    """``redis+cluster://`` URL of the session's Redis Cluster, every master emptied before the test."""
    for port in redis_cluster_group.masters():
        with redis_cluster_group.client(port) as c:
            c.flushall()
    return redis_cluster_group.url


@pytest.fixture(params=["redis", "redis-cluster"])
def backend_url(request: pytest.FixtureRequest) -> str:
    """The test runs twice: on one Redis, and on the 3-master Redis Cluster."""
    return str(request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url"))


@pytest.fixture
def fresh_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, with AOF in tmp_path: kill and restart it freely."""
    with RedisServer(appendonly=True, data_dir=tmp_path / "redis") as server:
        yield server


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    return f"t{next(_cluster_names)}-{request.node.name[:40]}"


@pytest.fixture
async def cluster(
    redis_url: str, cluster_name: str
) -> AsyncIterator[Callable[..., Awaitable[list[Silo]]]]:
    """``await cluster(n, **settings)``: n silos in this process, stopped after the test."""
    silos: list[Silo] = []

    async def start(n: int = 1, **overrides: Any) -> list[Silo]:
        new = []
        for _ in range(n):
            kw: dict[str, Any] = {
                "redis_url": redis_url,
                "cluster": cluster_name,
                "grains": ("tests.sample_grains",),
                "membership": FAST_MEMBERSHIP,
            }
            kw.update(overrides)
            silo = await Silo(SiloSettings(**kw)).start()
            silos.append(silo)
            new.append(silo)
        # A silo learns of later joins from a pub/sub message it may not be subscribed for
        # yet, else from its next periodic refresh: make every view current before the test.
        for s in silos:
            await s.view.refresh()
        return new

    yield start
    for silo in reversed(silos):
        await silo.stop(graceful=False)


@pytest.fixture
async def client(redis_url: str, cluster_name: str) -> AsyncIterator[ClusterClient]:
    c = await ClusterClient.connect(redis_url, cluster=cluster_name)
    yield c
    await c.close()


@pytest.fixture
def silo_processes(
    redis_url: str, cluster_name: str, tmp_path: Path
) -> Iterator[Callable[..., list[SiloProcess]]]:
    """``silo_processes(n)``: n real silo subprocesses (fast failure detection), all stopped after."""
    procs: list[SiloProcess] = []

    def start(n: int = 1, **kw: Any) -> list[SiloProcess]:
        env = {**FAST_ENV, **kw.pop("env", {})}
        new = [SiloProcess(redis_url, cluster_name, tmp_path, env=env, **kw) for _ in range(n)]
        # All spawned, then all awaited (as LocalCluster.start does): their imports (torch) overlap.
        for p in new:
            procs.append(p)
            p.spawn()
        for p in new:
            p.wait_ready()
        return new

    yield start
    for p in procs:
        if p.alive():
            p.resume() if p.proc else None
            p.kill()
