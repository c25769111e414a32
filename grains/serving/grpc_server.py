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

What a hostile client can cost is bounded (:class:`~grains.serving.settings.GrpcLimits`;
docs/security.md, "The inference fronts"; docs/decisions.md, 88): per-second
bounds on RST_STREAM (rapid reset), PING, SETTINGS and empty frames (then
GOAWAY ENHANCE_YOUR_CALM); the receive window enforced, and the connection's
given back only as handlers take the requests, up to ``max_buffered_bytes``
held; reading paused while the client leaves its answers unread; a loop turn
per 64 KiB read, 1 MiB of answers or 256 new calls, so one connection's
backlog waits behind the others; handshake and idle timeouts and a
connection cap. None of it adds a function call to a call's path: counting
is an add, the clock is read only when a count passes its bound.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import ssl
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import hpack
from google.protobuf.message import DecodeError, Message

from grains.serving import http2
from grains.serving.corked import Corked, corked
from grains.serving.http2 import END_HEADERS, END_STREAM, ErrorCode, Frame, ProtocolError
from grains.serving.settings import GrpcLimits

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
_ENTRY = struct.Struct(">HI")
_REPLENISH_AT = WINDOW - WINDOW // 4
"""The client's connection window is topped up only once it is this low (a quarter spent, at least)."""
FAIR_READ = 64 << 10
"""A read this large ends the connection's turn: reading resumes on the next loop turn, after the others'."""
_RESETS, _PINGS, _SETTINGS_FRAMES, _EMPTY = range(4)
_ABUSE = ("RST_STREAM", "PING", "SETTINGS", "empty DATA or CONTINUATION")
# Why a connection stopped reading (bits): its answers are not read, or it had its turn.
_WRITE_PAUSED, _TURN_TAKEN, _BACKLOG = 1, 2, 4
OUT_HIGH = 1 << 20
"""Answer bytes one loop turn may write for a connection before its other frames wait for the next."""
CALLS_PER_TURN = 256
"""Calls one connection may open in a loop turn before its other frames wait for the next."""
LINGER_S = 1.0
"""How long a connection closed for an error is still read (and what it sends dropped) so its
client reads the GOAWAY, rather than losing it to the reset that closing a socket with unread
data sends."""
# What a sender of a large answer waits for.
_ON_STREAM, _ON_CONNECTION = 1, 2


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

    __slots__ = ("_loop", "blocked_on", "body", "deadline", "headers", "path", "received", "recv_window",
                 "remote_closed", "send_window", "stream_id", "task", "waiter")

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
        self.recv_window = WINDOW  # what the client may still send on this stream
        self.waiter: asyncio.Future[None] | None = None  # a large answer's sender, waiting for a window
        self.blocked_on = 0  # which window it waits for (_ON_STREAM, _ON_CONNECTION)
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


