"""The HELLO that opens every connection, and the cluster-secret challenge in it.

The accepting side speaks first: ``[HELLO, nonce]``. Without a cluster secret
the nonce is empty and the connection is usable at once, both ways. With one,
it is 16 random bytes, and the connecting side must answer
``[AUTH, HMAC-SHA256(secret, nonce)]``; the acceptor checks it in constant
time, answers ``[AUTH_OK]`` and only then accepts other frames (until then a
frame's control part may be at most 4 KB, see
:mod:`silo.messaging.receive`). A wrong or missing answer closes the
connection and counts as ``refused``.

The check runs both ways in the sense that matters: a connecting side that
has a secret refuses a HELLO without a nonce, since a peer that asks for no
secret cannot prove it belongs to our cluster, and one without a secret
refuses a HELLO that asks for it (both as
:class:`~silo.errors.AuthenticationError`). The nonce is fresh per
connection, so a recorded AUTH is useless on another one. The state machine
(which frame is expected when) lives in the connection; this module holds
the messages and the checks.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from silo import errors
from silo.messaging.frame import AUTH


def new_nonce(secret: bytes | None) -> bytes:
    """The nonce the acceptor's HELLO carries: empty when it has no secret to check."""
    return os.urandom(16) if secret else b""


def proves_secret(secret: bytes | None, nonce: bytes, header: list[Any]) -> bool:
    """Acceptor side: whether ``header`` is an AUTH whose HMAC of ``nonce`` shows the peer holds ``secret``."""
    if header[0] == AUTH and len(header) > 1 and isinstance(header[1], bytes) and secret:
        expected = hmac.new(secret, nonce, hashlib.sha256).digest()
        return hmac.compare_digest(expected, header[1])
    return False


def answer_hello(secret: bytes | None, header: list[Any], peer: str) -> list[Any] | None:
    """Connecting side, on the acceptor's HELLO: the AUTH header to answer with, or None when
    neither side uses a secret (the connection is ready). Raises AuthenticationError when only
    one side does."""
    nonce = header[1] if len(header) > 1 else b""
    if not nonce and secret is not None:
        # A peer that asks for no secret cannot prove it is part of our
        # cluster: talking to it would hand our calls to a stranger.
        raise errors.AuthenticationError(peer, "silo does not use the cluster secret")
    if not nonce:
        return None
    if secret is None:
        raise errors.AuthenticationError(peer, "silo requires a cluster secret")
    return [AUTH, hmac.new(secret, nonce, hashlib.sha256).digest()]
