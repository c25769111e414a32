"""Redis ACL users and TLS, end to end against a real redis-server started with those options."""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from silo import errors
from silo.client import ClusterClient
from silo.settings import SiloSettings
from silo.silo import Silo
from silo.testing.embedded import RedisServer, TlsFiles
from tests.conftest import FAST_ENV, FAST_MEMBERSHIP
from tests.helpers import SiloProcess
from tests.sample_grains import Counter, Relay
from tests.security.certs import make_certificates

USER, PASSWORD = "grainuser", "s3cret/with:odd@chars"


def _start(server: RedisServer) -> RedisServer:
    try:
        return server.start()
    except errors.ConfigError as exc:
        if server.tls is not None and re.search(r"tls|bad directive", str(exc), re.IGNORECASE):
            pytest.fail(
                "this redis-server build cannot serve TLS (built without BUILD_TLS=yes); "
                f"install one that can (Debian/Ubuntu redis-server 6+ does):\n{exc}"
            )
        raise


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = _start(RedisServer(username=USER, password=PASSWORD, data_dir=tmp_path / "acl"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tls_files(tmp_path: Path) -> TlsFiles:
    return make_certificates(tmp_path / "certs", client_cert=True)


@pytest.fixture
def tls_redis(tmp_path: Path, tls_files: TlsFiles) -> Iterator[RedisServer]:
    server = _start(
        RedisServer(username=USER, password=PASSWORD, tls=tls_files, data_dir=tmp_path / "tls")
    )
    try:
        yield server
    finally:
        server.stop()


@asynccontextmanager
async def _silos(url: str, cluster: str, n: int) -> AsyncIterator[list[Silo]]:
    silos: list[Silo] = []
    try:
        for _ in range(n):
            settings = SiloSettings(
                redis_url=url,
                cluster=cluster,
                grains=("tests.sample_grains",),
                membership=FAST_MEMBERSHIP,
            )
            silos.append(await Silo(settings).start())
        # Each silo places new activations over the members it knows: make every view
        # current, or an early silo may not know the later one yet and place everything on itself.
        for s in silos:
            await s.view.refresh()
        yield silos
    finally:
        for s in reversed(silos):
            await s.stop(graceful=False)


async def _exercise(client: ClusterClient, n_silos: int) -> None:
    """State writes, and grain-to-grain calls across silos."""
    counters = [client.get_grain(Counter, f"c{i}") for i in range(6)]
    assert await asyncio.gather(*(c.add(2) for c in counters)) == [2] * 6
    if n_silos == 1:
        return
    # New grains until one relay's target lands on the other silo. A silo started in another
    # process learns of one started after it through membership's channel, a moment later;
    # until then it places every new grain on itself. So this waits for that, within a deadline.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    for i in itertools.count():
        out = await client.get_grain(Relay, f"r{i}").relay(f"e{i}", i)
        assert out["value"] == i
        if out["here"] != out["there"]:
            return
        assert loop.time() < deadline, f"placement never spread two grains over two silos in {i + 1} tries"


async def test_silos_and_client_work_with_an_acl_user(
    acl_redis: RedisServer, cluster_name: str
) -> None:
    assert acl_redis.url.startswith(f"redis://{USER}:")
    async with (
        _silos(acl_redis.url, cluster_name, 2) as silos,
        await ClusterClient.connect(acl_redis.url, cluster=cluster_name) as client,
    ):
        await _exercise(client, len(silos))


async def test_wrong_acl_password_fails_at_start_with_a_clear_error(
    acl_redis: RedisServer, cluster_name: str
) -> None:
    bad = acl_redis.url.replace("s3cret", "wrong")
    with pytest.raises(errors.StorageError, match="invalid username-password|WRONGPASS"):
        await ClusterClient.connect(bad, cluster=cluster_name)
    anonymous = f"redis://127.0.0.1:{acl_redis.port}/0"  # the default user is switched off
    with pytest.raises(errors.StorageError):
        await Silo(
            SiloSettings(redis_url=anonymous, cluster=cluster_name, grains=("tests.sample_grains",))
        ).start()


async def test_silo_processes_and_client_work_over_tls_with_client_certificates(
    tls_redis: RedisServer, cluster_name: str, tmp_path: Path
) -> None:
    url = tls_redis.url
    assert url.startswith("rediss://") and "ssl_ca_certs=" in url and "ssl_certfile=" in url
    # One silo in a process of its own (the CLI path, its heartbeat thread's own
    # synchronous connection), one in this process.
    proc = SiloProcess(url, cluster_name, tmp_path, env=FAST_ENV).start()
    try:
        async with (
            _silos(url, cluster_name, 1) as silos,
            await ClusterClient.connect(url, cluster=cluster_name) as client,
        ):
            await _exercise(client, 1 + len(silos))
        assert proc.alive(), proc.output()[-2000:]
    finally:
        proc.kill()


async def test_tls_server_refuses_plain_and_certificate_less_clients(
    tls_redis: RedisServer, tls_files: TlsFiles, cluster_name: str
) -> None:
    plain = f"redis://{USER}:x@127.0.0.1:{tls_redis.port}/0"
    with pytest.raises(errors.StorageError):
        await ClusterClient.connect(plain, cluster=cluster_name)
    no_cert = tls_redis.url.split("?")[0] + f"?ssl_ca_certs={tls_files.ca_file}"
    with pytest.raises(errors.StorageError):
        await ClusterClient.connect(no_cert, cluster=cluster_name)