def _whole(body: bytearray) -> bool:
    """Whether ``body`` is one complete length-prefixed message."""
    return len(body) >= 5 and int.from_bytes(body[1:5], "big") == len(body) - 5


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
        self._limits = server.limits
        self._loop = asyncio.get_running_loop()
        self._transport: Corked | None = None
        self._partial: list[bytes] = []  # the pieces of a frame not yet whole
        self._partial_size = 0
        self._wanted = 0  # how many bytes make that frame whole (9 while its header is not)
        self._preface = False
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_BLOCK)
        self._decoded: dict[bytes, dict[bytes, bytes]] = {}  # header blocks seen on the table as it is
        self._decoded_bytes = 0  # what they hold, bounded by the limits' header_cache_bytes
        self._table_seen: tuple[int, int] | None = None
        self._block: tuple[int, int, bytearray] | None = None  # a header block awaiting CONTINUATION
        self._calls: dict[int, Call] = {}  # streams whose answer is not yet ended
        self._last_stream = 0  # the highest stream id the client opened
        self._refusing_above: int | None = None  # the last stream id of our GOAWAY, once sent
        self._send_window = http2.DEFAULT_WINDOW  # the connection's, for our DATA
        self._initial_window = http2.DEFAULT_WINDOW  # the client's INITIAL_WINDOW_SIZE
        self._max_frame = http2.DEFAULT_MAX_FRAME  # the client's MAX_FRAME_SIZE
        self._recv_window = min(WINDOW, self._limits.max_buffered_bytes)  # what the client may still send on the connection
        self._buffered = 0  # request bytes held in unfinished calls' bodies
        self._starved: deque[Call] = deque()  # senders waiting for the connection's window or the socket
        self._writable = True
        self._pauses = 0  # why reading is paused (_WRITE_PAUSED, _TURN_TAKEN, _BACKLOG bits)
        self._backlog: bytes | None = None  # frames read, held until this turn's answers are written
        self._gone = False  # closed for an error: nothing more is sent or handled
        self._opened = 0  # calls opened by the frames of the read being handled
        self._heard = True  # something came since the idle timer last looked
        self._timer: asyncio.TimerHandle | None = None  # the handshake timeout, then the idle one
        # Abuse counters (resets, PINGs, SETTINGS, empty frames): counted since each one's window
        # began; the clock is read only when a count passes its bound, so counting costs an add.
        self._counts = [0, 0, 0, 0]
        self._since = [self._loop.time()] * 4
        self._bounds = (self._limits.resets_per_s, self._limits.pings_per_s, self._limits.settings_per_s,
                        self._limits.empty_frames_per_s)  # fmt: skip

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = corked(transport)  # answers finished in one loop turn leave in one write
        server = self._server
        if len(server._connections) >= self._limits.max_connections:
            server._stats["refused"] += 1
            self._send(_SETTINGS + http2.goaway(0, ErrorCode.NO_ERROR, b"connection limit reached"))
            self._transport.close()
            return
        server._connections.add(self)
        self._send(_SETTINGS + http2.window_update(0, self._recv_window - http2.DEFAULT_WINDOW))
        self._timer = self._loop.call_later(self._limits.handshake_timeout_s, self._handshake_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        for call in self._calls.values():
            if call.task is not None:
                call.task.cancel()  # its client is gone: nobody reads the answer
            self._wake(call)  # a sender waiting for a window finds the stream gone
        self._calls.clear()
        self._starved.clear()
        self._buffered = 0

    def pause_writing(self) -> None:
        # The client does not read its answers: stop reading its requests (and PINGs) until it
        # does, or what it asks for would pile up here unread.
        self._writable = False
        self._pause(_WRITE_PAUSED)

    def resume_writing(self) -> None:
        self._writable = True
        self._resume(_WRITE_PAUSED)
        self._wake_starved()
        self._continue()

    def _pause(self, why: int) -> None:
        if not self._pauses and not self._closed():
            assert self._transport is not None
            self._transport.pause_reading()
        self._pauses |= why

    def _resume(self, why: int) -> None:
        if self._pauses & why:
            self._pauses &= ~why
            if not self._pauses and not self._closed():
                assert self._transport is not None
                self._transport.resume_reading()

    def _next_turn(self) -> None:
        self._resume(_TURN_TAKEN)

    def _handshake_timeout(self) -> None:
        if self._preface:
            return
        self._server._stats["timed_out"] += 1
        log.info("gRPC connection closed: no HTTP/2 preface within %.1f s", self._limits.handshake_timeout_s)
        self._close(ErrorCode.PROTOCOL_ERROR, b"no connection preface in time")

    def _idle_check(self) -> None:
        if self._calls or self._heard:  # busy: look again a timeout later
            self._heard = False
            self._timer = self._loop.call_later(self._limits.idle_timeout_s, self._idle_check)
            return
        self._server._stats["timed_out"] += 1
        self._close(ErrorCode.NO_ERROR, b"idle")

    def _close(self, code: ErrorCode, debug: bytes) -> None:
        """A GOAWAY naming ``code``, then the connection ends: written, shut for writing, read a little longer."""
        self._send(http2.goaway(self._last_stream, code, debug))
        transport = self._transport
        if transport is None or self._closed():
            return
        self._gone = True
        for call in list(self._calls.values()):
            if call.task is not None:
                call.task.cancel()
        if not transport.can_write_eof():  # TLS: no half-close
            transport.close()
            return
        transport.write_eof()
        self._pauses, self._backlog = 0, None
        transport.resume_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(LINGER_S, transport.abort)

    def _continue(self) -> None:
        """Handle the frames held back for their answers, once those are written."""
        if self._backlog is None or self._closed() or not self._writable:
            return  # resume_writing calls again
        data, self._backlog = self._backlog, None
        self.data_received(data)
        if self._backlog is None:
            self._resume(_BACKLOG)

    def data_received(self, data: bytes) -> None:
        if self._gone:
            return  # a connection closed for an error: what it still sends is read and dropped
        if self._backlog is not None:  # (reading is paused meanwhile; a read already under way joins it)
            self._backlog += data
            return
        self._heard = True
        if len(data) >= FAIR_READ:
            # A backlog: this read is handled, the next waits for the other connections' turn
            # (uvloop reads a socket up to 32 times in a row otherwise).
            self._pause(_TURN_TAKEN)
            self._loop.call_soon(self._next_turn)
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
                if self._timer is not None:
                    self._timer.cancel()
                self._heard = False  # the preface alone does not keep a connection open
                self._timer = self._loop.call_later(self._limits.idle_timeout_s, self._idle_check)
            view, at, end = memoryview(data), 0, len(data)
            wanted = 9
            self._opened = 0
            transport = self._transport
            assert transport is not None
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
                if (transport.pending_bytes > OUT_HIGH or self._opened > CALLS_PER_TURN) and at < end:
                    # This turn's answers are many (small requests can ask for large answers), or
                    # its new calls (each a task; rapid reset opens thousands a read): the rest
                    # waits for the next turn, after the writes and the other connections, and
                    # reading until the rest is handled.
                    self._backlog = bytes(view[at:])
                    self._pause(_BACKLOG)
                    self._loop.call_soon(self._continue)
                    return
            if at < end:
                self._keep(bytes(view[at:]), wanted)
        except ProtocolError as exc:
            # The peer broke HTTP/2: a GOAWAY naming the error, and the connection is dropped.
            log.info("gRPC connection closed on a protocol error: %s", exc)
            self._server._stats["calmed" if exc.code == ErrorCode.ENHANCE_YOUR_CALM else "protocol_errors"] += 1
            self._close(exc.code, str(exc).encode()[:256])

    def _count(self, what: int) -> None:
        """One more frame of an abusable kind; past its bound within a second: ENHANCE_YOUR_CALM."""
        counts = self._counts
        counts[what] += 1
        if counts[what] > self._bounds[what]:
            now = self._loop.time()
            if now - self._since[what] < 1.0:
                raise ProtocolError(ErrorCode.ENHANCE_YOUR_CALM,
                                    f"over {self._bounds[what]} {_ABUSE[what]} frames in a second")  # fmt: skip
            self._since[what], counts[what] = now, 1

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
            if not payload and not flags & END_HEADERS:
                self._count(_EMPTY)  # CVE-2024-27316's class: endless empty CONTINUATIONs
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
            self._count(_RESETS)  # rapid reset (CVE-2023-44487): each reset call cost a handler
            call = self._calls.pop(sid, None)
            if call is not None:
                self._drop_body(call)
                if call.task is not None:
                    call.task.cancel()  # the client gave up (its deadline, or it cancelled): stop the work
        elif kind == Frame.SETTINGS:
            if sid != 0:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & http2.ACK:
                self._count(_SETTINGS_FRAMES)
                self._settings(payload)
        elif kind == Frame.PING:
            if len(payload) != 8:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a PING is 8 bytes")
            if not flags & http2.ACK:
                self._count(_PINGS)
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
        """Apply a SETTINGS frame: its entries read once, open streams' windows moved once.

        A frame may hold 174,762 entries; moving every stream's window for each (as a loop over
        entries would) blocked the event loop 12.5 s with 1,024 streams open.
        """
        if len(payload) % 6:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        if len(payload) > 6 * self._limits.max_settings_entries:
            raise ProtocolError(ErrorCode.ENHANCE_YOUR_CALM,
                                f"a SETTINGS frame of {len(payload) // 6} entries (at most {self._limits.max_settings_entries})")  # fmt: skip
        window = self._initial_window
        for key, value in _ENTRY.iter_unpack(payload):
            if key == http2.Setting.INITIAL_WINDOW_SIZE:
                if value > http2.MAX_WINDOW:
                    raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, f"INITIAL_WINDOW_SIZE {value}")
                window = value
            elif key == http2.Setting.MAX_FRAME_SIZE:
                if not http2.DEFAULT_MAX_FRAME <= value < 1 << 24:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self._max_frame = value
            # HEADER_TABLE_SIZE: the answers' literals never use the client's table. The rest
            # (push, the client's own stream and header limits) bind a client's sending, not ours.
        if window != self._initial_window:
            change, self._initial_window = window - self._initial_window, window
            for call in self._calls.values():  # RFC 9113, 6.9.2: open streams' windows move by the change
                call.send_window += change
                if call.blocked_on == _ON_STREAM and call.send_window > 0:
                    self._wake(call)
        self._send(_SETTINGS_ACK)

    def _window_update(self, sid: int, increment: int) -> None:
        if sid == 0:
            if increment == 0 or self._send_window + increment > http2.MAX_WINDOW:
                raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, f"a connection WINDOW_UPDATE of {increment}")
            self._send_window += increment
            if self._starved:
                self._wake_starved()
            return
        call = self._calls.get(sid)
        if call is not None:
            if increment == 0 or call.send_window + increment > http2.MAX_WINDOW:
                self._reset(call, ErrorCode.FLOW_CONTROL_ERROR)
                return
            call.send_window += increment
            if call.blocked_on == _ON_STREAM and call.send_window > 0:
                self._wake(call)  # only this stream's sender: the others' windows did not move

    def _wake(self, call: Call) -> None:
        waiter = call.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
            self._server._stats["wakeups"] += 1

    def _wake_starved(self) -> None:
        """Wake the senders the connection's window now lets send, oldest first, no more."""
        budget = self._send_window if self._writable else 0
        starved = self._starved
        while starved and budget > 0:
            call = starved.popleft()
            if call.blocked_on == _ON_CONNECTION and call.stream_id in self._calls:
                budget -= min(call.send_window, self._max_frame)
                self._wake(call)

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if not size and not flags & END_STREAM:
            self._count(_EMPTY)
        self._recv_window -= size
        if self._recv_window < 0:
            raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, f"DATA past the connection's window (by {-self._recv_window} bytes)")
        if sid > self._last_stream:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"DATA on stream {sid}, never opened")
        call = self._calls.get(sid)
        if call is None or call.remote_closed:
            # Answered already (refused, reset or over a limit): what else it sends is dropped,
            # and its room in the connection's window given back.
            if self._recv_window <= _REPLENISH_AT:
                self._replenish()
            return
        call.recv_window -= size
        if call.recv_window < 0:
            raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, f"DATA past stream {sid}'s window (by {-call.recv_window} bytes)")
        data = self._unpad(flags, payload)
        call.body += data
        self._buffered += len(data)
        if len(call.body) > self._server.max_receive + 5:
            self._refuse(call, Status.RESOURCE_EXHAUSTED,
                         f"received message larger than max (over {self._server.max_receive} bytes)")  # fmt: skip
        elif flags & END_STREAM:
            self._ended(call)
        elif self._buffered >= self._limits.max_buffered_bytes and not _whole(call.body):
            # The connection's window is spent on unfinished requests and none can finish: the
            # one that filled it is refused, so the others go on.
            self._refuse(call, Status.RESOURCE_EXHAUSTED,
                         f"the connection holds {self._buffered} bytes of unfinished requests (at most {self._limits.max_buffered_bytes})")  # fmt: skip
        else:
            # The stream's own window is given back as its message arrives (the message is
            # bounded by max_receive); the connection's only as buffered requests are taken.
            call.received += size
            if call.received >= WINDOW // 2:
                self._send(http2.window_update(sid, call.received))
                call.recv_window += call.received
                call.received = 0
        if self._recv_window <= _REPLENISH_AT:  # (else there is less than a quarter window to give)
            self._replenish()

    def _replenish(self) -> None:
        """Top the client's connection window up to what the buffer cap leaves room for, in large steps."""
        room = min(WINDOW, self._limits.max_buffered_bytes - self._buffered) - self._recv_window
        if room >= WINDOW // 4 or (room > 0 and self._recv_window < WINDOW // 4):
            self._send(http2.window_update(0, room))
            self._recv_window += room

    def _drop_body(self, call: Call) -> None:
        """The call's buffered request bytes are no longer held (taken by its handler, or dropped)."""
        self._buffered -= len(call.body)
        call.body = bytearray()

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
        self._opened += 1
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
            self._decoded_bytes = 0
            self._table_seen = before
        headers = dict(self._decoder.decode(block, raw=True))
        if (len(table), id(table[0]) if table else 0) == before:
            # Bounded in bytes, not entries: 64 distinct 43 KiB blocks held 7.8 MB a connection.
            # A client varies a few small headers at most (grpc-timeout), which fit many times.
            size = len(block) + sum(len(k) + len(v) for k, v in headers.items())
            if self._decoded_bytes + size <= self._limits.header_cache_bytes:
                self._decoded[block] = headers
                self._decoded_bytes += size
                return dict(headers)
        else:  # this block changed the table: what was decoded before may now read otherwise
            self._decoded.clear()
            self._decoded_bytes = 0
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
        self._buffered -= len(body)
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
                # Wait for what blocks this answer: its stream's window (woken by that stream's
                # WINDOW_UPDATE alone), or the connection's window or socket (woken in turn, as
                # many as the connection's window lets send).
                call.waiter = self._loop.create_future()
                if call.send_window > 0:
                    call.blocked_on = _ON_CONNECTION
                    self._starved.append(call)
                else:
                    call.blocked_on = _ON_STREAM
                try:
                    await call.waiter
                finally:
                    call.waiter, call.blocked_on = None, 0
                continue
            self._send(http2.frame(Frame.DATA, 0, call.stream_id, bytes(message[sent : sent + n])))
            self._send_window -= n
            call.send_window -= n
            sent += n

    def _finish(self, call: Call, trailers: bytes, *, trailers_only: bool = True) -> None:
        """End the answer with ``trailers`` (after :data:`http2.RESPONSE` when nothing went before)."""
        if self._calls.pop(call.stream_id, None) is None or self._closed():
            return  # reset by the client meanwhile, or the connection is gone
        if call.body:  # answered before its request was whole
            self._drop_body(call)
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
        if self._calls.pop(call.stream_id, None) is not None:
            self._drop_body(call)
        if call.task is not None and code != ErrorCode.CANCEL:
            call.task.cancel()
        self._send(http2.rst_stream(call.stream_id, code))

    # --- writes ------------------------------------------------------------------------------

    def _closed(self) -> bool:
        return self._gone or self._transport is None or self._transport.is_closing()

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
        if self._gone and self._transport is not None:
            self._transport.abort()  # its GOAWAY is out; the server is stopping: no more lingering
        if self._closed():
            return
        self._send(http2.goaway(self._last_stream, ErrorCode.NO_ERROR))
        assert self._transport is not None
        self._transport.close()  # what was written goes out first


