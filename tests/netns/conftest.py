"""Fixtures of the partition scenarios: one private network per test module, a cluster per test.

The scenarios need root and network namespaces. Where the machine does not
allow them the tests are skipped with the reason, and the session summary
says loudly that they did not run (never a silent pass).
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.netns.cluster import REDIS_PORT, NetCluster, Process, start_redis
from tests.netns.net import Host, Network, unavailable

_names = itertools.count()
SILO_HOSTS = 4


@functools.cache
def missing() -> str | None:
    """Why namespaces cannot be used here (checked once per session), or None.

    ``REDGRAIN_NETNS=off`` turns the scenarios off on purpose (they are then reported as not run).
    """
    if os.environ.get("REDGRAIN_NETNS", "").lower() in ("0", "off", "no"):
        return "turned off by REDGRAIN_NETNS=off"
    return unavailable()


@dataclass
class Lab:
    """The hosts of one module's network and the Redis that lives on one of them."""

    net: Network
    redis: Host
    silos: list[Host]
    client: Host
    relay: Host
    """Hosts the slow/lossy relay (scenario 4)."""
    workdir: Path
    redis_url: str
    clusters: list[NetCluster] = field(default_factory=list)
    relays: list[Process] = field(default_factory=list)

    def heal_all(self) -> None:
        hosts = [self.redis, *self.silos, self.client, self.relay]
        for a in hosts:
            self.net.rejoin(a)
            for b in hosts:
                if a is not b:
                    self.net.heal(a, b)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    reason = missing()
    if reason is not None:
        pytest.skip(f"network-namespace partition scenarios need root and `ip netns`: {reason}")
    workdir = tmp_path_factory.mktemp("netns")
    with Network() as net:
        redis_host = net.add_host("redis")
        silos = [net.add_host(f"s{i + 1}") for i in range(SILO_HOSTS)]
        client = net.add_host("cl")
        relay = net.add_host("px")
        net.add_observer()
        url = f"redis://{redis_host.address}:{REDIS_PORT}/0"
        server = start_redis(redis_host, workdir, url)
        lab = Lab(net, redis_host, silos, client, relay, workdir, url)
        try:
            yield lab
        finally:
            server.kill()


@pytest.fixture
def cluster_of(lab: Lab, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Lab]:
    """The lab, with every cluster and relay a test starts stopped and every link healed after it."""
    try:
        yield lab
    finally:
        for c in lab.clusters:
            c.stop()
        for p in lab.relays:
            p.signal(signal.SIGKILL)
            p.kill()
        lab.clusters.clear()
        lab.relays.clear()
        lab.heal_all()


def cluster_name(tag: str) -> str:
    return f"nn{next(_names)}-{tag}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = [
        r for r in terminalreporter.stats.get("skipped", []) if "tests/netns/" in getattr(r, "nodeid", "")
    ]
    if skipped and missing() is not None:
        terminalreporter.write_sep(
            "!", f"{len(skipped)} partition scenarios (tests/netns) NOT RUN: {missing()}", yellow=True
        )
