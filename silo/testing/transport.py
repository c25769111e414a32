"""The transport in memory: silos of one test talk over an :class:`InMemoryNetwork`, no sockets.

:class:`InMemoryTransport` is the socket :class:`~silo.messaging.transport.Transport`
with only the socket replaced: ``listen`` takes an endpoint on the network
instead of a port, ``connect`` dials the transport listening there, and
each connection is the real :class:`~silo.messaging.connection.Connection`
over a pair of in-memory byte pipes (:class:`_Pipe`, an ``asyncio.Transport``).
So everything a connection does is the code a cluster runs: frames laid
out and parsed by :mod:`~silo.messaging.frame` and
:mod:`~silo.messaging.receive`, the handshake and its cluster secret,
request ids, one deadline timer on the loop's clock (a
:class:`~silo.testing.clock.VirtualClock` drives it: an expired request
fails with GrainTimeoutError and a CANCEL goes to the peer), ``max_in_flight``
on both sides, errors as ERROR bodies, statistics. The network is a
registry of listening endpoints that a test owns: two tests, or two worlds
in one test, never meet.

What the pipes model: bytes arrive in order, on a later loop iteration
(``call_soon``), never inside the writer's call. Connecting where nobody
listens raises SiloUnavailableError caused by ConnectionRefusedError (what
the failure detector's probe reads as "the process is gone"). Closing or
aborting either end makes both ends' connections lost (after the bytes
already on their way), so requests pending on them fail with
SiloUnavailableError; bytes written to an end that is going away are lost.
:class:`RawPeer` puts any bytes on the wire and records the frames that
come back, for tests of frames no well-behaved peer sends.

What they do not model: partial writes and back-pressure (each write
arrives whole; ``pause_writing`` never happens), TLS, same-host Unix
sockets (every peer "uses TCP"), latency, and partitions in which packets
vanish while both ends live. ``close`` and ``abort`` differ only in name:
a pipe has no send buffer to flush or to drop.

Why values go through the codec (they do, since the real connection
encodes every body and the receiving one decodes it): silos in one process
must not share objects. A grain that returned its own list, and a caller
that then appended to it, would be a bug no real cluster has; a value the
wire cannot carry fails here with the same CodecError as there; and a test
sees exactly what a remote peer would (tuples, registered models, tensors
rebuilt from their bytes into buffers of their own). A pipe copies what is
written at once, as the kernel does.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import itertools
import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from silo import errors
from silo.codec import Codec
from silo.messaging.connection import Connection, RequestHandler
from silo.messaging.frame import BUFLEN, PREFIX, Frame, packb
from silo.messaging.receive import Counters, FrameReceiver
from silo.messaging.transport import Transport
from silo.settings import TransportSettings

log = logging.getLogger("redgrain.transport")


def pack_frame(header: list[Any], meta: bytes = b"", buffers: Sequence[bytes] = ()) -> bytes:
    """A frame's bytes as :mod:`silo.messaging.frame` lays them out (for :class:`RawPeer`)."""
    h = packb(header)
    lens = b"".join(BUFLEN.pack(len(b)) for b in buffers)
    return PREFIX.pack(len(h), len(meta), len(buffers)) + lens + h + meta + b"".join(buffers)


class Links(Protocol):
    """What the network between two ends is like now (a simulation's faults); see :class:`InMemoryNetwork`.

    Each end of a connection carries the ``contextvars`` context of the
    transport that owns it (:attr:`_Pipe.context`), which is how a simulation
    tells which silo sits at each end.
    """

    def delay(self, sender: _Pipe, receiver: _Pipe) -> float | None:
        """Seconds until bytes written now at ``sender`` reach ``receiver``; None: the link is cut
        (the bytes wait, in order, until :meth:`InMemoryNetwork.release` is called)."""

    def connectable(self, connector: contextvars.Context, endpoint: str) -> bool:
        """Whether a connection attempt from ``connector`` reaches ``endpoint`` now (False: the
        handshake is lost, as on a cut link: the attempt times out)."""


