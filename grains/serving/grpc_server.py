"""A unary gRPC server on h2 and the asyncio loop: what the gRPC front runs on.

gRPC over HTTP/2 (the protocol's "PROTOCOL-HTTP2" document) for unary calls:
a call is a stream whose request headers name the method (``:path``) and may
set a deadline (``grpc-timeout``), whose body is one length-prefixed message
each way, and whose answer ends in trailers carrying ``grpc-status`` and
``grpc-message``. ``h2`` (python-hyper) does the HTTP/2 (framing, HPACK, flow
control, settings, pings); this module maps its events onto calls.

Why not ``grpc.aio``: it costs more CPU per call than the whole HTTP front
(docs/serving.md, "Where the gRPC time goes"): its completion queue runs on a
poller thread of its own that wakes the event loop through a socket for every
completion, several per call. Here a call is parsed, dispatched and answered
on the loop that runs the front, with no thread hop, and the answers finished
in one loop turn leave in one write (docs/decisions.md, 84).

What it serves is what the Open Inference Protocol needs, in full: unary
methods, deadlines (a call past its deadline, or reset by its client, has its
handler cancelled), message size limits each way (RESOURCE_EXHAUSTED), flow
control both ways for messages of any size, the identity encoding (a
compressed message is refused, UNIMPLEMENTED, naming what is accepted), and a
graceful stop (GOAWAY; calls under way get their grace). Streaming methods
are not served.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast
from urllib.parse import quote

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from google.protobuf.message import DecodeError, Message
from hyperframe.frame import GoAwayFrame

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

WINDOW = 8 << 20
"""Each stream's and the connection's receive window: a request of a few MiB arrives in one round trip."""
MAX_FRAME = 1 << 20
MAX_STREAMS = 1024
_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,
    # h2's header checks cost ~7% of the front's CPU a call (docs/serving.md). Ours are
    # well-formed; of a peer's, the server reads five (:method, :path, content-type, grpc-timeout,
    # grpc-encoding) and checks each itself; the rest it ignores, malformed or not.
    validate_outbound_headers=False, normalize_outbound_headers=False,
    validate_inbound_headers=False, normalize_inbound_headers=False,
)  # fmt: skip
_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_OK = [(b"grpc-status", b"0")]
_TIMEOUT = re.compile(rb"^(\d{1,8})([HMSmun])$")
_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


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

    __slots__ = ("_loop", "body", "deadline", "headers", "path", "stream_id", "task")

    def __init__(self, stream_id: int, path: str, headers: dict[bytes, bytes], deadline: float | None,
                 loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self.stream_id = stream_id
        self.path = path
        self.headers = headers
        self.deadline = deadline
        self._loop = loop
        self.body = bytearray()
        self.task: asyncio.Task[None] | None = None

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


def _trailers(status: Status, message: str) -> list[tuple[bytes, bytes]]:
    out = [(b"grpc-status", b"%d" % status)]
    if message:  # percent-encoded UTF-8, as the protocol has it for grpc-message
        out.append((b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()))
    return out


class _Connection(asyncio.Protocol):
    """One client connection: HTTP/2 in, calls dispatched, answers out."""

    def __init__(self, server: GrpcServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._h2 = h2.connection.H2Connection(config=_CONFIG)
        self._transport: asyncio.Transport | None = None
        self._calls: dict[int, Call] = {}
        self._flushing = False
        self._window = asyncio.Event()  # set when a flow-control window or the transport opens
        self._writable = True
        self._last_stream: int | None = None  # the GOAWAY's last stream id, once sent

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._h2.initiate_connection()
        # As a change, not initial values: h2 applies a change (its frame-size limit, new streams'
        # windows) when the client acknowledges it, which is when the client starts to use it.
        self._h2.update_settings({
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
        })  # fmt: skip
        self._h2.increment_flow_control_window(WINDOW - 65535)
        self._server._connections.add(self)
        self._flush()

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
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            # Not HTTP/2, or HTTP/2 broken: a GOAWAY naming the error, and the connection is dropped.
            log.info("gRPC connection closed on a protocol error: %s", exc)
            try:
                self._h2.close_connection(error_code=exc.error_code)
            except h2.exceptions.ProtocolError:  # closed already
                pass
            self._flush()
            if self._transport is not None:
                self._transport.close()
            return
        for ev in events:
            if isinstance(ev, h2.events.DataReceived):
                self._data(ev)
            elif isinstance(ev, h2.events.RequestReceived):
                self._request(ev)
            elif isinstance(ev, h2.events.StreamEnded):
                self._ended(ev.stream_id)
            elif isinstance(ev, h2.events.StreamReset):
                self._reset(ev.stream_id)
            elif isinstance(ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self._window.set()
            elif isinstance(ev, h2.events.ConnectionTerminated) and self._transport is not None:
                self._transport.close()
        self._flush()

    # --- events ------------------------------------------------------------------------------

    def _request(self, ev: h2.events.RequestReceived) -> None:
        sid = ev.stream_id
        if self._last_stream is not None and sid > self._last_stream:
            # Opened before the client read our GOAWAY: refused, which a client retries elsewhere.
            self._h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        headers = dict(ev.headers or ())
        call = Call(sid, headers.get(b":path", b"").decode("latin-1"), headers, None, self._loop)
        self._calls[sid] = call
        content_type = headers.get(b"content-type", b"")
        if headers.get(b":method") != b"POST" or not content_type.startswith(b"application/grpc"):
            # Not gRPC at all: an HTTP answer, as the protocol asks (415 for the content type).
            self._answer_early(sid, [(b":status", b"415" if headers.get(b":method") == b"POST" else b"405")])
            return
        try:
            call.deadline = _deadline(headers.get(b"grpc-timeout"), self._loop.time())
            encoding = headers.get(b"grpc-encoding", b"identity")
            if encoding != b"identity":
                raise Abort(Status.UNIMPLEMENTED, f"grpc-encoding {encoding.decode('latin-1')!r} is not accepted, only identity")
            if call.path not in self._server.methods:
                raise Abort(Status.UNIMPLEMENTED, f"unknown method {call.path}")
        except Abort as exc:
            self._refuse(call, exc.status, exc.message, encoding=b"grpc-encoding" in headers)

    def _data(self, ev: h2.events.DataReceived) -> None:
        sid = ev.stream_id
        if ev.flow_controlled_length:
            self._h2.acknowledge_received_data(ev.flow_controlled_length, sid)
        call = self._calls.get(sid)
        if call is None:  # refused already (or reset): what else its client sends is dropped
            return
        call.body += ev.data
        limit = self._server.max_receive + 5
        if len(call.body) > limit:
            self._refuse(call, Status.RESOURCE_EXHAUSTED, f"received message larger than max (over {limit - 5} bytes)")

    def _ended(self, sid: int) -> None:
        call = self._calls.get(sid)
        if call is None or call.task is not None:
            return
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

    def _reset(self, sid: int) -> None:
        call = self._calls.pop(sid, None)
        if call is not None and call.task is not None:
            call.task.cancel()  # the client gave up (its deadline, or it cancelled): stop the work
        self._window.set()

    # --- answers -----------------------------------------------------------------------------

    async def _run(self, call: Call, method: Method[Any, Any], request: Message) -> None:
        try:
            reply = await method.handler(request, call)
            body = reply.SerializeToString()
        except Abort as exc:
            self._finish(call, _trailers(exc.status, exc.message))
            return
        except asyncio.CancelledError:
            if self._calls.pop(call.stream_id, None) is not None and not self._closed():
                self._h2.reset_stream(call.stream_id, h2.errors.ErrorCodes.CANCEL)
                self._schedule_flush()
            raise
        except Exception as exc:  # a bug, not the request's failure: UNKNOWN, and logged
            log.exception("gRPC handler for %s failed", call.path)
            self._finish(call, _trailers(Status.UNKNOWN, f"unexpected {type(exc).__name__}: {exc}"))
            return
        if len(body) > self._server.max_send:
            self._finish(call, _trailers(Status.RESOURCE_EXHAUSTED,
                                         f"the answer is larger than max ({len(body)} vs. {self._server.max_send} bytes)"))  # fmt: skip
            return
        message = b"\x00" + len(body).to_bytes(4, "big") + body
        if call.stream_id not in self._calls or self._closed():
            return
        h = self._h2
        sid = call.stream_id
        h.send_headers(sid, _HEADERS)
        if len(message) <= min(h.local_flow_control_window(sid), h.max_outbound_frame_size):
            h.send_data(sid, message)  # the common case: the whole answer fits the window now
        else:
            await self._send_large(sid, memoryview(message))
            if sid not in self._calls or self._closed():
                return
        self._finish(call, _OK, headers=False)

    async def _send_large(self, sid: int, message: memoryview) -> None:
        sent = 0
        while sent < len(message):
            if sid not in self._calls or self._closed():
                return
            n = min(self._h2.local_flow_control_window(sid), self._h2.max_outbound_frame_size, len(message) - sent)
            if n <= 0 or not self._writable:
                self._flush()
                self._window.clear()
                await self._window.wait()
                continue
            self._h2.send_data(sid, message[sent : sent + n])
            sent += n
            self._schedule_flush()

    def _finish(self, call: Call, trailers: list[tuple[bytes, bytes]], *, headers: bool = True) -> None:
        if self._calls.pop(call.stream_id, None) is None or self._closed():
            return  # reset by the client meanwhile, or the connection is gone
        if headers:  # trailers-only: the protocol's answer for a call that fails before any message
            trailers = _HEADERS + trailers
        self._h2.send_headers(call.stream_id, trailers, end_stream=True)
        self._schedule_flush()

    def _refuse(self, call: Call, status: Status, message: str, *, encoding: bool = False) -> None:
        """Answer a call with a status before its handler runs."""
        trailers = _HEADERS + _trailers(status, message)
        if encoding:
            trailers.append((b"grpc-accept-encoding", b"identity"))
        self._answer_early(call.stream_id, trailers)

    def _answer_early(self, sid: int, headers: list[tuple[bytes, bytes]]) -> None:
        """A whole answer in one HEADERS frame; the client, if still sending, is told to stop."""
        self._calls.pop(sid, None)
        self._h2.send_headers(sid, headers, end_stream=True)
        stream = self._h2.streams.get(sid)
        if stream is not None and stream.open:
            # Still sending (a message over the limit, say): HTTP/2 lets a server that has answered
            # in full reset the rest with NO_ERROR, and the client keeps the answer.
            self._h2.reset_stream(sid, h2.errors.ErrorCodes.NO_ERROR)
        self._schedule_flush()

    # --- writes ------------------------------------------------------------------------------

    def _closed(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def _schedule_flush(self) -> None:
        # Answers finished in one loop turn leave in one write (and one TCP segment) at its end.
        if not self._flushing:
            self._flushing = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        data = self._h2.data_to_send()
        if data and not self._closed():
            assert self._transport is not None
            self._transport.write(data)

    # --- stopping ----------------------------------------------------------------------------

    def goaway(self) -> None:
        """Tell the client no new call will be taken here; the calls under way go on.

        Written as a raw frame: h2's own ``close_connection`` would end the calls under way too.
        """
        if self._closed() or self._last_stream is not None:
            return
        self._flush()
        self._last_stream = self._h2.highest_inbound_stream_id
        assert self._transport is not None
        self._transport.write(GoAwayFrame(stream_id=0, last_stream_id=self._last_stream, error_code=0).serialize())

    def tasks(self) -> list[asyncio.Task[None]]:
        return [c.task for c in self._calls.values() if c.task is not None]

    def close(self) -> None:
        if self._closed():
            return
        self._flush()
        try:
            self._h2.close_connection()
        except h2.exceptions.ProtocolError:  # already closed by the peer
            pass
        self._flush()
        assert self._transport is not None
        self._transport.close()


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
