"""uvicorn's HTTP protocol, with a response's writes sent in one ``send``, ``TCP_NODELAY`` set, and read deadlines.

uvicorn writes a response's status line and headers, then its body, as two
``transport.write`` calls; :func:`~grains.serving.corked.corked` sends the
writes of one loop turn as one (why: that module).

uvicorn has a keep-alive timeout, but nothing bounds how long a request
takes to arrive: a client that sends a header line every few seconds
(slowloris) holds its connection, and a few hundred such clients hold the
front; nor how large a head may grow (httptools sets no bound). Here a
request's head must be whole within ``header_timeout_s`` of its first byte
(or of the connection's start) and within ``max_header_bytes`` (counted by
the read, so up to one read over), and its body
within ``body_timeout_s`` after that, or the connection is closed;
connections past ``max_connections`` are closed as they come
(:class:`HttpLimits`). The
deadlines hang on httptools' parser callbacks (uvicorn's h11 protocol, used
only without httptools, gets the connection cap alone).
"""

from __future__ import annotations

import asyncio
import logging

from grains.serving.corked import corked
from grains.serving.settings import HttpLimits

log = logging.getLogger(__name__)
_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def protocol_class(limits: HttpLimits | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11), corked, under ``limits``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    lim = limits or HttpLimits()

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _head_bytes: int | None = 0  # bytes read while a request's head is incomplete (None: in a body)
        _heads = 0  # request heads read whole

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if len(self.connections) >= lim.max_connections:
                log.info("HTTP connection closed at once: %d open, the limit", len(self.connections))
                transport.close()
                return
            super().connection_made(corked(transport))
            self._arm(lim.header_timeout_s)  # the first request's head, from the start

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if getattr(self, "transport", None) is not None:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if getattr(self, "transport", None) is None or self._head_bytes == -1:
                return  # refused at once, or answered 431: what else comes is dropped
            heads = self._heads
            super().data_received(data)
            if self._heads != heads:  # a head ended in this read: the next one's counted from the next read
                if self._head_bytes is not None:
                    self._head_bytes = 0
            elif self._head_bytes is not None:  # a head is still incomplete after this read
                self._head_bytes += len(data)
                if self._head_bytes > lim.max_header_bytes and not self.transport.is_closing():
                    log.info("HTTP connection closed: a request head over %d bytes", lim.max_header_bytes)
                    self._disarm()
                    self.transport.write(_TOO_LARGE)
                    if not self.transport.can_write_eof():  # TLS: no half-close
                        self.transport.close()
                        return
                    # Half-closed and read (dropped) a second longer, so the client reads the 431
                    # rather than losing it to the reset that closing with unread input sends.
                    self._head_bytes = -1
                    self.transport.write_eof()
                    self.loop.call_later(1.0, self.transport.abort)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                log.info("HTTP connection closed: a request too slow to arrive")
                self.transport.close()

        # httptools' parser callbacks (uvicorn's h11 protocol has none of these names).
        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # after a keep-alive pause: this request's head from now
                self._arm(lim.header_timeout_s)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._heads += 1
            self._head_bytes = None
            self._arm(lim.body_timeout_s)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._head_bytes = 0
            self._disarm()

    return GuardedHTTPProtocol
