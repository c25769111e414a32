"""Throw-away certificates for TLS tests, made with the ``openssl`` command.

(The ``cryptography`` package is not a dependency; the openssl CLI is on
every machine that has a TLS-capable redis-server.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from silo.testing.embedded import TlsFiles


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError(
            "the openssl command is needed to make test certificates and is not on PATH"
        )
    subprocess.run([exe, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path, *, client_cert: bool = False) -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1/localhost and, optionally, a client certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=redgrain-test-ca", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", "server.ext"), ("client", None)):
        if name == "client" and not client_cert:
            continue
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=redgrain-test-{name}", cwd=d)  # fmt: skip
        sign = ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.crt", "-days", "2"]  # fmt: skip
        if ext is not None:
            sign += ["-extfile", ext]
        _openssl(*sign, cwd=d)
    return TlsFiles(
        cert_file=d / "server.crt",
        key_file=d / "server.key",
        ca_file=d / "ca.crt",
        client_cert_file=d / "client.crt" if client_cert else None,
        client_key_file=d / "client.key" if client_cert else None,
    )
