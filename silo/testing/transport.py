"""The transport in memory: silos of one test talk over an :class:`InMemoryNetwork`, no sockets.

:class:`InMemoryTransport` has the surface a silo uses of
:class:`~silo.messaging.transport.Transport` (``listen``, ``connect``,
``connection_nowait``, ``drop``, ``close``, ``abort_all``, ``statistics``,
``set_handler``), and its :class:`InMemoryConnection` the surface of a
:class:`~silo.messaging.connection.Connection` (``request``, ``ping``,
``send_response``, ``send_error``, ``abort``, ``close``, ``codec``,
``peer``), so the real router, dispatcher and failure detector's probe run
over it unchanged. A network is a registry of listening endpoints that a
test owns (two tests, or two worlds in one test, never meet).

What it models, each as the socket transport behaves:

* Frames: a header (packed with msgpack, so a tuple arrives as a list),
  the codec's meta and out-of-band buffers (copied into fresh 64-byte
  aligned arrays, as the receive path gives them), counted in bytes as the
  wire layout would be. Delivery is in order, on a later loop iteration
  (``call_soon``), never inside the sender's call.
* The handshake: HELLO from the acceptor, the cluster-secret challenge
  (:mod:`silo.messaging.handshake`'s own checks), so a secret mismatch
  raises AuthenticationError or is refused as on the wire.
* Request ids and futures, deadlines on the loop's clock (so a
  :class:`~silo.testing.clock.VirtualClock` drives them: an expired request
  fails with GrainTimeoutError and a CANCEL goes to the peer), PING/PONG,
  ``max_in_flight`` on both sides, ``max_frame_bytes``.
* Failures: connecting to an endpoint nobody listens on raises
  SiloUnavailableError caused by ConnectionRefusedError (the failure
  detector's probe reads that as "the process is gone"); a connection that
  is aborted or closed, on either side, fails the requests pending on both
  with SiloUnavailableError; a frame whose header does not decode is a
  CodecError that aborts that one connection and counts as ``bad_frames``.

What it does not model: partial writes and back-pressure (a frame arrives
whole, or not at all once its connection is down), TLS, Unix sockets (all
peers "use TCP"), partitions that make packets vanish while both ends live,
and latency (a frame takes one loop iteration). ``close`` and ``abort``
differ only in name: there is no send buffer to flush or to drop.

Why values go through the codec: silos in one process must not share
objects. A grain that returned its own list, and a caller that then
appended to it, would be a bug no real cluster has; encoding and decoding
every body also means a value the wire cannot carry fails here as it would
there, with the same CodecError, and a test sees exactly what a remote peer
would (tuples, registered models, tensors rebuilt from their bytes).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from silo import errors
from silo.codec import Codec, Encoded
from silo.messaging import handshake
from silo.messaging.frame import (
    AUTH_OK,
    BUFLEN,
    CANCEL,
    ERROR,
    HELLO,
    ONEWAY,
    PING,
    PONG,
    PREFIX,
    REQUEST,
    RESPONSE,
    Frame,
    aligned,
    packb,
    unpackb,
)
from silo.messaging.receive import Counters
from silo.messaging.transport import TransportStatistics
from silo.messaging.wire_errors import error_body, error_from_body
from silo.settings import TransportSettings

if TYPE_CHECKING:
    from silo.messaging.transport import Connector

log = logging.getLogger("redgrain.transport")

# As silo.messaging.receive: the largest control part an accepted connection takes before its handshake.
_PRE_AUTH_MAX = 4096

Handler = Callable[[Any, Frame], None]
"""``on_frame(conn, frame)``: the silo's dispatcher, given requests, one-way calls and cancels."""


class InMemoryNetwork:
    """Listening endpoints of one test's world; ``host:port`` -> the transport listening there.

    ``port 0`` in :meth:`InMemoryTransport.listen` takes the next free port
    from ``first_port`` on, as the kernel picks one.
    """

    def __init__(self, *, first_port: int = 20_000) -> None:
        self._listeners: dict[str, InMemoryTransport] = {}
        self._ports = itertools.count(first_port)
        self._ephemeral = itertools.count(40_000)

    def free_port(self, host: str = "127.0.0.1") -> int:
        """A port nobody listens on at ``host`` (reserved by no one: listen on it to take it)."""
        while True:
            port = next(self._ports)
            if f"{host}:{port}" not in self._listeners:
                return port

    def listening(self) -> list[str]:
        """Endpoints someone listens on now."""
        return sorted(self._listeners)

    def _bind(self, host: str, port: int, transport: InMemoryTransport) -> int:
        port = port or self.free_port(host)
        endpoint = f"{host}:{port}"
        if endpoint in self._listeners:
            raise OSError(errno.EADDRINUSE, f"[Errno {errno.EADDRINUSE}] address already in use: {endpoint}")
        self._listeners[endpoint] = transport
        return port

    def _unbind(self, transport: InMemoryTransport) -> None:
        for endpoint, t in list(self._listeners.items()):
            if t is transport:
                del self._listeners[endpoint]

    def _dial(self, endpoint: str) -> tuple[InMemoryTransport, str]:
        """The transport listening at ``endpoint`` and the caller's side's name (``host:port``)."""
        listener = self._listeners.get(endpoint)
        if listener is None:
            host, _, port = endpoint.rpartition(":")
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, f"[Errno {errno.ECONNREFUSED}] Connect call failed ({host!r}, {port})"
            )
        return listener, f"127.0.0.1:{next(self._ephemeral)}"


