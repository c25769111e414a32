"""A unary gRPC server on the asyncio loop: what the gRPC front runs on.

gRPC over HTTP/2 (the protocol's "PROTOCOL-HTTP2" document) for unary calls:
a call is a stream whose request headers name the method (``:path``) and may
set a deadline (``grpc-timeout``), whose body is one length-prefixed message
each way, and whose answer ends in trailers carrying ``grpc-status`` and
``grpc-message``. The HTTP/2 under it is this module's own, as in grpc's own
implementations (C-core's chttp2, grpc-go's transport): only what a gRPC
server needs, each frame parsed with slices (:mod:`grains.serving.http2`),
request headers decoded by ``hpack``, answers' headers written as literals
built once (docs/decisions.md, 84).

Why not ``grpc.aio``, nor ``h2``: each cost more CPU per call than the whole
HTTP front (docs/serving.md, "Where the gRPC time goes"). grpc.aio's
completion queue runs on a poller thread that wakes the event loop through a
socket for every completion, several per call; h2's general state machines
and event objects cost ~80 µs a call of the ~130 µs a no-op call cost on it,
where this module's cost ~50 µs. Here a call is parsed, dispatched and
answered on the loop that runs the front, and the answers finished in one
loop turn leave in one write.

What it serves, in full for unary methods: deadlines (a call past its
deadline, or reset by its client, has its handler cancelled), message size
limits each way (RESOURCE_EXHAUSTED), flow control both ways for messages of
any size, CONTINUATION, padding, PING, SETTINGS, the identity encoding (a
compressed message is refused, UNIMPLEMENTED, naming what is accepted), a
GOAWAY naming the error for a peer that breaks HTTP/2, and a graceful stop
(GOAWAY; calls under way get their grace). Streaming methods and server push
are not served.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import hpack
from google.protobuf.message import DecodeError, Message

from grains.serving import http2
from grains.serving.corked import Corked, corked
from grains.serving.http2 import END_HEADERS, END_STREAM, ErrorCode, Frame, ProtocolError

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

WINDOW = 8 << 20
"""Each stream's and the connection's receive window: a request of a few MiB arrives in one round trip."""
MAX_FRAME = 1 << 20
MAX_STREAMS = 1024
MAX_HEADER_BLOCK = 64 << 10
_TIMEOUT = re.compile(rb"^(\d{1,8})([HMSmun])$")
_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_SETTINGS = http2.settings({http2.Setting.MAX_CONCURRENT_STREAMS: MAX_STREAMS, http2.Setting.INITIAL_WINDOW_SIZE: WINDOW,
                            http2.Setting.MAX_FRAME_SIZE: MAX_FRAME, http2.Setting.ENABLE_PUSH: 0})  # fmt: skip
_SETTINGS_ACK = http2.frame(Frame.SETTINGS, http2.ACK, 0)


class Status(enum.IntEnum):
    """gRPC status codes (the protocol's numbering; ``grpc.StatusCode`` names)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Abort(Exception):
    """Raised by a handler: the call ends with ``status`` and ``message``."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Method(Generic[Req, Resp]):
    """A unary method: its request message type and its handler."""

    request: type[Req]
    handler: Callable[[Req, Call], Awaitable[Resp]]


class Call:
    """One call as its handler sees it: the deadline and the request headers."""

    __slots__ = ("_loop", "body", "deadline", "headers", "path", "received", "remote_closed", "send_window",
                 "stream_id", "task")

    def __init__(self, stream_id: int, path: str, headers: dict[bytes, bytes], deadline: float | None,
                 loop: asyncio.AbstractEventLoop, send_window: int) -> None:  # fmt: skip
        self.stream_id = stream_id
        self.path = path
        self.headers = headers
        self.deadline = deadline
        self._loop = loop
        self.body = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.send_window = send_window  # what the client lets this stream's answer send
        self.received = 0  # bytes of this stream's DATA not yet given back to the client's window
        self.remote_closed = False  # the client ended its side (END_STREAM)

    def time_remaining(self) -> float | None:
        """Seconds to the client's deadline (0 once past), or None when it set none."""
        return None if self.deadline is None else max(0.0, self.deadline - self._loop.time())


def _deadline(value: bytes | None, now: float) -> float | None:
    if value is None:
        return None
    m = _TIMEOUT.match(value)
    if m is None:
        raise Abort(Status.INVALID_ARGUMENT, f"malformed grpc-timeout {value!r}")
    return now + int(m[1]) * _UNITS[m[2]]


def _trailers(status: Status, message: str) -> bytes:
    """The trailers' header block: ``grpc-status`` and, when there is one, ``grpc-message``."""
    block = http2.literal(b"grpc-status", b"%d" % status)
    if message:  # percent-encoded UTF-8, as the protocol has it; cut to fit one frame
        text = quote(message[:4096], safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()
        block += http2.literal(b"grpc-message", text)
    return block


class _Connection(asyncio.Protocol):
    """One client connection: HTTP/2 in, calls dispatched, answers out."""

    def __init__(self, server: GrpcServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: Corked | None = None
        self._partial: list[bytes] = []  # the pieces of a frame not yet whole
        self._partial_size = 0
        self._wanted = 0  # how many bytes make that frame whole (9 while its header is not)
        self._preface = False
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_BLOCK)
        self._decoded: dict[bytes, dict[bytes, bytes]] = {}  # header blocks seen on the table as it is
        self._table_seen: tuple[int, int] | None = None
        self._block: tuple[int, int, bytearray] | None = None  # a header block awaiting CONTINUATION
        self._calls: dict[int, Call] = {}  # streams whose answer is not yet ended
        self._last_stream = 0  # the highest stream id the client opened
        self._refusing_above: int | None = None  # the last stream id of our GOAWAY, once sent
        self._send_window = http2.DEFAULT_WINDOW  # the connection's, for our DATA
        self._initial_window = http2.DEFAULT_WINDOW  # the client's INITIAL_WINDOW_SIZE
        self._max_frame = http2.DEFAULT_MAX_FRAME  # the client's MAX_FRAME_SIZE
        self._received = 0  # DATA bytes not yet given back to the connection's window
        self._window = asyncio.Event()  # set when a flow-control window or the transport opens
        self._writable = True

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = corked(transport)  # answers finished in one loop turn leave in one write
        self._server._connections.add(self)
        self._send(_SETTINGS + http2.window_update(0, WINDOW - http2.DEFAULT_WINDOW))

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connections.discard(self)
        for call in self._calls.values():
            if call.task is not None:
                call.task.cancel()  # its client is gone: nobody reads the answer
        self._calls.clear()
        self._window.set()  # a sender waiting for a window finds the stream gone

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        self._window.set()

    def data_received(self, data: bytes) -> None:
        if self._partial:
            # The rest of a frame: joined once it is whole, not at every piece (a 1 MiB frame
            # comes in many reads, and joining each would copy it over and over).
            self._partial.append(data)
            self._partial_size += len(data)
            if self._partial_size < self._wanted:
                return
            data = b"".join(self._partial)
            self._partial, self._partial_size = [], 0
        try:
            if not self._preface:
                if len(data) < len(http2.PREFACE):
                    if not http2.PREFACE.startswith(data):
                        raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 connection preface")
                    self._keep(data, len(http2.PREFACE))
                    return
                if not data.startswith(http2.PREFACE):
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 connection preface")
                data = data[len(http2.PREFACE) :]
                self._preface = True
            view, at, end = memoryview(data), 0, len(data)
            wanted = 9
            while end - at >= 9:
                length = int.from_bytes(view[at : at + 3], "big")
                if length > MAX_FRAME:
                    raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes (at most {MAX_FRAME})")
                if end - at - 9 < length:
                    wanted = 9 + length
                    break
                stream_id = int.from_bytes(view[at + 5 : at + 9], "big") & 0x7FFFFFFF
                self._frame(view[at + 3], view[at + 4], stream_id, view[at + 9 : at + 9 + length])
                at += 9 + length
            if at < end:
                self._keep(bytes(view[at:]), wanted)
        except ProtocolError as exc:
            # The peer broke HTTP/2: a GOAWAY naming the error, and the connection is dropped.
            log.info("gRPC connection closed on a protocol error: %s", exc)
            self._send(http2.goaway(self._last_stream, exc.code, str(exc).encode()[:256]))
            if self._transport is not None:
                self._transport.close()

    def _keep(self, start: bytes, wanted: int) -> None:
        """Hold the start of a frame (or of the preface) until ``wanted`` bytes of it are in."""
        self._partial, self._partial_size, self._wanted = [start], len(start), wanted

    # --- frames in ---------------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, sid: int, payload: memoryview) -> None:
        if self._block is not None and kind != Frame.CONTINUATION:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a header block interrupted before its END_HEADERS")
        if kind == Frame.DATA:
            self._data(flags, sid, payload)
        elif kind == Frame.HEADERS:
            if sid == 0 or sid % 2 == 0:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid}, not a client's stream")
            block = self._unpad(flags, payload)
            if flags & http2.PRIORITY_FLAG:
                block = block[5:]
            if flags & END_HEADERS:
                self._headers(sid, flags, block)
            else:
                self._block = (sid, flags, bytearray(block))
        elif kind == Frame.CONTINUATION:
            if self._block is None or self._block[0] != sid:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"CONTINUATION on stream {sid} after no HEADERS there")
            self._block[2].extend(payload)
            if len(self._block[2]) > MAX_HEADER_BLOCK:
                raise ProtocolError(ErrorCode.COMPRESSION_ERROR, f"a header block over {MAX_HEADER_BLOCK} bytes")
            if flags & END_HEADERS:
                start_sid, start_flags, block_ = self._block
                self._block = None
                self._headers(start_sid, start_flags, memoryview(block_))
        elif kind == Frame.WINDOW_UPDATE:
            if len(payload) != 4:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a WINDOW_UPDATE is 4 bytes")
            self._window_update(sid, int.from_bytes(payload, "big") & 0x7FFFFFFF)
        elif kind == Frame.RST_STREAM:
            call = self._calls.pop(sid, None)
            if call is not None and call.task is not None:
                call.task.cancel()  # the client gave up (its deadline, or it cancelled): stop the work
            self._window.set()
        elif kind == Frame.SETTINGS:
            if sid != 0:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & http2.ACK:
                self._settings(payload)
        elif kind == Frame.PING:
            if len(payload) != 8:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a PING is 8 bytes")
            if not flags & http2.ACK:
                self._send(http2.frame(Frame.PING, http2.ACK, 0, bytes(payload)))
        elif kind == Frame.PUSH_PROMISE:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a client cannot push")
        elif kind == Frame.GOAWAY and self._transport is not None and not self._calls:
            self._transport.close()  # the client is leaving and nothing is under way
        # PRIORITY, and frame types this server does not know, are ignored, as RFC 9113 asks.

    @staticmethod
    def _unpad(flags: int, payload: memoryview) -> memoryview:
        if not flags & http2.PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "padding longer than its frame")
        return payload[1 : len(payload) - payload[0]]

    def _settings(self, payload: memoryview) -> None:
        if len(payload) % 6:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        for at in range(0, len(payload), 6):
            key, value = int.from_bytes(payload[at : at + 2], "big"), int.from_bytes(payload[at + 2 : at + 6], "big")
            if key == http2.Setting.INITIAL_WINDOW_SIZE:
                if value > http2.MAX_WINDOW:
                    raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, f"INITIAL_WINDOW_SIZE {value}")
                for call in self._calls.values():  # RFC 9113, 6.9.2: open streams' windows move by the change
                    call.send_window += value - self._initial_window
                self._initial_window = value
                self._window.set()
            elif key == http2.Setting.MAX_FRAME_SIZE:
                if not http2.DEFAULT_MAX_FRAME <= value < 1 << 24:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self._max_frame = value
            # HEADER_TABLE_SIZE: the answers' literals never use the client's table. The rest
            # (push, the client's own stream and header limits) bind a client's sending, not ours.
        self._send(_SETTINGS_ACK)

    def _window_update(self, sid: int, increment: int) -> None:
        if sid == 0:
            if increment == 0 or self._send_window + increment > http2.MAX_WINDOW:
                raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, f"a connection WINDOW_UPDATE of {increment}")
            self._send_window += increment
        else:
            call = self._calls.get(sid)
            if call is not None:
                if increment == 0 or call.send_window + increment > http2.MAX_WINDOW:
                    self._reset(call, ErrorCode.FLOW_CONTROL_ERROR)
                    return
                call.send_window += increment
        self._window.set()

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        # The connection's window is given back for every DATA frame, dropped or kept.
        self._received += len(payload)
        if self._received >= WINDOW // 2:
            self._send(http2.window_update(0, self._received))
            self._received = 0
        if sid > self._last_stream:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"DATA on stream {sid}, never opened")
        call = self._calls.get(sid)
        if call is None or call.remote_closed:
            return  # answered already (refused, reset or over a limit): what else it sends is dropped
        data = self._unpad(flags, payload)
        call.body += data
        if len(call.body) > self._server.max_receive + 5:
            self._refuse(call, Status.RESOURCE_EXHAUSTED,
                         f"received message larger than max (over {self._server.max_receive} bytes)")  # fmt: skip
            return
        if flags & END_STREAM:
            self._ended(call)
            return
        call.received += len(payload)
        if call.received >= WINDOW // 2:
            self._send(http2.window_update(sid, call.received))
            call.received = 0

    def _headers(self, sid: int, flags: int, block: memoryview) -> None:
        try:  # decoded whatever becomes of the stream: the decoder's table must follow the client's
            headers = self._decode(bytes(block))
        except hpack.HPACKError as exc:
            raise ProtocolError(ErrorCode.COMPRESSION_ERROR, f"a header block HPACK cannot decode: {exc}") from None
        call = self._calls.get(sid)
        if call is not None:  # the client's trailers: they end its side
            if not flags & END_STREAM:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"a second header block on stream {sid} without END_STREAM")
            if not call.remote_closed:
                self._ended(call)
            return
        if sid <= self._last_stream:
            self._send(http2.rst_stream(sid, ErrorCode.STREAM_CLOSED))
            return
        self._last_stream = sid
        if (self._refusing_above is not None and sid > self._refusing_above) or len(self._calls) >= MAX_STREAMS:
            # After our GOAWAY, or over the advertised limit: refused, which a client retries.
            self._send(http2.rst_stream(sid, ErrorCode.REFUSED_STREAM))
            return
        call = Call(sid, headers.get(b":path", b"").decode("latin-1"), headers, None, self._loop, self._initial_window)
        self._calls[sid] = call
        call.remote_closed = bool(flags & END_STREAM)
        method = headers.get(b":method")
        if method != b"POST" or not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            # Not gRPC at all: an HTTP answer, as the protocol asks (415 for the content type).
            status = http2.literal_indexed_name(8, b"415" if method == b"POST" else b"405")
            self._finish(call, status, trailers_only=False)
            return
        try:
            call.deadline = _deadline(headers.get(b"grpc-timeout"), self._loop.time())
            encoding = headers.get(b"grpc-encoding", b"identity")
            if encoding != b"identity":
                raise Abort(Status.UNIMPLEMENTED, f"grpc-encoding {encoding.decode('latin-1')!r} is not accepted, only identity")
            if call.path not in self._server.methods:
                raise Abort(Status.UNIMPLEMENTED, f"unknown method {call.path}")
        except Abort as exc:
            self._refuse(call, exc.status, exc.message, accept_encoding=b"grpc-encoding" in headers)
            return
        if call.remote_closed:
            self._ended(call)

    def _decode(self, block: bytes) -> dict[bytes, bytes]:
        """The block's headers, from the cache when the same bytes came before on an unchanged table.

        A client sends the same headers on every call of a connection, and once they are in
        HPACK's dynamic table the block is the same bytes each time: indexes only, which decode
        to the same headers for as long as the table holds the same entries. The table changes
        only by an insertion (a new first entry) or an eviction (fewer entries), so (length,
        identity of the first entry) tells whether it did; decoding costs ~15 µs a call.
        """
        table = self._decoder.header_table.dynamic_entries
        before = (len(table), id(table[0]) if table else 0)
        if before == self._table_seen:
            cached = self._decoded.get(block)
            if cached is not None:
                return dict(cached)
        else:
            self._decoded.clear()
            self._table_seen = before
        headers = dict(self._decoder.decode(block, raw=True))
        if (len(table), id(table[0]) if table else 0) == before:
            if len(self._decoded) < 64:  # a client varies a few headers at most (grpc-timeout)
                self._decoded[block] = headers
                return dict(headers)
        else:  # this block changed the table: what was decoded before may now read otherwise
            self._decoded.clear()
            self._table_seen = None
        return headers

    def _ended(self, call: Call) -> None:
        """The client's side is complete: parse its message and run the handler."""
        call.remote_closed = True
        body = call.body
        if len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            self._refuse(call, Status.INTERNAL, "a unary call's body must be one length-prefixed message")
            return
        if body[0]:
            self._refuse(call, Status.INTERNAL, "a compressed message without a grpc-encoding")
            return
        method = self._server.methods[call.path]
        try:
            request = method.request.FromString(memoryview(body)[5:])
        except DecodeError as exc:
            self._refuse(call, Status.INTERNAL, f"the request is not a {method.request.DESCRIPTOR.full_name}: {exc}")
            return
        call.body = bytearray()
        call.task = self._loop.create_task(self._run(call, method, request))

    # --- answers -----------------------------------------------------------------------------

    async def _run(self, call: Call, method: Method[Any, Any], request: Message) -> None:
        try:
            reply = await method.handler(request, call)
            body = reply.SerializeToString()
        except Abort as exc:
            self._finish(call, _trailers(exc.status, exc.message))
            return
        except asyncio.CancelledError:
            if call.stream_id in self._calls and not self._closed():
                self._reset(call, ErrorCode.CANCEL)
            raise
        except Exception as exc:  # a bug, not the request's failure: UNKNOWN, and logged
            log.exception("gRPC handler for %s failed", call.path)
            self._finish(call, _trailers(Status.UNKNOWN, f"unexpected {type(exc).__name__}: {exc}"))
            return
        if len(body) > self._server.max_send:
            self._finish(call, _trailers(Status.RESOURCE_EXHAUSTED,
                                         f"the answer is larger than max ({len(body)} vs. {self._server.max_send} bytes)"))  # fmt: skip
            return
        if call.stream_id not in self._calls or self._closed():
            return
        sid = call.stream_id
        message = b"\x00" + len(body).to_bytes(4, "big") + body
        self._send(http2.frame(Frame.HEADERS, END_HEADERS, sid, http2.RESPONSE))
        if len(message) <= min(self._send_window, call.send_window, self._max_frame):
            # The common case: the whole answer fits the windows, and leaves with its trailers.
            self._send_window -= len(message)
            call.send_window -= len(message)
            self._send(http2.frame(Frame.DATA, 0, sid, message))
        else:
            await self._send_large(call, memoryview(message))
            if sid not in self._calls or self._closed():
                return
        self._finish(call, http2.TRAILERS_OK, trailers_only=False)

    async def _send_large(self, call: Call, message: memoryview) -> None:
        sent = 0
        while sent < len(message):
            if call.stream_id not in self._calls or self._closed():
                return
            n = min(self._send_window, call.send_window, self._max_frame, len(message) - sent)
            if n <= 0 or not self._writable:
                self._window.clear()
                await self._window.wait()
                continue
            self._send(http2.frame(Frame.DATA, 0, call.stream_id, bytes(message[sent : sent + n])))
            self._send_window -= n
            call.send_window -= n
            sent += n

    def _finish(self, call: Call, trailers: bytes, *, trailers_only: bool = True) -> None:
        """End the answer with ``trailers`` (after :data:`http2.RESPONSE` when nothing went before)."""
        if self._calls.pop(call.stream_id, None) is None or self._closed():
            return  # reset by the client meanwhile, or the connection is gone
        block = http2.RESPONSE + trailers if trailers_only else trailers
        self._send_block(call.stream_id, block)
        if not call.remote_closed:
            # Still sending (a message over the limit, say): HTTP/2 lets a server that has answered
            # in full reset the rest with NO_ERROR, and the client keeps the answer.
            self._send(http2.rst_stream(call.stream_id, ErrorCode.NO_ERROR))

    def _send_block(self, sid: int, block: bytes) -> None:
        """A header block that ends the stream, in HEADERS and as many CONTINUATIONs as it needs."""
        first, rest = block[: self._max_frame], block[self._max_frame :]
        self._send(http2.frame(Frame.HEADERS, END_STREAM | (0 if rest else END_HEADERS), sid, first))
        while rest:
            part, rest = rest[: self._max_frame], rest[self._max_frame :]
            self._send(http2.frame(Frame.CONTINUATION, 0 if rest else END_HEADERS, sid, part))

    def _refuse(self, call: Call, status: Status, message: str, *, accept_encoding: bool = False) -> None:
        """Answer a call with a status before its handler runs."""
        block = _trailers(status, message)
        if accept_encoding:
            block += http2.literal(b"grpc-accept-encoding", b"identity")
        self._finish(call, http2.RESPONSE + block, trailers_only=False)

    def _reset(self, call: Call, code: ErrorCode) -> None:
        self._calls.pop(call.stream_id, None)
        if call.task is not None and code != ErrorCode.CANCEL:
            call.task.cancel()
        self._send(http2.rst_stream(call.stream_id, code))

    # --- writes ------------------------------------------------------------------------------

    def _closed(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def _send(self, data: bytes) -> None:
        if not self._closed():
            assert self._transport is not None
            self._transport.write(data)

    # --- stopping ----------------------------------------------------------------------------

    def goaway(self) -> None:
        """Tell the client no new call will be taken here; the calls under way go on."""
        if self._closed() or self._refusing_above is not None:
            return
        self._refusing_above = self._last_stream
        self._send(http2.goaway(self._last_stream, ErrorCode.NO_ERROR))

    def tasks(self) -> list[asyncio.Task[None]]:
        return [c.task for c in self._calls.values() if c.task is not None]

    def close(self) -> None:
        if self._closed():
            return
        self._send(http2.goaway(self._last_stream, ErrorCode.NO_ERROR))
        assert self._transport is not None
        self._transport.close()  # what was written goes out first


class GrpcServer:
    """Unary gRPC methods served on the running loop (from :meth:`start` to :meth:`stop`)."""

    def __init__(self, methods: Mapping[str, Method[Any, Any]], *, max_receive: int, max_send: int) -> None:
        self.methods = dict(methods)
        self.max_receive = max_receive
        self.max_send = max_send
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Listen on ``host:port`` (0: a free port); the port bound."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_port=reuse_port or None)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float) -> None:
        """Stop taking calls; those under way get ``grace_s`` to finish, then are cancelled."""
        if self._server is None:
            return
        self._server.close()
        for conn in list(self._connections):
            conn.goaway()
        pending = [t for conn in self._connections for t in conn.tasks()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace_s)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await asyncio.sleep(0)  # the answers' scheduled flushes run before the connections close
        for conn in list(self._connections):
            conn.close()
        self._server = None
