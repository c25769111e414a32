"""Small helpers shared by tests (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

from silo.embedded import free_port as _free_port


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    return _free_port(host)
