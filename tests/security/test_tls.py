"""Mutual TLS on every link: certificates from a private CA, made per test with the openssl command.

Silos use the CA's "server" certificate (subjectAltName 127.0.0.1 and
localhost, no extended key usage, so it serves for both ends of silo→silo
links); clients use the "client" one. A second CA stands in for a stranger.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from silo import errors
from silo.client import ClusterClient
from silo.codec import Codec
from silo.messaging.transport import Transport
from silo.settings import ClientSettings, SiloSettings, TransportSettings
from silo.silo import Silo
from silo.testing.embedded import TlsFiles
from tests.helpers import SiloProcess
from tests.sample_grains import Echo, Relay
from tests.security.certs import make_certificates

ClusterFactory = Callable[..., Awaitable[list[Silo]]]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_certificates(tmp_path_factory.mktemp("pki"), client_cert=True)


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """Another CA's certificates: valid TLS, not our cluster."""
    return make_certificates(tmp_path_factory.mktemp("stranger"), client_cert=True)


def silo_tls(f: TlsFiles, **kw: object) -> TransportSettings:
    return TransportSettings(tls_cert=f.cert_file, tls_key=f.key_file, tls_ca=f.ca_file, **kw)  # type: ignore[arg-type]


def client_tls(f: TlsFiles, ca: Path | None = None, **kw: object) -> ClientSettings:
    assert f.client_cert_file is not None and f.client_key_file is not None
    transport = TransportSettings(
        tls_cert=f.client_cert_file, tls_key=f.client_key_file, tls_ca=ca or f.ca_file, **kw  # type: ignore[arg-type]
    )
    return ClientSettings(transport=transport)


@pytest.mark.parametrize("local_sockets", [True, False], ids=["unix-socket", "tcp"])
async def test_calls_over_mutual_tls_go_client_to_silo_to_silo(
    cluster: ClusterFactory, redis_url: str, cluster_name: str, pki: TlsFiles, local_sockets: bool
) -> None:
    a, b = await cluster(2, transport=silo_tls(pki, local_sockets=local_sockets))
    settings = client_tls(pki, local_sockets=local_sockets)
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=settings) as c:
        found = None
        for i in range(40):
            out = await c.get_grain(Relay, f"r{i}").relay(f"e{i}", [i, b"x" * 100_000])
            if out["here"] != out["there"]:
                found = out
                break
        assert found is not None, "placement never spread two grains over two silos"
        assert found["value"][1] == b"x" * 100_000
        links = [c.transport.connection_nowait(s.address.endpoint) for s in (a, b)]
        links += [x.transport.connection_nowait(y.address.endpoint) for x, y in ((a, b), (b, a))]
        versions = {link.tls_version for link in links if link is not None}
        assert versions == {"TLSv1.3"}, versions
        assert len([link for link in links if link is not None]) >= 2  # client→silo and silo→silo
        # Tensors arrive whole through the TLS layer too (received into their own buffers).
        import torch

        t = torch.arange(300_000, dtype=torch.float32)
        assert torch.equal(await c.get_grain(Echo, "t").echo(t), t)
    assert a.transport.statistics().refused == 0 and b.transport.statistics().refused == 0


async def _s_client(endpoint: str, ca: Path, cert: Path, key: Path) -> tuple[int, str]:
    exe = shutil.which("openssl")
    assert exe is not None, "the openssl command is needed for this test"
    proc = await asyncio.create_subprocess_exec(
        exe, "s_client", "-connect", endpoint, "-CAfile", str(ca), "-cert", str(cert), "-key", str(key),
        "-verify_return_error", "-brief",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(errors="replace")


async def test_openssl_s_client_verifies_a_silos_certificate_against_the_ca(
    cluster: ClusterFactory, pki: TlsFiles, stranger: TlsFiles
) -> None:
    (silo,) = await cluster(1, transport=silo_tls(pki))
    assert pki.client_cert_file is not None and pki.client_key_file is not None
    rc, out = await _s_client(silo.address.endpoint, pki.ca_file, pki.client_cert_file, pki.client_key_file)
    assert rc == 0 and "Verification: OK" in out, out
    assert "CN = redgrain-test-server" in out or "CN=redgrain-test-server" in out, out
    # The same silo does not verify against another CA.
    assert stranger.client_cert_file is not None and stranger.client_key_file is not None
    rc, out = await _s_client(silo.address.endpoint, stranger.ca_file, stranger.client_cert_file, stranger.client_key_file)
    assert rc != 0 and "verify" in out.lower(), out


async def test_a_caller_without_tls_is_refused_before_any_frame_is_decoded(
    cluster: ClusterFactory, pki: TlsFiles
) -> None:
    (silo,) = await cluster(1, transport=silo_tls(pki))
    plain = Transport(TransportSettings(connect_timeout_s=1.0, local_sockets=False), Codec())
    try:
        with pytest.raises(errors.SiloUnavailableError, match="does it require TLS"):
            await plain.connect(silo.address.endpoint)
    finally:
        await plain.close()
    assert silo.transport.statistics().frames_in == 0
    assert silo.transport.statistics().connections == 0, "a refused handshake leaves no connection behind"


@pytest.mark.parametrize("local_sockets", [True, False], ids=["unix-socket", "tcp"])
async def test_a_caller_with_a_certificate_from_another_ca_is_refused(
    cluster: ClusterFactory, redis_url: str, cluster_name: str, pki: TlsFiles, stranger: TlsFiles, local_sockets: bool
) -> None:
    (silo,) = await cluster(1, transport=silo_tls(pki, local_sockets=local_sockets))
    # It trusts our CA (so it accepts the silo) but holds a certificate our CA never signed.
    settings = client_tls(stranger, ca=pki.ca_file, local_sockets=local_sockets, connect_timeout_s=3)
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=settings) as c:
        with pytest.raises(errors.AuthenticationError, match="TLS handshake failed"):
            await c.get_grain(Echo, "x").with_timeout(3).echo("let me in")
    assert silo.transport.statistics().frames_in == 0
    assert silo.transport.statistics().refused >= 1
    assert len(silo.catalog) == 0


