"""The HELLO that opens every connection, and the cluster-secret challenge in it, both ways.

The accepting side speaks first: ``[HELLO, nonce_a]``. Without a cluster
secret the nonce is empty and the connection is usable at once, both ways.
With one, ``nonce_a`` is 16 random bytes and the exchange is::

    acceptor  -> [HELLO, nonce_a]
    connector -> [AUTH, HMAC(secret, nonce_a), nonce_c]          (nonce_c: 16 fresh bytes)
    acceptor  -> [AUTH_OK, HMAC(secret, SILO_PROOF + nonce_a + nonce_c)]

Each side checks the other's HMAC in constant time (``hmac.compare_digest``)
before it accepts any other frame: the acceptor closes a connection whose
AUTH is wrong or missing (counted as ``refused``), the connector refuses an
``AUTH_OK`` without the acceptor's proof, or with a wrong one, as
:class:`~silo.errors.AuthenticationError`, before a single call frame is
sent on it (the transport hands a connection to callers only once it is
ready). So a process that only *claims* to be a silo (it wrote itself into
the membership table, or took over a dead silo's port) and answers
``AUTH_OK`` receives nothing.

Why the two MACs differ: the acceptor's proof covers a label and both
nonces, the connector's only the acceptor's nonce (as before: silos updated
first accept callers that send no ``nonce_c``, and answer them without a
proof they would not read). Different inputs mean one side's answer can
never be replayed as the other's: a fake silo that hands a caller's own AUTH
back gets nowhere. Both nonces are fresh per connection, so a recorded
exchange is useless on another one.

What this does not do: it authenticates the two ends when the connection
opens, not the bytes after it, and encrypts nothing. Someone on the path who
relays a whole handshake between two real members can read and inject
frames; that is what mutual TLS (``transport.tls_*``) is for, and with TLS
this handshake still runs inside it (a second, independent check).

The connecting side also refuses a HELLO without a nonce when it has a
secret (a peer that asks for no secret cannot prove it belongs to our
cluster), and one without a secret refuses a HELLO that asks for it. The
state machine (which frame is expected when) lives in the connection; this
module holds the messages and the checks.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from silo import errors
from silo.messaging.frame import AUTH, AUTH_OK

NONCE_BYTES = 16
SILO_PROOF = b"redgrain silo proof\0"
"""Prefix of what the acceptor's HMAC covers: never a valid input of the connector's."""


def new_nonce(secret: bytes | None) -> bytes:
    """The nonce the acceptor's HELLO carries: empty when it has no secret to check."""
    return os.urandom(NONCE_BYTES) if secret else b""


def _mac(secret: bytes, data: bytes) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()


def proves_secret(secret: bytes | None, nonce: bytes, header: list[Any]) -> bool:
    """Acceptor side: whether ``header`` is an AUTH whose HMAC of ``nonce`` shows the peer holds ``secret``."""
    if header[0] == AUTH and len(header) > 1 and isinstance(header[1], bytes) and secret:
        return hmac.compare_digest(_mac(secret, nonce), header[1])
    return False


def auth_ok(secret: bytes | None, nonce: bytes, header: list[Any]) -> list[Any]:
    """Acceptor side, once the AUTH in ``header`` proved the secret: the AUTH_OK to answer with,
    carrying our own proof over the connector's nonce when it sent one."""
    peer_nonce = header[2] if len(header) > 2 else None
    if secret is None or not isinstance(peer_nonce, bytes) or len(peer_nonce) != NONCE_BYTES:
        return [AUTH_OK]
    return [AUTH_OK, _mac(secret, SILO_PROOF + nonce + peer_nonce)]


def answer_hello(secret: bytes | None, header: list[Any], peer: str) -> tuple[list[Any], bytes] | None:
    """Connecting side, on the acceptor's HELLO: the AUTH header to answer with and the nonce
    we sent in it (check the AUTH_OK with :func:`check_auth_ok`), or None when neither side
    uses a secret (the connection is ready). Raises AuthenticationError when only one side does."""
    nonce = header[1] if len(header) > 1 else b""
    if not isinstance(nonce, bytes):
        raise errors.AuthenticationError(peer, "malformed HELLO")
    if not nonce and secret is not None:
        # A peer that asks for no secret cannot prove it is part of our
        # cluster: talking to it would hand our calls to a stranger.
        raise errors.AuthenticationError(peer, "silo does not use the cluster secret")
    if not nonce:
        return None
    if secret is None:
        raise errors.AuthenticationError(peer, "silo requires a cluster secret")
    ours = os.urandom(NONCE_BYTES)
    return [AUTH, _mac(secret, nonce), ours], ours


def check_auth_ok(secret: bytes, their_nonce: bytes, our_nonce: bytes, header: list[Any], peer: str) -> None:
    """Connecting side, on AUTH_OK: raise AuthenticationError unless it proves the acceptor
    holds the secret too (its HMAC over both nonces)."""
    proof = header[1] if len(header) > 1 else None
    if not isinstance(proof, bytes):
        raise errors.AuthenticationError(peer, "silo did not prove it holds the cluster secret")
    if not hmac.compare_digest(_mac(secret, SILO_PROOF + their_nonce + our_nonce), proof):
        raise errors.AuthenticationError(peer, "silo's proof of the cluster secret is wrong")
