"""Mutual TLS for every link: the SSL contexts a transport listens and connects with.

With ``transport.tls_cert``, ``tls_key`` and ``tls_ca`` set, a silo accepts
only TLS connections (on TCP and on its same-host Unix socket alike) whose
peer presents a certificate the private CA signed, and every connection it
or a client opens requires the same of the silo it reaches
(``CERT_REQUIRED`` on both sides, TLS 1.2 at least). The TLS handshake
finishes before the connection's protocol sees a byte, so a peer without a
valid certificate is refused before any frame is decoded; the cluster-secret
handshake (:mod:`silo.messaging.handshake`), when a secret is set, then runs
inside the encrypted channel.

Hostnames: silos are called at the ``host:port`` the membership table lists,
usually an IP address. By default the connecting side checks the chain
against the CA and not the name: every certificate the cluster's own CA
signed is a member, whatever address it answers at, so the CA must sign
certificates for this cluster's silos and clients only. With
``tls_check_hostname`` the certificate must also carry the address it is
called at as a subjectAltName (IP or DNS), which pins each silo to its
address (and then every advertised address needs its own certificate).
docs/security.md says the same for operators.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

from silo import errors
from silo.settings import TransportSettings


class _CountedHandshake(ssl.SSLObject):
    """A server-side TLS session whose failed handshake calls its context's ``on_refused``.

    The event loop runs the handshake inside its own TLS protocol and, when it fails, drops the
    connection without telling ours (the application protocol never sees it, by design): this
    is the one place a refusal can be counted. ``SSLContext.sslobject_class`` is the documented
    hook; asyncio's and uvloop's TLS both create their sessions through ``wrap_bio``."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise  # not a failure: the handshake needs more bytes
        except ssl.SSLError as exc:
            on_refused = getattr(self.context, "on_refused", None)
            if on_refused is not None:
                on_refused(exc)
            raise


class _ServerContext(ssl.SSLContext):
    on_refused: Callable[[ssl.SSLError], None] | None = None


def _context(purpose: ssl.Purpose, settings: TransportSettings) -> ssl.SSLContext:
    assert settings.tls_cert is not None and settings.tls_key is not None and settings.tls_ca is not None
    protocol = ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT
    ctx = (_ServerContext if purpose is ssl.Purpose.CLIENT_AUTH else ssl.SSLContext)(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
        ctx.load_verify_locations(cafile=settings.tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise errors.ConfigError(
            f"cannot load TLS files (tls_cert={settings.tls_cert}, tls_key={settings.tls_key},"
            f" tls_ca={settings.tls_ca}): {exc}"
        ) from exc
    ctx.verify_mode = ssl.CERT_REQUIRED
    if protocol is ssl.PROTOCOL_TLS_CLIENT:
        ctx.check_hostname = settings.tls_check_hostname
    return ctx


def server_context(
    settings: TransportSettings, on_refused: Callable[[ssl.SSLError], None] | None = None
) -> ssl.SSLContext | None:
    """What a silo listens with: its certificate, and a client certificate the CA signed required.

    ``on_refused`` is called with the error of each handshake that fails: a peer without a
    certificate our CA signed, one that distrusts ours, bytes that are not TLS. A peer that
    closes before sending anything (a port probe; a plaintext caller waiting for our HELLO,
    which under TLS never comes) is not a handshake and is not counted."""
    if not settings.tls:
        return None
    ctx = _context(ssl.Purpose.CLIENT_AUTH, settings)
    ctx.on_refused = on_refused  # type: ignore[attr-defined]
    ctx.sslobject_class = _CountedHandshake
    return ctx


def client_context(settings: TransportSettings) -> ssl.SSLContext | None:
    """What silos and clients connect with: their certificate, and the silo's verified against the CA."""
    return _context(ssl.Purpose.SERVER_AUTH, settings) if settings.tls else None


def refusal(endpoint: str, exc: ssl.SSLError | None) -> errors.AuthenticationError:
    """A failed TLS handshake as the error a caller sees (the silo is not one of ours, or we are
    not one of its); ``exc`` None: the silo closed the connection before its HELLO."""
    if exc is None:
        reason = "the silo closed the connection before its HELLO: does its CA sign our certificate?"
    elif isinstance(exc, ssl.SSLCertVerificationError):
        reason = f"certificate verify failed: {exc.verify_message}"
    else:
        reason = getattr(exc, "reason", None) or str(exc)
    return errors.AuthenticationError(endpoint, f"TLS handshake failed ({reason})")