class InMemoryConnection:
    """One end of a connection on an :class:`InMemoryNetwork`; either side may send requests."""

    def __init__(self, owner: InMemoryTransport, *, server_side: bool, peer: str) -> None:
        self.codec: Codec = owner.codec
        self.peer = peer
        """The other end's ``host:port`` (the endpoint dialled, or the caller's ephemeral one)."""
        self.closed = False
        self._owner = owner
        self._settings = owner.settings
        self._n = owner._n
        self._handler = owner._handler  # as a socket connection: the handler when it was made
        self._server_side = server_side
        self._secret = (
            self._settings.cluster_secret.get_secret_value().encode() if self._settings.cluster_secret else None
        )
        self._loop = asyncio.get_running_loop()
        self._remote: InMemoryConnection | None = None
        self._up = True
        """False once aborted or closed here: nothing more goes out, nothing more is read."""
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Any], str | tuple[object, str], asyncio.TimerHandle | None]] = {}
        self._serving = 0
        self._authenticated = False
        self._nonce = b""
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.lost: asyncio.Future[None] = self._loop.create_future()
        """Done once this end has seen the connection go (its pending requests failed)."""

    # --- the socket's life -------------------------------------------------------------
    def _connection_made(self) -> None:
        self._n.connections_opened += 1
        if self._server_side:
            self._nonce = handshake.new_nonce(self._secret)
            self._authenticated = self._secret is None
            self._send([HELLO, self._nonce])
            if self._authenticated and not self.ready.done():
                self.ready.set_result(None)

    def _connection_lost(self, exc: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._up = False
        err = errors.SiloUnavailableError(self.peer, f"connection lost ({exc or 'closed by peer'})")
        for fut, _, timer in self._pending.values():
            if timer is not None:
                timer.cancel()
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()
        self.lost.set_result(None)
        self._owner._forget(self)

    def _hang_up(self) -> None:
        """Both ends see the connection go, each on a later loop iteration (after the frames
        already on their way, which still arrive)."""
        if not self._up:
            return
        self._up = False
        self._loop.call_soon(self._connection_lost, None)
        remote = self._remote
        if remote is not None:
            self._loop.call_soon(remote._connection_lost, None)

    def abort(self) -> None:
        self._hang_up()

    def close(self) -> None:
        self._hang_up()

    # --- receive -----------------------------------------------------------------------
    def _receive(self, h: bytes, meta: bytes, buffers: list[bytearray | memoryview], size: int) -> None:
        if not self._up:
            return
        self._n.bytes_in += size
        try:
            control = len(buffers) * BUFLEN.size + len(h) + len(meta)
            limit = self._settings.max_frame_bytes
            if self._server_side and not self._authenticated and control > _PRE_AUTH_MAX:
                raise errors.CodecError(f"frame control part of {control} bytes exceeds {_PRE_AUTH_MAX}")
            if size - PREFIX.size > limit:
                raise errors.CodecError(f"frame of {size - PREFIX.size} bytes exceeds max_frame_bytes={limit}")
            try:
                header = unpackb(h)
            except Exception as exc:
                raise errors.CodecError(f"malformed frame header: {exc}") from exc
            if type(header) is not list or not header or type(header[0]) is not int:
                raise errors.CodecError(f"malformed frame header: {header!r:.100}")
            self._n.frames_in += 1
            self._on_frame(Frame(header, meta, buffers))
        except errors.CodecError as exc:
            self._n.bad_frames += 1
            log.warning("closing connection from %s: %s", self.peer, exc)
            self.abort()
        except Exception:
            # asyncio's fatal-error path for a protocol callback that raised: log, close.
            log.exception("closing connection from %s: its frame handler failed", self.peer)
            self.abort()

    def _on_frame(self, frame: Frame) -> None:
        kind = frame.header[0]
        if not self._authenticated:
            self._on_handshake(frame)
            return
        if kind == RESPONSE or kind == ERROR or kind == PONG:
            self._on_response(frame)
        elif kind in (REQUEST, ONEWAY, CANCEL):
            if self._handler is None:
                self._n.bad_frames += 1
                return
            if kind == REQUEST:
                if self._serving >= self._settings.max_in_flight:
                    self._n.overloaded += 1
                    req_id = frame.header[1] if len(frame.header) > 1 else 0
                    self._send_error_frame(
                        req_id, errors.OverloadedError(f"connection from {self.peer}", self._settings.max_in_flight)
                    )
                    return
                self._serving += 1
            self._handler(self, frame)
        elif kind == PING:
            self._send([PONG, frame.header[1] if len(frame.header) > 1 else 0])
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
            self._send([AUTH_OK])
            if not self.ready.done():
                self.ready.set_result(None)
            return
        if kind == HELLO:
            try:
                reply = handshake.answer_hello(self._secret, frame.header, self.peer)
            except errors.AuthenticationError as exc:
                self._fail_ready(exc)
                return
            if reply is None:
                self._authenticated = True
                if not self.ready.done():
                    self.ready.set_result(None)
                return
            self._send(reply)
        elif kind == AUTH_OK:
            self._authenticated = True
            if not self.ready.done():
                self.ready.set_result(None)
        else:
            self._fail_ready(errors.CodecError(f"unexpected frame kind {kind} before handshake"))

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
        fut, _, timer = entry
        if timer is not None:
            timer.cancel()
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
            fut.set_exception(error_from_body(value))
        else:
            fut.set_result(value)

    # --- send --------------------------------------------------------------------------
    def _send(self, header: list[Any], encoded: Encoded | None = None) -> None:
        self._send_packed(packb(header), encoded.meta if encoded else b"", encoded.buffers if encoded else ())

    def _send_packed(self, h: bytes, meta: bytes, buffers: Sequence[memoryview | bytes]) -> None:
        if self.closed:
            raise errors.SiloUnavailableError(self.peer, "connection closed")
        # The receiver's own copies: the sender may reuse or change its memory at once.
        copies: list[bytearray | memoryview] = []
        size = PREFIX.size + len(h) + len(meta)
        for b in buffers:
            src = memoryview(b).cast("B")
            dst = aligned(src.nbytes)
            dst[:] = src
            copies.append(dst)
            size += BUFLEN.size + src.nbytes
        self._n.frames_out += 1
        self._n.bytes_out += size
        remote = self._remote
        if self._up and remote is not None and remote._up:
            self._loop.call_soon(remote._receive, h, meta, copies, size)
        # else: written into a socket that is going away; nobody reads it.

    def request(
        self, header: list[Any], body: Any, timeout_s: float | None, label: str | tuple[object, str] = ""
    ) -> asyncio.Future[Any]:
        """Send a request; the future gets the decoded result or the error."""
        if self.closed:
            raise errors.SiloUnavailableError(self.peer, "connection closed")
        if len(self._pending) >= self._settings.max_in_flight:
            raise errors.OverloadedError(f"connection to {self.peer}", self._settings.max_in_flight)
        req_id = next(self._ids)
        header[1] = req_id
        encoded = self.codec.encode(body)
        fut = self._track(req_id, label, timeout_s)
        self._send(header, encoded)
        return fut

    def ping(self, timeout_s: float) -> asyncio.Future[Any]:
        req_id = next(self._ids)
        fut = self._track(req_id, "ping", timeout_s)
        self._send([PING, req_id])
        return fut

    def _track(self, req_id: int, label: str | tuple[object, str], timeout_s: float | None) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self._loop.create_future()
        # A timer per request (the socket connection shares one for all): a twin needs no tuning.
        timer = None if timeout_s is None else self._loop.call_at(self._loop.time() + timeout_s, self._expire, req_id)
        self._pending[req_id] = (fut, label, timer)
        return fut

    def _expire(self, req_id: int) -> None:
        entry = self._pending.pop(req_id, None)
        if entry is None:
            return
        fut, label, _ = entry
        if not fut.done():
            if isinstance(label, tuple):
                target, method = str(label[0]), label[1]
            else:
                target, _, method = label.rpartition(".")
            fut.set_exception(errors.GrainTimeoutError(target, method, 0.0))
        try:
            self._send([CANCEL, req_id])
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
        self._send([RESPONSE, req_id], encoded)

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
        self._send([ERROR, req_id], encoded)

    # --- for tests: frames no well-behaved peer sends ------------------------------------
    def send_raw(self, header: bytes | list[Any], meta: bytes = b"", buffers: Sequence[bytes] = ()) -> None:
        """Send a frame as given: ``header`` as raw bytes (garbage allowed) or a list to pack."""
        self._send_packed(header if isinstance(header, bytes) else packb(header), meta, buffers)

    def request_raw(
        self, header: list[Any], meta: bytes, buffers: Sequence[bytes] = (), timeout_s: float | None = None
    ) -> asyncio.Future[Any]:
        """A request whose body is ``meta`` as given (undecodable allowed); ``header[1]`` gets its id."""
        if self.closed:
            raise errors.SiloUnavailableError(self.peer, "connection closed")
        req_id = next(self._ids)
        header[1] = req_id
        fut = self._track(req_id, "raw", timeout_s)
        self._send_packed(packb(header), meta, buffers)
        return fut

    @property
    def pending(self) -> int:
        return len(self._pending)


class InMemoryTransport:
    """A listener plus a pool of outgoing connections, one per endpoint, on an :class:`InMemoryNetwork`."""

    def __init__(
        self,
        settings: TransportSettings,
        codec: Codec,
        handler: Handler | None = None,
        *,
        network: InMemoryNetwork,
    ) -> None:
        self.settings = settings
        self.codec = codec
        self.network = network
        self._handler = handler
        self._n = Counters()
        self._listening = False
        self._out: dict[str, InMemoryConnection] = {}
        self._connecting: dict[str, asyncio.Future[InMemoryConnection]] = {}
        self._inbound: set[InMemoryConnection] = set()
        self.closed = False

    def set_handler(self, handler: Handler) -> None:
        self._handler = handler

    def _forget(self, conn: InMemoryConnection) -> None:
        self._inbound.discard(conn)
        for ep, c in list(self._out.items()):
            if c is conn:
                del self._out[ep]

    async def listen(self, host: str, port: int) -> int:
        """Take ``host:port`` on the network (port 0: a free one); the port."""
        port = self.network._bind(host, port, self)
        self._listening = True
        return port

    async def listen_local(self, endpoint: str) -> None:
        """No same-host sockets here: every peer connects by ``host:port``."""

    def _accept(self, peer: str) -> InMemoryConnection:
        conn = InMemoryConnection(self, server_side=True, peer=peer)
        self._inbound.add(conn)
        return conn

    def connection_nowait(self, endpoint: str) -> InMemoryConnection | None:
        """The open pooled connection to ``host:port``, or None (then ``await connect()``)."""
        conn = self._out.get(endpoint)
        return conn if conn is not None and not conn.closed else None

    async def connect(self, endpoint: str) -> InMemoryConnection:
        """The pooled connection to ``host:port``, opened (and authenticated) if needed."""
        if self.closed:
            raise errors.SiloClosedError("transport")
        conn = self._out.get(endpoint)
        if conn is not None and not conn.closed:
            return conn
        pending = self._connecting.get(endpoint)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[InMemoryConnection] = asyncio.get_running_loop().create_future()
        self._connecting[endpoint] = fut
        try:
            conn = await self._open(endpoint)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()
            raise
        finally:
            self._connecting.pop(endpoint, None)
        fut.set_result(conn)
        self._out[endpoint] = conn
        return conn

    async def _open(self, endpoint: str) -> InMemoryConnection:
        try:
            listener, me = self.network._dial(endpoint)
        except ConnectionRefusedError as exc:
            raise errors.SiloUnavailableError(endpoint, f"cannot connect ({exc})") from exc
        conn = InMemoryConnection(self, server_side=False, peer=endpoint)
        accepted = listener._accept(me)
        conn._remote, accepted._remote = accepted, conn
        conn._connection_made()
        asyncio.get_running_loop().call_soon(accepted._connection_made)
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), self.settings.connect_timeout_s)
        except TimeoutError as exc:
            conn.abort()
            raise errors.SiloUnavailableError(endpoint, "cannot connect (timed out)") from exc
        return conn

    def drop(self, endpoint: str) -> None:
        conn = self._out.pop(endpoint, None)
        if conn is not None:
            conn.abort()

    def _connections(self) -> list[InMemoryConnection]:
        return [*self._out.values(), *self._inbound]

    async def close(self) -> None:
        """Stop listening and close every connection; returns once each end has seen it go."""
        conns = self._connections()
        self.abort_all()
        if conns:
            await asyncio.gather(*(c.lost for c in conns))

    def abort_all(self) -> None:
        """Drop every connection at once and stop listening (a silo declared dead, or killed)."""
        self.closed = True
        if self._listening:
            self.network._unbind(self)
            self._listening = False
        for conn in self._connections():
            conn.abort()
        self._out.clear()

    def statistics(self) -> TransportStatistics:
        conns = self._connections()
        n = self._n
        return TransportStatistics(
            connections=len(conns),
            frames_in=n.frames_in,
            frames_out=n.frames_out,
            bytes_in=n.bytes_in,
            bytes_out=n.bytes_out,
            bad_frames=n.bad_frames,
            refused=n.refused,
            overloaded=n.overloaded,
            pending_calls=sum(c.pending for c in conns),
        )


if TYPE_CHECKING:

    def _connector(t: InMemoryTransport) -> Connector:
        return t  # mypy holds the twin to the protocol (and its connection to Link)