@dataclass(frozen=True, slots=True)
class GrpcServerStatistics:
    connections: int
    """Client connections open now."""
    calls: int
    """Calls open now (request arriving, handler running, or answer being sent)."""
    buffered_bytes: int
    """Request bytes held in unfinished calls, over all connections."""
    write_buffered_bytes: int
    """Answer bytes written and not yet taken by the sockets, over all connections."""
    reading_paused: int
    """Connections not read from because their client does not read its answers."""
    header_cache_bytes: int
    """Decoded header blocks kept for reuse (bytes of blocks and headers), over all connections."""
    refused_connections: int
    """Connections closed at once, over the connection limit."""
    timed_out: int
    """Connections closed for sending no preface in time, or for idling."""
    calmed: int
    """Connections closed with ENHANCE_YOUR_CALM (too many resets, PINGs, SETTINGS or empty frames)."""
    protocol_errors: int
    """Connections closed for breaking HTTP/2 otherwise."""
    wakeups: int
    """Times a sender of an answer larger than its windows was woken to send more."""


class GrpcServer:
    """Unary gRPC methods served on the running loop (from :meth:`start` to :meth:`stop`)."""

    def __init__(
        self, methods: Mapping[str, Method[Any, Any]], *, max_receive: int, max_send: int,
        limits: GrpcLimits | None = None, tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        self.methods = dict(methods)
        self.max_receive = max_receive
        self.max_send = max_send
        self.limits = limits or GrpcLimits()
        if self.limits.max_buffered_bytes < max_receive + 5:
            raise ValueError(f"max_buffered_bytes {self.limits.max_buffered_bytes} cannot hold one message of "
                             f"max_receive {max_receive} bytes")  # fmt: skip
        self.tls = tls
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._stats = {"refused": 0, "timed_out": 0, "calmed": 0, "protocol_errors": 0, "wakeups": 0}

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Listen on ``host:port`` (0: a free port); the port bound."""
        loop = asyncio.get_running_loop()
        tls: dict[str, Any] = {} if self.tls is None else {"ssl": self.tls, "ssl_handshake_timeout": self.limits.handshake_timeout_s}
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_port=reuse_port or None,
                                                **tls)  # fmt: skip
        return int(self._server.sockets[0].getsockname()[1])

    def statistics(self) -> GrpcServerStatistics:
        """What the server holds now, and what it has turned away since it started."""
        conns = self._connections
        return GrpcServerStatistics(
            connections=len(conns),
            calls=sum(len(c._calls) for c in conns),
            buffered_bytes=sum(c._buffered for c in conns),
            write_buffered_bytes=sum(c._transport.get_write_buffer_size() for c in conns if c._transport is not None),
            reading_paused=sum(1 for c in conns if c._pauses & (_WRITE_PAUSED | _BACKLOG)),
            header_cache_bytes=sum(c._decoded_bytes for c in conns),
            refused_connections=self._stats["refused"],
            timed_out=self._stats["timed_out"],
            calmed=self._stats["calmed"],
            protocol_errors=self._stats["protocol_errors"],
            wakeups=self._stats["wakeups"],
        )

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
