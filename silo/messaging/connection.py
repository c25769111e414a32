"""One connection: what frames mean, write batching, request futures and their deadlines.

Either side of a connection may send requests; each gets an id, and its
future is answered by the RESPONSE or ERROR frame that carries the id back
(frames are laid out as :mod:`silo.messaging.frame` says; the bytes become
frames in :mod:`silo.messaging.receive`, which :class:`Connection` extends).
Requests from the peer go to the handler (the silo's dispatcher), at most
``max_in_flight`` at a time: the serving side's own bound, whatever the peer
does; one over it is answered with OverloadedError at once.

Sending queues encoded frames: a lone call goes out at once (deferring it
would only cost a sequential caller a loop turn); the small frames of a burst
are joined into one write at the end of the loop turn, or as soon as 256 wait;
big buffers go from the tensor's own memory, in 1 MB slices that honour the
kernel's back-pressure. Deadlines share one timer per connection, for the
earliest one in a heap (a timer per call costs more than the call itself); an
expired request fails with GrainTimeoutError and a CANCEL goes to the peer.

A streamed call (an async-generator method: :mod:`silo.messaging.results`) is a request
whose items come as ITEM frames before its answer: the caller's side puts them into the
call's :class:`~grains.result_stream.StreamChannel` and sends CREDIT as it takes them
(:meth:`Connection.open_stream`); the serving side keeps each such call's :class:`Sink`
(:meth:`Connection.serve_stream`), which CREDIT frames feed, and stops it when the call is
cancelled or the connection is lost, so no generator waits for credit that cannot come.

Until the handshake (:mod:`silo.messaging.handshake`) is done, a connection
takes only handshake frames. A client that has observers names itself with a
CLIENT frame (``client_id``) on the connections it opens, before any request
that could carry one: a silo sends calls to that client's observers back over
them (a client usually cannot be dialled).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from grains.result_stream import StreamChannel
from silo import errors
from silo.codec import Codec, Encoded
from silo.messaging import frame as _frame
from silo.messaging import handshake, tls
from silo.messaging.frame import (
    AUTH_OK,
    CANCEL,
    CLIENT,
    CREDIT,
    DIRECT_MIN,
    ERROR,
    HELLO,
    ITEM,
    ONEWAY,
    PING,
    PONG,
    REQUEST,
    RESPONSE,
    STREAM,
    Frame,
)
from silo.messaging.frame import packb as _packb
from silo.messaging.receive import Counters, FrameReceiver
from silo.messaging.results import Sink
from silo.messaging.wire_errors import error_body, error_from_body
from silo.settings import TransportSettings

log = logging.getLogger("redgrain.transport")

# The structs are bound here, not imported by name: CPython 3.11 compiles ``NAME.method()``
# on a from-imported NAME as an attribute load that makes a bound method (it takes NAME for
# a module) instead of LOAD_METHOD, which cost ~3% of the per-frame time.
PREFIX = _frame.PREFIX
BUFLEN = _frame.BUFLEN

_SLICE = 1 << 20
# Same-host sockets: room for a few MB in flight (the kernel caps it at net.core.wmem_max).
_UNIX_BUFFER = 4 << 20
# Small frames queued for one write are flushed once this many are waiting, so that a
# burst of calls reaches the peer while the rest of it is still being produced.
_BATCH_FRAMES = 256


class RequestHandler(Protocol):
    def __call__(self, conn: Connection, frame: Frame) -> None: ...


class Connection(FrameReceiver):
    """One TCP connection; either side may send requests."""

    def __init__(
        self,
        *,
        codec: Codec,
        settings: TransportSettings,
        counters: Counters,
        handler: RequestHandler | None,
        server_side: bool,
        on_close: Callable[[Connection], None] | None = None,
        on_open: Callable[[Connection], None] | None = None,
        on_client: Callable[[Connection], None] | None = None,
        on_probe: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(settings, counters, server_side)
        self._on_client = on_client
        self._on_probe = on_probe
        self.client_id: str | None = None
        """The id the peer named itself with (a CLIENT frame): set on a silo's side of a client's connection."""
        self.codec = codec
        self._handler = handler
        self._on_close = on_close
        self._on_open = on_open
        self._secret = (
            settings.cluster_secret.get_secret_value().encode() if settings.cluster_secret else None
        )
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_event_loop()
        self._ids = itertools.count(1)
        # label: "grain.method", or (grain, method) so a call need not format it.
        self._pending: dict[int, tuple[asyncio.Future[Any], str | tuple[object, str]]] = {}
        self._streams: dict[int, StreamChannel] = {}
        """Our streamed calls still open, by request id (each also in _pending, for its end)."""
        self._served: dict[int, Sink] = {}
        """Streamed calls from the peer that we serve, by its request id: where its CREDIT goes."""
        self._serving = 0
        """Requests from the peer being served now (bounded by max_in_flight)."""
        self._waiters: deque[asyncio.Future[None]] = deque()
        """Callers waiting for a slot (max_in_flight reached), first come first served."""
        self._handed = 0
        """Slots freed and handed to a waiter that has not sent its request yet."""
        # One timer for the earliest deadline instead of one per request:
        # a libuv/asyncio timer per call costs more than the call itself.
        self._deadlines: list[tuple[float, int]] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_at = float("inf")
        self._out: deque[bytes | memoryview] = deque()
        self._flush_scheduled = False
        self._joining_writelines = False
        self._big: asyncio.Task[None] | None = None
        self._paused: asyncio.Future[None] | None = None
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.closed = False
        self._closed_here = False
        """close() was called: the calls in flight end with SiloClosedError (we closed it), not
        SiloUnavailableError (the peer broke), as a call made after the close does."""
        self._nonce = b""
        """The acceptor's HELLO nonce (sent by us on an accepted connection, received otherwise)."""
        self._our_nonce = b""
        self._tls = False
        """Connecting side: the nonce our AUTH carried, which the acceptor's proof must cover."""

    # --- asyncio protocol --------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        self._tls = transport.get_extra_info("ssl_object") is not None
        # Python 3.11's own transports inherit writelines() from WriteTransport, which joins the
        # parts into one bytes: a frame and its 1 MB buffer copied whole on every call (a client
        # on asyncio's loop spent a quarter of a 1 MB echo there). uvloop's writes them as they are.
        self._joining_writelines = getattr(type(transport), "writelines", None) is asyncio.WriteTransport.writelines
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else (str(peer) or "same-host socket")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            # The default 200 KB buffers make a multi-MB tensor take many wake-ups.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _UNIX_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _UNIX_BUFFER)
        self._n.connections_opened += 1
        if self._on_open is not None:
            self._on_open(self)
        if self._server_side:
            self._nonce = handshake.new_nonce(self._secret)
            self._authenticated = self._secret is None
            self._send_frame([HELLO, self._nonce])
            self._flush()
            if self._authenticated and not self.ready.done():
                self.ready.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._direct = None
        err: errors.RedgrainError = (
            errors.SiloClosedError(f"connection to {self.peer}")
            if self._closed_here
            else errors.SiloUnavailableError(self.peer, f"connection lost ({exc or 'closed by peer'})")
        )
        if self._tls and not self.ready.done() and not self._server_side:
            # Under TLS 1.3 the silo checks our certificate after our side of the handshake is
            # done, and sends its HELLO only once it accepted it: a refusal shows as an alert
            # on the first read, or as the connection closing before any HELLO.
            err = tls.refusal(self.peer, exc if isinstance(exc, ssl.SSLError) else None)
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._deadlines.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(err)
                waiter.exception()
        self._waiters.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._big is not None:
            self._big.cancel()
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        for sink in self._served.values():
            sink.stop()  # nobody takes the items any more: the generators stop (their finally runs)
        self._served.clear()
        if self._on_close is not None:
            self._on_close(self)

    def pause_writing(self) -> None:
        if self._paused is None or self._paused.done():
            self._paused = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)

    def _on_frame(self, frame: Frame) -> None:
        kind = frame.header[0]
        if not self._authenticated:
            self._on_handshake(frame)
            return
        if kind == RESPONSE or kind == ERROR:
            self._on_response(frame)
        elif kind == ITEM:
            self._on_item(frame)
        elif kind == CREDIT:
            header = frame.header
            if len(header) < 3 or not isinstance(header[1], int) or not isinstance(header[2], int):
                raise errors.CodecError(f"malformed CREDIT frame: {header!r:.100}")
            sink = self._served.get(header[1])
            if sink is not None:
                sink.grant(header[2])
        elif kind in (REQUEST, ONEWAY, CANCEL, STREAM):
            if self._handler is None:
                self._n.bad_frames += 1
                return
            if kind == CANCEL and self._served and len(frame.header) > 1 and isinstance(frame.header[1], int):
                sink = self._served.get(frame.header[1])
                if sink is not None:
                    sink.stop()  # (a stream relayed to another silo waits on nothing else)
            if kind == REQUEST or kind == STREAM:
                # The serving side's own bound: a peer that ignores its
                # max_in_flight still cannot make us hold unbounded calls.
                if self._serving >= self._settings.max_in_flight:
                    # Shed before anything ran: the caller's router retries it within its deadline.
                    self._n.overloaded += 1
                    req_id = frame.header[1] if len(frame.header) > 1 else 0
                    self._send_error_frame(
                        req_id, errors.LoadShedError(f"connection from {self.peer}", self._settings.max_in_flight)
                    )
                    return
                self._serving += 1
            self._handler(self, frame)
        elif kind == PING:
            self._send_frame([PONG, frame.header[1] if len(frame.header) > 1 else 0])
            # A failure detector's probe names its silo: it tells us that monitor still reaches us.
            if self._on_probe is not None and len(frame.header) > 2 and isinstance(frame.header[2], str):
                self._on_probe(frame.header[2])
        elif kind == PONG:
            self._on_response(frame)
        elif kind == CLIENT and self._server_side and self.client_id is None:
            if len(frame.header) < 3 or not isinstance(frame.header[2], str) or not frame.header[2]:
                raise errors.CodecError(f"CLIENT frame without a client id: {frame.header!r:.100}")
            self.client_id = frame.header[2]
            if self._on_client is not None:
                self._on_client(self)
        else:
            raise errors.CodecError(f"unknown frame kind {kind!r}")

    def _on_handshake(self, frame: Frame) -> None:
        kind = frame.header[0]
        if self._server_side:
            if not handshake.proves_secret(self._secret, self._nonce, frame.header):
                self._n.refused += 1
                log.warning("refused connection from %s: cluster secret missing or wrong", self.peer)
                self.abort()
                return
            self._authenticated = True
            self._send_frame(handshake.auth_ok(self._secret, self._nonce, frame.header))
            if not self.ready.done():
                self.ready.set_result(None)
            return
        try:
            if kind == HELLO and not self._nonce:
                answer = handshake.answer_hello(self._secret, frame.header, self.peer)
                if answer is None:
                    self._set_ready()
                    return
                reply, self._our_nonce = answer
                self._nonce = frame.header[1]
                self._send_frame(reply)
            elif kind == AUTH_OK and self._our_nonce and self._secret is not None:
                # The silo must prove the secret too, before any call goes to it.
                handshake.check_auth_ok(self._secret, self._nonce, self._our_nonce, frame.header, self.peer)
                self._set_ready()
            else:
                raise errors.AuthenticationError(self.peer, f"unexpected frame kind {kind} in the handshake")
        except errors.AuthenticationError as exc:
            self._n.refused += 1
            log.warning("refused connection to %s: %s", self.peer, exc)
            self._fail_ready(exc)

    def _set_ready(self) -> None:
        self._authenticated = True
        if not self.ready.done():
            self.ready.set_result(None)

    def _fail_ready(self, exc: Exception) -> None:
        if not self.ready.done():
            self.ready.set_exception(exc)
            self.ready.exception()
        self.abort()

    def _on_response(self, frame: Frame) -> None:
        req_id = frame.header[1] if len(frame.header) > 1 else None
        entry = self._pending.pop(req_id, None) if isinstance(req_id, int) else None
        if entry is None:
            return  # answered after its deadline: the caller already gave up
        if self._waiters:
            self._hand_slots()
        fut, _ = entry
        if fut.done():
            return
        kind = frame.header[0]
        if kind == PONG:
            fut.set_result(None)
            return
        try:
            value = self.codec.decode(frame.meta, frame.buffers)
        except errors.CodecError as exc:
            fut.set_exception(exc)
            return
        if kind == ERROR:
            fut.set_exception(error_from_body(value, self.codec.registry))
        else:
            fut.set_result(value)

    def _on_item(self, frame: Frame) -> None:
        req_id = frame.header[1] if len(frame.header) > 1 else None
        stream = self._streams.get(req_id) if isinstance(req_id, int) else None
        if stream is None:
            return  # the caller left the stream; its CANCEL is on the way
        try:
            item = self.codec.decode(frame.meta, frame.buffers)
        except errors.CodecError as exc:
            self.cancel(req_id)  # type: ignore[arg-type]
            stream.finish(exc)
            return
        stream.push(item)

    # --- send --------------------------------------------------------------
    def _send_frame(self, header: list[Any], encoded: Encoded | None = None) -> None:
        if self._transport is None or self.closed:
            raise errors.SiloUnavailableError(self.peer, "connection closed")
        h = _packb(header)
        meta = encoded.meta if encoded is not None else b""
        bufs = encoded.buffers if encoded is not None else []
        if not bufs:
            frame = PREFIX.pack(len(h), len(meta), 0) + h + meta
            self._out.append(frame)
            self._n.frames_out += 1
            self._n.bytes_out += len(frame)
            # A lone call (nothing else in flight on this connection either way) goes out now:
            # deferring it to batch with others would only cost the sequential caller a loop turn.
            if len(frame) >= DIRECT_MIN or len(self._pending) + self._serving <= 1 or len(self._out) >= _BATCH_FRAMES:
                self._flush()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
            return
        ctl = [PREFIX.pack(len(h), len(meta), len(bufs))]
        ctl.extend(BUFLEN.pack(b.nbytes) for b in bufs)
        ctl.append(h)
        ctl.append(meta)
        self._out.append(b"".join(ctl))
        size = sum(len(c) for c in ctl)
        if bufs:
            self._out.extend(bufs)
            size += sum(b.nbytes for b in bufs)
        self._n.frames_out += 1
        self._n.bytes_out += size
        if size >= DIRECT_MIN:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write queued frames; hand big buffers to a task that writes them in slices."""
        self._flush_scheduled = False
        if self._big is not None or self._transport is None or self.closed:
            return
        out = self._out
        if len(out) == 1 and len(out[0]) <= _SLICE:
            self._transport.write(out.popleft())
            return
        # Small frames are joined into one write (one syscall, and uvloop's writelines
        # handles each item separately); big buffers go as they are, without a copy.
        batch: list[bytes | memoryview] = []
        small: list[bytes | memoryview] = []
        while out:
            part = out.popleft()
            if len(part) < DIRECT_MIN:
                small.append(part)
                continue
            if small:
                batch.append(b"".join(small) if len(small) > 1 else small[0])
                small = []
            if len(part) > _SLICE and isinstance(part, memoryview):
                self._write_parts(batch)
                self._big = self._loop.create_task(self._write_big(part.cast("B")))
                return
            batch.append(part)
        if small:
            batch.append(b"".join(small) if len(small) > 1 else small[0])
        self._write_parts(batch)

    def _write_parts(self, batch: list[bytes | memoryview]) -> None:
        assert self._transport is not None
        if len(batch) == 1:
            self._transport.write(batch[0])
        elif batch:
            if self._joining_writelines:
                # More than one part means a big one among them (small frames are joined
                # before): a write each, and asyncio sends at once what the kernel takes.
                for part in batch:
                    self._transport.write(part)
            else:
                self._transport.writelines(batch)

    async def _write_big(self, part: memoryview) -> None:
        # Writing a huge buffer at once makes asyncio copy the unsent rest and
        # then memmove it down after every send (quadratic); slices keep each
        # copy small and let the kernel take the rest zero-copy.
        try:
            for off in range(0, part.nbytes, _SLICE):
                if self.closed or self._transport is None:
                    return
                self._transport.write(part[off : off + _SLICE])
                if self._paused is not None and not self._paused.done():
                    await self._paused
        finally:
            self._big = None
        self._flush()

    async def drain(self) -> None:
        """Wait while the kernel's send buffer is full (back-pressure for big tensors)."""
        if self._paused is not None and not self._paused.done():
            await self._paused

    # --- back-pressure: a slot per outstanding request ---------------------
    def has_slot(self) -> bool:
        """Whether a request may be sent now without going over ``max_in_flight``."""
        return len(self._pending) + self._handed < self._settings.max_in_flight

    async def wait_slot(self, deadline: float) -> None:
        """Wait, in arrival order, until a request may be sent; then send it before awaiting anything.

        Raises TimeoutError when ``deadline`` (the loop's clock) passes first, and
        SiloUnavailableError when the connection is lost meanwhile (nothing was sent:
        safe to retry).
        """
        if self.closed:
            raise errors.SiloUnavailableError(self.peer, "connection closed")
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed a slot and timed out (or was cancelled) before using it: pass it on.
                self._handed -= 1
                self._hand_slots()
            else:
                waiter.cancel()  # skipped by _hand_slots; no O(n) removal from the queue
            raise
        self._handed -= 1  # the caller's request takes the slot in this same step

    def _hand_slots(self) -> None:
        limit = self._settings.max_in_flight
        waiters = self._waiters
        while waiters and len(self._pending) + self._handed < limit:
            waiter = waiters.popleft()
            if not waiter.done():
                self._handed += 1
                waiter.set_result(None)

    def request(
        self, header: list[Any], body: Any, timeout_s: float | None, label: str | tuple[object, str] = ""
    ) -> asyncio.Future[Any]:
        """Send a request; the future gets the decoded result or the error.

        Over ``max_in_flight`` this raises OverloadedError: callers that should wait
        (the router) check :meth:`has_slot` and :meth:`wait_slot` first.
        """
        req_id, encoded = self._admit(header, body)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._pending[req_id] = (fut, label)
        if timeout_s is not None:
            self._arm(req_id, timeout_s)
        self._send_frame(header, encoded)
        transport = self._transport  # _failed_in_write(), inlined: this runs on every call
        if transport is not None and transport.is_closing():
            # Its own write failed: not one byte of it left this process, so it never ran.
            self._pending.pop(req_id, None)
            fut.cancel()
            raise self._never_sent()
        return fut

    def open_stream(
        self, header: list[Any], body: Any, stream: StreamChannel, label: tuple[object, str]
    ) -> int:
        """Send a STREAM request and its first credit (``stream.window``); its items go to
        ``stream`` as they come, its end (RESPONSE, ERROR, a lost connection) finishes it.

        No deadline is armed here: a stream's deadline is per item, kept by the stream itself
        (and by the router while it opens). Returns the request id. Over ``max_in_flight`` this
        raises OverloadedError, as :meth:`request` does."""
        req_id, encoded = self._admit(header, body)
        end: asyncio.Future[Any] = self._loop.create_future()
        self._pending[req_id] = (end, label)
        self._streams[req_id] = stream

        def ended(fut: asyncio.Future[Any]) -> None:
            # After every ITEM read before the end (this runs a loop step later): order holds.
            self._streams.pop(req_id, None)
            stream.finish(None if fut.cancelled() else fut.exception())

        end.add_done_callback(ended)
        stream.attach(_RemoteLink(self, req_id, label))
        self._send_frame(header, encoded)
        self._send_frame([CREDIT, req_id, stream.window])
        return req_id

    def send_credit(self, req_id: int, n: int) -> None:
        """Let the callee of our stream ``req_id`` send ``n`` more items."""
        if req_id in self._streams and not self.closed:
            self._send_frame([CREDIT, req_id, n])

    def serve_stream(self, req_id: int) -> Sink:
        """Where the items of the peer's streamed call ``req_id`` go (as ITEM frames), against the
        credit its CREDIT frames grant; stopped by its CANCEL or by this connection's loss."""
        sink = self._served[req_id] = Sink(functools.partial(self.send_item, req_id), self.drain)
        if self.closed:
            sink.stop()
        return sink

    def end_stream(self, req_id: int) -> None:
        self._served.pop(req_id, None)

    def send_item(self, req_id: int, item: Any) -> None:
        """One item of a stream we serve (CodecError, before anything is sent, for one the wire
        cannot carry)."""
        encoded = self.codec.encode(item)
        if not self.closed:
            self._send_frame([ITEM, req_id], encoded)

    def send_one_way(self, header: list[Any], body: Any) -> None:
        """Send a ONEWAY frame: a request nobody answers (``@one_way`` methods)."""
        if self.closed:
            raise errors.SiloUnavailableError(self.peer, "connection closed")
        self._check_sendable()
        self._send_frame(header, self.codec.encode(body))
        if self._failed_in_write():
            raise self._never_sent()

    def _admit(self, header: list[Any], body: Any) -> tuple[int, Any]:
        """A request's id (written into ``header``) and its encoded body, or why it may not go:
        the connection closed, ``max_in_flight`` reached, or an earlier write already failed
        (then it never leaves, so it is retried). One rule for plain and streamed calls."""
        if self.closed:
            raise errors.SiloUnavailableError(self.peer, "connection closed")
        if len(self._pending) + self._handed >= self._settings.max_in_flight:
            raise errors.OverloadedError(f"connection to {self.peer}", self._settings.max_in_flight)
        req_id = next(self._ids)
        header[1] = req_id
        encoded = self.codec.encode(body)
        transport = self._transport  # _check_sendable(), inlined: this runs on every call
        if transport is not None and transport.is_closing():
            raise self._never_sent()
        return req_id, encoded

    def _check_sendable(self) -> None:
        """SiloNotServingError if an earlier write already failed (the transport is closing and
        connection_lost has not run yet): a frame sent now would never leave."""
        if self._transport is not None and self._transport.is_closing():
            raise self._never_sent()

    def _failed_in_write(self) -> bool:
        """Whether the transport started closing during the send just made: only the write
        syscall failing does that synchronously (asyncio and uvloop write at once when nothing
        is buffered, and a failed syscall sent nothing; with data buffered a write only queues,
        so a later failure is reported by connection_lost, as may-have-run)."""
        return self._transport is not None and self._transport.is_closing()

    def _never_sent(self) -> errors.SiloNotServingError:
        # The peer is gone (SIGKILL: the write fails with EPIPE or ECONNRESET) and we know it
        # before the call left, so it cannot have run: the router retries it (the first call
        # after a silo is killed, before its death is noticed, is retried, not failed).
        return errors.SiloNotServingError(self.peer, "connection broken before the call was sent")

    def identify(self, client_id: str) -> None:
        """Name this (client's) end to the silo: calls to the client's observers may come back on it."""
        self._send_frame([CLIENT, 0, client_id])

    def ping(self, timeout_s: float, sender: str | None = None) -> asyncio.Future[Any]:
        """PING the peer; ``sender``: this silo's address, when the ping is its failure detector's
        probe (the peer counts it as its monitor's, ``Transport.on_probe``)."""
        req_id = next(self._ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._pending[req_id] = (fut, "ping")
        self._arm(req_id, timeout_s)
        self._send_frame([PING, req_id] if sender is None else [PING, req_id, sender])
        return fut

    def _arm(self, req_id: int, timeout_s: float) -> None:
        at = self._loop.time() + timeout_s
        heapq.heappush(self._deadlines, (at, req_id))
        if at < self._sweep_at:
            if self._sweeper is not None:
                self._sweeper.cancel()
            self._sweep_at = at
            self._sweeper = self._loop.call_at(at, self._sweep)
        if len(self._deadlines) > 2 * len(self._pending) + 1024:
            # Drop entries of answered requests so the heap stays proportional.
            self._deadlines = [d for d in self._deadlines if d[1] in self._pending]
            heapq.heapify(self._deadlines)

    def _sweep(self) -> None:
        self._sweeper = None
        self._sweep_at = float("inf")
        now = self._loop.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, req_id = heapq.heappop(self._deadlines)
            self._expire(req_id)
        while self._deadlines and self._deadlines[0][1] not in self._pending:
            heapq.heappop(self._deadlines)
        if self._deadlines:
            self._sweep_at = self._deadlines[0][0]
            self._sweeper = self._loop.call_at(self._sweep_at, self._sweep)

    def _expire(self, req_id: int) -> None:
        entry = self._pending.pop(req_id, None)
        if entry is None:
            return
        if self._waiters:
            self._hand_slots()
        fut, label = entry
        if not fut.done():
            if isinstance(label, tuple):
                target, method = str(label[0]), label[1]
            else:
                target, _, method = label.rpartition(".")
            fut.set_exception(errors.GrainTimeoutError(target, method, 0.0))
        try:
            self._send_frame([CANCEL, req_id])
        except errors.SiloError:
            pass

    def cancel(self, req_id: int) -> None:
        """The caller gave up on a request before its answer: forget it and send the peer a CANCEL,
        as its deadline does (the callee's turn is cancelled, or its queued call dropped)."""
        self._streams.pop(req_id, None)
        if self._pending.pop(req_id, None) is None:
            return  # answered (or expired) already
        if self._waiters:
            self._hand_slots()
        try:
            self._send_frame([CANCEL, req_id])
        except errors.SiloError:
            pass

    def send_response(self, req_id: int, value: Any) -> None:
        """Answer a request (exactly once per request received)."""
        if self._serving:
            self._serving -= 1
        if self.closed:
            return
        try:
            encoded = self.codec.encode(value)
        except errors.CodecError as exc:
            self._send_error_frame(req_id, exc)
            return
        self._send_frame([RESPONSE, req_id], encoded)

    def send_error(self, req_id: int, exc: BaseException) -> None:
        """Answer a request with an error (exactly once per request received)."""
        if self._serving:
            self._serving -= 1
        self._send_error_frame(req_id, exc)

    def _send_error_frame(self, req_id: int, exc: BaseException) -> None:
        if self.closed:
            return
        try:
            encoded = self.codec.encode(error_body(exc))
        except errors.CodecError:
            encoded = self.codec.encode({"code": "remote", "type": type(exc).__name__, "message": repr(exc)})
        self._send_frame([ERROR, req_id], encoded)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        if self._transport is not None and not self.closed:
            self._closed_here = True
            self._flush()
            self._transport.close()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def tls_version(self) -> str | None:
        """The TLS version this connection runs ("TLSv1.3"), or None on a plain socket."""
        ssl_object = self._transport.get_extra_info("ssl_object") if self._transport is not None else None
        return ssl_object.version() if ssl_object is not None else None


class _RemoteLink:
    """A streamed call's request on a connection, as its :class:`~grains.result_stream.StreamChannel` sees it."""

    __slots__ = ("_conn", "_label", "_req_id")

    def __init__(self, conn: Connection, req_id: int, label: tuple[object, str]) -> None:
        self._conn, self._req_id, self._label = conn, req_id, label

    def grant(self, n: int) -> None:
        self._conn.send_credit(self._req_id, n)

    def cancel(self) -> None:
        try:
            self._conn.cancel(self._req_id)
        except RuntimeError:
            pass  # the loop is closed: so is the connection

    def timed_out(self, timeout_s: float) -> Exception:
        target, method = self._label
        return errors.GrainTimeoutError(str(target), method, timeout_s)
