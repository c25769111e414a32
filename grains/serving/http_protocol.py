"""uvicorn's HTTP protocol, with a response's writes sent in one ``send`` and ``TCP_NODELAY`` set.

uvicorn writes a response's status line and headers, then its body, as two
``transport.write`` calls; on uvloop each is a ``send`` syscall and, on the
wire, a segment of its own. Under load those writes were the front's largest
cost (28% of its CPU at 16 tritonclient connections; docs/serving.md, "Where
the HTTP time goes"). :class:`_Corked` holds the writes made in one turn of
the event loop and sends them joined at the end of the turn, so a response
(and the answers to pipelined requests completed together) leaves in one
syscall and one segment. Nothing waits for it beyond the current turn, so
this adds no latency, unlike Nagle's algorithm, which ``TCP_NODELAY`` turns
off (uvloop sets it too; set here so it holds on any loop).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any


class _Corked:
    """A transport whose writes within one loop turn go out as one."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        # bytes are kept as they are (a response body is not copied again); a mutable buffer is
        # copied, since its owner may reuse it before the end of the turn.
        chunk = data if type(data) is bytes else bytes(data)
        if self._pending is None:
            self._pending = [chunk]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(chunk)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()  # a response written just before the close still goes out
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(p) for p in self._pending or ())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_class() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11), corked."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class CorkedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(_Corked(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]

    return CorkedHTTPProtocol