class CutTo:
    """:class:`Links` on which every handshake to ``endpoint`` is lost (a partition, as seen by
    a connect: it times out); bytes on connections already open flow at once."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def delay(self, sender: _Pipe, receiver: _Pipe) -> float | None:
        return 0.0

    def connectable(self, connector: contextvars.Context, endpoint: str) -> bool:
        return endpoint != self.endpoint


class InMemoryNetwork:
    """Listening endpoints of one test's world: ``host:port`` -> the transport listening there.

    ``listen(host, 0)`` takes the next free port from ``first_port`` on, as the
    kernel picks one; :meth:`free_port` never hands out the same port twice.
    """

    def __init__(self, *, first_port: int = 20_000, links: Links | None = None) -> None:
        self.links = links
        """Delays and cuts between ends (None: every byte arrives on the next loop turn)."""
        self._held: list[_Pipe] = []
        self._listeners: dict[str, InMemoryTransport] = {}
        self._ports = itertools.count(first_port)
        self._ephemeral = itertools.count(40_000)
        self._ends: weakref.WeakSet[_Pipe] = weakref.WeakSet()
        self._unaccepted: dict[str, list[_Pipe]] = {}
        """Endpoint -> listener-side ends of handshakes lost on a cut link (never accepted)."""

    def free_port(self, host: str = "127.0.0.1") -> int:
        """A port nobody listens on at ``host`` (listen on it to take it)."""
        while True:
            port = next(self._ports)
            if f"{host}:{port}" not in self._listeners:
                return port

    def listening(self) -> list[str]:
        """Endpoints someone listens on now."""
        return sorted(self._listeners)

    def open_ends(self) -> list[tuple[contextvars.Context, str, str]]:
        """(owner's context, local, remote) of every connection end not yet closed: after a process
        stopped, none of its own may be left (a socket it never closed)."""
        return [(end.context, end._local, end._remote) for end in list(self._ends) if not end.is_closing()]

    def open_raw(self, endpoint: str) -> RawPeer:
        """A bare connection to ``endpoint`` (the acceptor's HELLO will be its first frame)."""
        peer = RawPeer()
        self._link(endpoint, peer)
        return peer

    # --- for InMemoryTransport -------------------------------------------------------
    def _bind(self, host: str, port: int, transport: InMemoryTransport) -> int:
        port = port or self.free_port(host)
        endpoint = f"{host}:{port}"
        if endpoint in self._listeners:
            raise OSError(errno.EADDRINUSE, f"[Errno {errno.EADDRINUSE}] address already in use: {endpoint}")
        self._listeners[endpoint] = transport
        return port

    def _unbind(self, endpoint: str) -> None:
        self._listeners.pop(endpoint, None)
        # A handshake still lost on a cut link has no socket at a port nobody listens on any more
        # (the acceptor never learnt of it): the end goes, the connector's own timeout ends its side.
        for end in self._unaccepted.pop(endpoint, []):
            end._closing = end._lost = True

    def is_listening(self, endpoint: str) -> bool:
        return endpoint in self._listeners

    def release(self) -> None:
        """Send on every end whose bytes waited for a cut link that :attr:`links` now lets through."""
        held, self._held = self._held, []
        for pipe in held:
            pipe._release()

    def _link(
        self, endpoint: str, protocol: asyncio.BufferedProtocol, context: contextvars.Context | None = None
    ) -> _Pipe:
        """Connect ``protocol`` to whoever listens at ``endpoint``; its end of the pipe pair.

        ``context``: the connecting transport's (default: the caller's)."""
        listener = self._listeners.get(endpoint)
        if listener is None:
            host, _, port = endpoint.rpartition(":")
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, f"[Errno {errno.ECONNREFUSED}] Connect call failed ({host!r}, {port})"
            )
        loop = asyncio.get_running_loop()
        context = context or contextvars.copy_context()
        me = f"127.0.0.1:{next(self._ephemeral)}"
        accepted = listener._accepted()
        ours = _Pipe(loop, protocol, me, endpoint, network=self, context=context)
        theirs = _Pipe(loop, accepted, endpoint, me, network=self, context=listener.context.copy())
        ours.peer, theirs.peer = theirs, ours
        self._ends.update((ours, theirs))
        protocol.connection_made(ours)
        if self.links is not None and not self.links.connectable(context, endpoint):
            # The handshake is lost on a cut link: nothing moves until it heals, and the
            # connector's own timeout gives up first (as a SYN that is never answered).
            ours._cut = theirs._cut = True
            pending = [e for e in self._unaccepted.get(endpoint, []) if not e._closing]
            self._unaccepted[endpoint] = [*pending, theirs]
            return ours
        loop.call_soon(accepted.connection_made, theirs, context=listener.context.copy())  # the acceptor learns of it a turn later
        return ours


class _Pipe(asyncio.Transport):
    """One end of an in-memory byte stream: what a connected socket's transport is to its protocol."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol: asyncio.BufferedProtocol,
        local: str,
        remote: str,
        *,
        network: InMemoryNetwork | None = None,
        context: contextvars.Context | None = None,
    ) -> None:
        super().__init__()
        self._loop = loop
        self._protocol = protocol
        self._local = local
        self._remote = remote
        self._network = network
        self.context = context or contextvars.copy_context()
        """The owning transport's context: callbacks into this end's protocol run in it."""
        self.peer: _Pipe | None = None
        self._closing = False
        self._lost = False
        self._cut = False
        """A connection whose handshake never got through: nothing ever arrives on it."""
        self._backlog: list[bytes] = []
        """Bytes written while the link was cut, in order (sent by _release)."""
        self._last_at = float("-inf")
        """When the last bytes sent on a delay arrive: later bytes never overtake them."""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name in ("peername", "sockname"):
            host, _, port = (self._remote if name == "peername" else self._local).rpartition(":")
            return (host, int(port))
        return default

    def is_closing(self) -> bool:
        return self._closing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        peer = self.peer
        if self._closing or peer is None or peer._closing:
            return  # written into a socket that is going away: nobody reads it
        # Copied now, as the kernel copies a send: the writer may reuse its buffer at once.
        data = bytes(data)
        links = self._network.links if self._network is not None else None
        if links is None:
            self._loop.call_soon(peer._feed, data, context=peer.context.copy())
            return
        if self._cut:
            return
        if self._backlog:
            self._backlog.append(data)
            return
        self._send(peer, links, data)

    def _send(self, peer: _Pipe, links: Links, data: bytes) -> None:
        delay = links.delay(self, peer)
        if delay is None:
            self._backlog.append(data)
            assert self._network is not None
            self._network._held.append(self)
            return
        now = self._loop.time()
        if delay <= 0 and self._last_at < now:
            self._loop.call_soon(peer._feed, data, context=peer.context.copy())
            return
        # Timers of one instant may leave the heap in any order: each later send a hair later.
        self._last_at = at = max(now + delay, self._last_at + 1e-6)
        self._loop.call_at(at, peer._feed, data, context=peer.context.copy())

    def _release(self) -> None:
        backlog, self._backlog = self._backlog, []
        peer = self.peer
        links = self._network.links if self._network is not None else None
        if peer is None or links is None or self._closing or peer._closing:
            return
        for i, data in enumerate(backlog):
            self._send(peer, links, data)
            if self._backlog:  # cut again on the way: keep the rest behind it, in order
                self._backlog.extend(backlog[i + 1 :])
                return

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        self._hang_up()

    def abort(self) -> None:
        self._hang_up()

    def _hang_up(self) -> None:
        # Both ends are lost on a later turn, after the bytes already on their way.
        if self._closing:
            return
        self._closing = True
        self._loop.call_soon(self._connection_lost, context=self.context.copy())
        if self.peer is not None:
            self._loop.call_soon(self.peer._connection_lost, context=self.peer.context.copy())

    def _connection_lost(self) -> None:
        if self._lost:
            return
        self._closing = self._lost = True
        self._protocol.connection_lost(None)

    def _feed(self, data: bytes) -> None:
        """Hand ``data`` to the protocol the way a selector loop does: into the buffers it offers."""
        view, pos = memoryview(data), 0
        while pos < len(view) and not self._closing:
            buf = memoryview(self._protocol.get_buffer(len(view) - pos))
            n = min(buf.nbytes, len(view) - pos)
            buf[:n] = view[pos : pos + n]
            pos += n
            try:
                self._protocol.buffer_updated(n)
            except Exception:
                # What asyncio does when a protocol callback raises: log it, drop the connection.
                log.exception("closing connection to %s: its protocol failed on received data", self._remote)
                self.abort()


class InMemoryTransport(Transport):
    """A :class:`~silo.messaging.transport.Transport` on an :class:`InMemoryNetwork` instead of sockets."""

    def __init__(
        self,
        settings: TransportSettings,
        codec: Codec,
        handler: RequestHandler | None = None,
        *,
        network: InMemoryNetwork,
    ) -> None:
        super().__init__(settings, codec, handler)
        self.network = network
        self.context = contextvars.copy_context()
        """The context this transport was made in (a simulated silo's): its pipes' callbacks run in it."""
        self._endpoint: str | None = None
        self._wires: weakref.WeakKeyDictionary[Connection, _Pipe] = weakref.WeakKeyDictionary()

    async def listen(self, host: str, port: int) -> int:
        """Take ``host:port`` on the network (port 0: a free one); the port."""
        port = self.network._bind(host, port, self)
        self._endpoint = f"{host}:{port}"
        return port

    async def listen_local(self, endpoint: str) -> None:
        """No same-host sockets on a network: every peer connects by ``host:port``."""

    async def _open(self, endpoint: str) -> Connection:
        conn = self._connection(server_side=False)
        try:
            self._wires[conn] = self.network._link(endpoint, conn, self.context)
            await asyncio.wait_for(conn.ready, self.settings.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            conn.abort()
            raise errors.SiloUnavailableError(endpoint, f"cannot connect ({exc or 'timed out'})") from exc
        except asyncio.CancelledError:
            conn.abort()  # the transport closed mid-handshake
            raise
        return conn

    def write_raw(self, conn: Connection, data: bytes) -> None:
        """Put ``data`` on ``conn``'s wire as it is (a connection this transport opened)."""
        self._wires[conn].write(data)

    def _stop_listening(self) -> None:
        if self._endpoint is not None:
            self.network._unbind(self._endpoint)
            self._endpoint = None

    async def close(self) -> None:
        """Stop listening and close every connection; returns once both ends have seen it."""
        self._stop_listening()
        await super().close()
        await asyncio.sleep(0)  # the pipes' connection_lost callbacks, queued by close, run first

    def abort_all(self) -> None:
        self._stop_listening()
        super().abort_all()


class RawPeer(FrameReceiver):
    """A bare end of a connection: writes any bytes, keeps every frame that comes back.

    No handshake is answered (against a listener without a cluster secret
    none is needed); ``frames`` starts with the acceptor's HELLO.
    """

    def __init__(self, settings: TransportSettings | None = None) -> None:
        super().__init__(settings or TransportSettings(), Counters(), server_side=False)
        self._authenticated = True  # parse every frame as a connected peer would
        self.frames: list[Frame] = []
        self.closed = False
        self._pipe: _Pipe | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, _Pipe)
        self._pipe = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def _on_frame(self, frame: Frame) -> None:
        self.frames.append(frame)

    def write(self, data: bytes) -> None:
        assert self._pipe is not None
        self._pipe.write(data)

    def write_frame(self, header: list[Any], meta: bytes = b"", buffers: Sequence[bytes] = ()) -> None:
        self.write(pack_frame(header, meta, buffers))

    def abort(self) -> None:
        if self._pipe is not None:
            self._pipe.abort()
