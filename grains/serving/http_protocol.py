"""uvicorn's HTTP protocol, with a response's writes sent in one ``send`` and ``TCP_NODELAY`` set.

uvicorn writes a response's status line and headers, then its body, as two
``transport.write`` calls; :func:`~grains.serving.corked.corked` sends the
writes of one loop turn as one (why: that module).
"""

from __future__ import annotations

import asyncio

from grains.serving.corked import corked


def protocol_class() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11), corked."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class CorkedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(corked(transport))

    return CorkedHTTPProtocol
