"""The cluster secret end to end: clients and silos with it work, peers without it are refused.

Frame-level handshake tests (raw sockets) live in tests/silo/messaging/test_transport.py;
these go through the real client, router and silo.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from grains.ids import GrainId
from silo import errors
from silo.client import ClusterClient
from silo.settings import ClientSettings, SiloSettings, TransportSettings
from silo.silo import Silo
from tests.helpers import SiloProcess
from tests.sample_grains import Echo, RandomEcho, Relay

SECRET = "correct horse battery staple"

ClusterFactory = Callable[..., Awaitable[list[Silo]]]


def _transport(secret: str | None) -> TransportSettings:
    return TransportSettings(cluster_secret=SecretStr(secret) if secret is not None else None)


async def _client(redis_url: str, cluster: str, secret: str | None) -> ClusterClient:
    return await ClusterClient.connect(
        redis_url, cluster=cluster, settings=ClientSettings(transport=_transport(secret))
    )


async def test_client_without_the_secret_gets_authentication_error(
    cluster: ClusterFactory, redis_url: str, cluster_name: str
) -> None:
    await cluster(1, transport=_transport(SECRET))
    c = await _client(redis_url, cluster_name, None)
    try:
        with pytest.raises(errors.AuthenticationError, match="requires a cluster secret"):
            await c.get_grain(Echo, "a").with_timeout(3).echo(1)
    finally:
        await c.close()


async def test_client_with_a_wrong_secret_is_refused_logged_and_counted(
    cluster: ClusterFactory, redis_url: str, cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    (silo,) = await cluster(1, transport=_transport(SECRET))
    c = await _client(redis_url, cluster_name, "not the secret")
    caplog.set_level(logging.WARNING, logger="redgrain.transport")
    try:
        # The silo drops the connection without telling a stranger why, so the
        # caller sees the peer break (and retries until its deadline).
        with pytest.raises((errors.AuthenticationError, errors.SiloUnavailableError)):
            await c.get_grain(Echo, "a").with_timeout(1.5).echo(1)
    finally:
        await c.close()
    assert silo.transport.statistics().refused >= 1
    assert any("refused connection" in r.getMessage() for r in caplog.records)
    assert len(silo.catalog) == 0, "no grain may run for an unauthenticated caller"


async def test_two_silos_and_a_client_with_the_secret_call_grain_to_grain(
    cluster: ClusterFactory, redis_url: str, cluster_name: str
) -> None:
    a, b = await cluster(2, transport=_transport(SECRET))
    c = await _client(redis_url, cluster_name, SECRET)
    try:
        found = None
        for i in range(40):
            out = await c.get_grain(Relay, f"r{i}").relay(f"e{i}", i)
            if out["here"] != out["there"]:
                found = out
                break
        assert found is not None, "placement never spread two grains over two silos"
        assert {found["here"], found["there"]} == {str(a.address), str(b.address)}
    finally:
        await c.close()
    assert a.transport.statistics().refused == 0 and b.transport.statistics().refused == 0


async def test_silo_without_the_secret_cannot_call_into_a_cluster_that_has_one(
    cluster: ClusterFactory, redis_url: str, cluster_name: str
) -> None:
    a, b = await cluster(2, transport=_transport(SECRET))
    (outsider,) = await cluster(1, transport=_transport(None))
    c = await _client(redis_url, cluster_name, SECRET)
    try:
        key = "inside"
        await c.get_grain(Echo, key).echo(1)  # activated on a or b, never on the outsider
        owner = await outsider.directory.lookup(GrainId("Echo", key))
        assert owner is not None and owner.silo in (a.address, b.address)
        with pytest.raises(errors.AuthenticationError):
            await outsider.get_grain(Echo, key).with_timeout(3).echo(2)
    finally:
        await c.close()


async def test_silos_with_the_secret_refuse_to_call_a_silo_without_it(
    cluster: ClusterFactory, redis_url: str, cluster_name: str
) -> None:
    (inside,) = await cluster(1, transport=_transport(SECRET))
    (outsider,) = await cluster(1, transport=_transport(None))
    grain = GrainId("RandomEcho", "outside")
    assert await outsider.router.activate(grain, target=outsider.address) == str(outsider.address)
    # A silo that cannot prove it knows the secret must not be trusted with calls
    # (it could be anyone who can write to the membership table).
    with pytest.raises(errors.AuthenticationError):
        await inside.get_grain(RandomEcho, "outside").with_timeout(3).echo(1)


async def test_cluster_secret_file_flag_secures_a_silo_process(
    silo_processes: Callable[..., list[SiloProcess]],
    redis_url: str,
    cluster_name: str,
    tmp_path: Path,
) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    (proc,) = silo_processes(1, extra_args=("--cluster-secret-file", str(secret_file)))
    good = await _client(redis_url, cluster_name, SECRET)
    bad = await _client(redis_url, cluster_name, None)
    try:
        assert await good.get_grain(Echo, "x").echo("hi") == "hi"
        with pytest.raises(errors.AuthenticationError):
            await bad.get_grain(Echo, "x").with_timeout(3).echo("hi")
    finally:
        await good.close()
        await bad.close()
    assert proc.alive()


def test_top_level_cluster_secret_env_flows_into_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDGRAIN_CLUSTER_SECRET", "s1")
    for cls in (SiloSettings, ClientSettings):
        settings: Any = cls()
        assert settings.transport.cluster_secret is not None
        assert settings.transport.cluster_secret.get_secret_value() == "s1"
    monkeypatch.delenv("REDGRAIN_CLUSTER_SECRET")
    monkeypatch.setenv("REDGRAIN_TRANSPORT__CLUSTER_SECRET", "s2")
    silo_settings = SiloSettings()
    assert silo_settings.transport.cluster_secret is not None
    assert silo_settings.transport.cluster_secret.get_secret_value() == "s2"
    assert (
        silo_settings.cluster_secret is not None
        and silo_settings.cluster_secret.get_secret_value() == "s2"
    )
    assert "s2" not in repr(silo_settings), "the secret must never show in a repr or a log"


def test_two_different_secrets_in_one_settings_object_are_a_config_error() -> None:
    with pytest.raises(ValidationError, match="differ"):
        SiloSettings(cluster_secret="a", transport=TransportSettings(cluster_secret=SecretStr("b")))
