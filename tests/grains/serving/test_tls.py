"""Both fronts over TLS, called by tritonclient unmodified (``ssl=True``), certificates from a private CA.

The CA, the server's certificate (for 127.0.0.1) and a client's are made per
test by the ``openssl`` command (tests/security/certs.py). No cluster is
needed: server liveness and metadata are the front's own answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from grains.serving.front import Front
from grains.serving.grpc_front import serve_grpc
from grains.serving.http import create_app, make_server
from grains.serving.settings import TlsSettings
from silo.testing.embedded import TlsFiles
from tests.helpers import free_port
from tests.security.certs import make_certificates


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_certificates(tmp_path_factory.mktemp("pki"), client_cert=True)


@asynccontextmanager
async def fronts(tls: TlsSettings) -> AsyncIterator[tuple[int, int]]:
    """Both fronts over ``tls``: their HTTP and gRPC ports."""
    port = free_port()
    front = Front(object())
    server = make_server(create_app(object(), front=front), port=port, tls=tls)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), task
        await asyncio.sleep(0.02)
    try:
        async with serve_grpc(front, port=0, tls=tls) as grpc_port:
            yield port, grpc_port
    finally:
        server.should_exit = True
        await task


def http_client(port: int, ca: Path, cert: tuple[Path, Path] | None = None) -> Any:
    import tritonclient.http as th

    options: dict[str, Any] = {"ca_certs": str(ca)}
    if cert is not None:
        options |= {"certfile": str(cert[0]), "keyfile": str(cert[1])}
    return th.InferenceServerClient(f"127.0.0.1:{port}", ssl=True, ssl_options=options, connection_timeout=10, network_timeout=10)


def grpc_client(port: int, ca: Path, cert: tuple[Path, Path] | None = None) -> Any:
    import tritonclient.grpc as tg

    return tg.InferenceServerClient(f"127.0.0.1:{port}", ssl=True, root_certificates=str(ca),
                                    private_key=str(cert[1]) if cert else None,
                                    certificate_chain=str(cert[0]) if cert else None)  # fmt: skip


def both_answer(http_port: int, grpc_port: int, ca: Path, cert: tuple[Path, Path] | None = None) -> tuple[Any, ...]:
    h, g = http_client(http_port, ca, cert), grpc_client(grpc_port, ca, cert)
    try:
        return (h.is_server_live(), h.get_server_metadata()["name"], g.is_server_live(),
                g.get_server_metadata().name)  # fmt: skip
    finally:
        h.close()
        g.close()


async def test_tritonclient_calls_both_fronts_over_tls(pki: TlsFiles):
    tls = TlsSettings(cert_file=pki.cert_file, key_file=pki.key_file)
    async with fronts(tls) as (http_port, grpc_port):
        got = await asyncio.to_thread(both_answer, http_port, grpc_port, pki.ca_file)
    assert got == (True, "redgrain", True, "redgrain")


async def test_with_a_ca_the_fronts_answer_clients_with_its_certificates_and_refuse_the_rest(pki: TlsFiles):
    assert pki.client_cert_file is not None and pki.client_key_file is not None
    tls = TlsSettings(cert_file=pki.cert_file, key_file=pki.key_file, ca_file=pki.ca_file)
    cert = (pki.client_cert_file, pki.client_key_file)
    async with fronts(tls) as (http_port, grpc_port):
        got = await asyncio.to_thread(both_answer, http_port, grpc_port, pki.ca_file, cert)
        assert got == (True, "redgrain", True, "redgrain")

        def without_certificate() -> list[bool]:
            refused = []
            for call in (lambda: http_client(http_port, pki.ca_file).is_server_live(),
                         lambda: grpc_client(grpc_port, pki.ca_file).is_server_live(client_timeout=5)):  # fmt: skip
                try:
                    call()
                    refused.append(False)
                except Exception:  # noqa: BLE001 - the TLS handshake fails, as each client words it
                    refused.append(True)
            return refused

        assert await asyncio.to_thread(without_certificate) == [True, True]


async def test_a_plain_text_client_gets_no_answer_from_the_tls_grpc_front(pki: TlsFiles):
    tls = TlsSettings(cert_file=pki.cert_file, key_file=pki.key_file)
    async with fronts(tls) as (_, grpc_port):
        reader, writer = await asyncio.open_connection("127.0.0.1", grpc_port)
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert b"PRI" not in data and not data.startswith(b"\x00\x00")  # no HTTP/2 frame came back


def test_tls_settings_name_a_missing_file(tmp_path: Path):
    with pytest.raises(ValueError, match="does not exist"):
        TlsSettings(cert_file=tmp_path / "nope.crt", key_file=tmp_path / "nope.key")


def test_serve_flags_build_the_tls_settings_and_refuse_half_of_them(pki: TlsFiles):
    import argparse

    from grains.serving.command import add_arguments, front_settings
    from silo import errors

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--tls-cert", str(pki.cert_file), "--tls-key", str(pki.key_file), "--tls-ca", str(pki.ca_file)])
    tls = front_settings(args).tls
    assert tls is not None and tls.ca_file == pki.ca_file
    assert front_settings(p.parse_args([])).tls is None
    with pytest.raises(errors.ConfigError, match="go together"):
        front_settings(p.parse_args(["--tls-ca", str(pki.ca_file)]))