async def test_a_silo_with_a_certificate_from_another_ca_is_refused_by_the_caller(
    cluster: ClusterFactory, pki: TlsFiles, stranger: TlsFiles
) -> None:
    (impostor,) = await cluster(1, transport=silo_tls(stranger))
    assert pki.client_cert_file is not None and pki.client_key_file is not None
    settings = TransportSettings(tls_cert=pki.client_cert_file, tls_key=pki.client_key_file, tls_ca=pki.ca_file)
    caller = Transport(settings, Codec())
    try:
        with pytest.raises(errors.AuthenticationError, match="certificate verify failed"):
            await caller.connect(impostor.address.endpoint)
    finally:
        await caller.close()
    assert impostor.transport.statistics().frames_in == 0


async def test_hostname_checking_when_asked_requires_the_called_address_in_the_certificate(
    cluster: ClusterFactory, pki: TlsFiles
) -> None:
    # Bound to every address, so that 127.0.0.2 (which its certificate does not name) reaches it too.
    (silo,) = await cluster(1, transport=silo_tls(pki, local_sockets=False), host="0.0.0.0", advertise_host="127.0.0.1")
    assert pki.client_cert_file is not None and pki.client_key_file is not None
    checked = TransportSettings(tls_cert=pki.client_cert_file, tls_key=pki.client_key_file, tls_ca=pki.ca_file,
                                tls_check_hostname=True, local_sockets=False)  # fmt: skip
    caller = Transport(checked, Codec())
    try:
        assert (await caller.connect(silo.address.endpoint)).tls_version is not None  # 127.0.0.1 is in its SAN
        port = silo.address.port
        with pytest.raises(errors.AuthenticationError, match="TLS handshake failed"):
            await caller.connect(f"127.0.0.2:{port}")  # the same silo, at an address its certificate lacks
    finally:
        await caller.close()


def test_tls_files_come_from_the_environment_for_silos_and_clients(
    monkeypatch: pytest.MonkeyPatch, pki: TlsFiles
) -> None:
    monkeypatch.setenv("REDGRAIN_TRANSPORT__TLS_CERT", str(pki.cert_file))
    monkeypatch.setenv("REDGRAIN_TRANSPORT__TLS_KEY", str(pki.key_file))
    monkeypatch.setenv("REDGRAIN_TRANSPORT__TLS_CA", str(pki.ca_file))
    for cls in (SiloSettings, ClientSettings):
        t = cls().transport
        assert t.tls and t.tls_cert == pki.cert_file and t.tls_ca == pki.ca_file
    monkeypatch.delenv("REDGRAIN_TRANSPORT__TLS_KEY")
    with pytest.raises(ValidationError, match="must be set together"):
        SiloSettings()


def test_unreadable_tls_files_are_a_config_error(tmp_path: Path, pki: TlsFiles) -> None:
    with pytest.raises(errors.ConfigError, match="cannot load TLS files"):
        Transport(TransportSettings(tls_cert=tmp_path / "missing.crt", tls_key=pki.key_file, tls_ca=pki.ca_file), Codec())


@pytest.mark.slow
async def test_a_silo_process_configured_by_environment_serves_over_mutual_tls(
    silo_processes: Callable[..., list[SiloProcess]], redis_url: str, cluster_name: str, pki: TlsFiles
) -> None:
    env = {
        "REDGRAIN_TRANSPORT__TLS_CERT": str(pki.cert_file),
        "REDGRAIN_TRANSPORT__TLS_KEY": str(pki.key_file),
        "REDGRAIN_TRANSPORT__TLS_CA": str(pki.ca_file),
    }
    (proc,) = silo_processes(1, env=env)
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=client_tls(pki)) as c:
        assert await c.get_grain(Echo, "p").echo("over tls") == "over tls"
        (link,) = [c.transport.connection_nowait(r.silo.endpoint) for r in c.view.active()]
        assert link is not None and link.tls_version == "TLSv1.3"
    assert proc.alive()
