"""A front's connection writes: ``TCP_NODELAY``, and the writes of one loop turn sent as one.

Both fronts answer many requests per loop turn, each answer several writes
(uvicorn: status line and headers, then body; the gRPC server: HEADERS,
DATA, trailers). On uvloop each ``transport.write`` is a ``send`` syscall and,
on the wire, a segment of its own; under load those writes were the HTTP
front's largest cost (28% of its CPU at 16 tritonclient connections;
docs/serving.md, "Where the HTTP time goes"). :class:`Corked` holds the
writes made in one turn of the event loop and sends them joined at the end
of the turn, so an answer (and the answers completed together) leaves in
one syscall and one segment. Nothing waits beyond the current turn, so this
adds no latency, unlike Nagle's algorithm, which ``TCP_NODELAY`` turns off
(uvloop sets it too; set here so it holds on any loop).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any


class Corked:
    """A transport whose writes within one loop turn go out as one."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None
        self.pending_bytes = 0  # what this turn's writes hold

    def write(self, data: bytes | bytearray | memoryview) -> None:
        # bytes are kept as they are (a response body is not copied again); a mutable buffer is
        # copied, since its owner may reuse it before the end of the turn.
        chunk = data if type(data) is bytes else bytes(data)
        self.pending_bytes += len(chunk)
        if self._pending is None:
            self._pending = [chunk]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(chunk)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        self.pending_bytes = 0
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()  # an answer written just before the close still goes out
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self.pending_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def corked(transport: asyncio.BaseTransport) -> Corked:
    """``transport`` (a new TCP connection's) with Nagle off, its writes corked per loop turn."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
    return Corked(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
