"""TCP messaging between silos and clients: listeners, pooled connections, statistics.

A :class:`Transport` listens (on a silo) on TCP and, for peers on the same
host, on a Unix socket whose path follows from the advertised ``host:port``
(:mod:`silo.messaging.local_socket`); it keeps one outgoing
:class:`~silo.messaging.connection.Connection` per endpoint. Connecting tries
that Unix socket first when its file exists (a stale one, whose silo is
gone, falls through), TCP otherwise, and waits once, within
``connect_timeout_s``, for the handshake (:mod:`silo.messaging.handshake`);
concurrent connects to one endpoint share one attempt.

The pieces: :mod:`~silo.messaging.frame` (the wire layout),
:mod:`~silo.messaging.receive` (bytes to frames, buffers received in
place), :mod:`~silo.messaging.connection` (one connection: what frames mean,
write batching, request futures, deadlines), :mod:`~silo.messaging.handshake`,
:mod:`~silo.messaging.wire_errors` (exceptions as ERROR bodies).

What callers need of a transport is :class:`Connector` (the router, the
reminder service and the failure detector's probe): a connection to an
endpoint, as a :class:`Link` that sends requests and pings. ``Transport`` is
the one over sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from silo import errors
from silo.codec import Codec
from silo.messaging import local_socket, tls
from silo.messaging.connection import Connection, RequestHandler
from silo.messaging.receive import Counters
from silo.settings import TransportSettings

log = logging.getLogger("redgrain.transport")


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    connections: int
    """Open connections (both directions)."""
    frames_in: int
    """Frames received since start."""
    frames_out: int
    """Frames sent since start."""
    bytes_in: int
    """Bytes received since start."""
    bytes_out: int
    """Bytes sent since start."""
    bad_frames: int
    """Frames refused as malformed or oversized."""
    refused: int
    """Connections refused: a failed TLS handshake, or a wrong or missing cluster secret."""
    overloaded: int
    """Requests refused because their connection already had max_in_flight being served."""
    pending_calls: int
    """Requests sent and not yet answered."""


class Link(Protocol):
    """What a caller needs of one connection: requests (and pings) answered through futures,
    and a slot to wait for when ``max_in_flight`` requests are outstanding."""

    closed: bool

    def request(
        self, header: list[Any], body: Any, timeout_s: float | None, label: str | tuple[object, str] = ""
    ) -> asyncio.Future[Any]: ...

    def ping(self, timeout_s: float, sender: str | None = None) -> asyncio.Future[Any]: ...

    def has_slot(self) -> bool: ...

    async def wait_slot(self, deadline: float) -> None: ...


class Connector(Protocol):
    """What callers need of a transport: a connection to ``host:port``, pooled."""

    def connection_nowait(self, endpoint: str) -> Link | None: ...

    async def connect(self, endpoint: str) -> Link: ...

    def drop(self, endpoint: str) -> None: ...


class Transport:
    """A listener (for silos) plus a pool of outgoing connections, one per endpoint."""

    def __init__(self, settings: TransportSettings, codec: Codec, handler: RequestHandler | None = None) -> None:
        self.settings = settings
        self.codec = codec
        self._handler = handler
        self.client_id: str | None = None
        """A client's id, sent on every connection it opens (a CLIENT frame; :meth:`identify_as`)."""
        self._clients: dict[str, Connection] = {}
        """Connections clients opened to us, by the id they named (where their observers are reached)."""
        self._n = Counters()
        self._server: asyncio.base_events.Server | None = None
        self._local_server: asyncio.base_events.Server | None = None
        self._local_path: Path | None = None
        self._out: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Task[Connection]] = {}
        """Connections being opened, each in a task of the transport's own (``close`` ends them)."""
        self._inbound: set[Connection] = set()
        self.closed = False
        self._on_probe: Callable[[str], None] | None = None
        # Built once (a bad file fails the start with ConfigError); None: plain sockets.
        self._server_ssl = tls.server_context(settings, self._tls_refused)
        self._client_ssl = tls.client_context(settings)
        self._tls_timeout = settings.connect_timeout_s if settings.tls else None

    def _tls_refused(self, exc: ssl.SSLError) -> None:
        self._n.refused += 1
        log.warning("refused a connection: TLS handshake failed (%s)", getattr(exc, "reason", None) or exc)

    def set_handler(self, handler: RequestHandler) -> None:
        self._handler = handler

    def on_probe(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(monitor)`` for every PING that names the silo that sent it (a failure detector's
        probe): how a silo knows its monitors still reach it (``Liveness.probed``)."""
        self._on_probe = fn

    def _probed(self, sender: str) -> None:
        if self._on_probe is not None:
            self._on_probe(sender)

    def _connection(self, server_side: bool) -> Connection:
        return Connection(
            codec=self.codec,
            settings=self.settings,
            counters=self._n,
            handler=self._handler,
            server_side=server_side,
            on_close=self._forget,
            # Counted as inbound once made: under TLS a peer whose handshake fails never is.
            on_open=self._inbound.add if server_side else None,
            on_client=self._client_named if server_side else None,
            on_probe=self._probed,
        )

    def _client_named(self, conn: Connection) -> None:
        assert conn.client_id is not None
        old = self._clients.get(conn.client_id)
        self._clients[conn.client_id] = conn
        if old is not None and old is not conn:
            log.info("client %s opened a second connection; its observers are called on the newer", conn.client_id)

    def client_connection(self, client_id: str) -> Connection | None:
        """The open connection client ``client_id`` made to us, or None (closed, or never made)."""
        conn = self._clients.get(client_id)
        return conn if conn is not None and not conn.closed else None

    def _forget(self, conn: Connection) -> None:
        self._inbound.discard(conn)
        if conn.client_id is not None and self._clients.get(conn.client_id) is conn:
            del self._clients[conn.client_id]
        for ep, c in list(self._out.items()):
            if c is conn:
                del self._out[ep]

    def _accepted(self) -> Connection:
        return self._connection(server_side=True)

    async def listen(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._accepted, host, port, reuse_address=True, backlog=1024,
            ssl=self._server_ssl, ssl_handshake_timeout=self._tls_timeout,
        )  # fmt: skip
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    async def listen_local(self, endpoint: str) -> Path | None:
        """Also accept same-host peers on a Unix socket found by ``endpoint`` (the advertised
        ``host:port``); None when turned off or not possible here (TCP serves them then)."""
        path = local_socket.socket_path(endpoint) if self.settings.local_sockets else None
        if path is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            local_socket.prepare(path)
            local_socket.sweep(path.parent)
            self._local_server = await loop.create_unix_server(
                self._accepted, str(path), backlog=1024, ssl=self._server_ssl, ssl_handshake_timeout=self._tls_timeout
            )
        except OSError as exc:
            log.info("no same-host socket at %s (%s); peers use TCP", path, exc)
            return None
        self._local_path = path
        return path

    def identify_as(self, client_id: str) -> None:
        """Name this (client's) end, from now on, on every connection it has opened and opens.

        A client does so when it makes its first observer, not before: a silo that predates
        the CLIENT frame would drop the connection, so a client that makes none keeps working
        with it (a rolling upgrade). Sent before any later request on each connection, so a
        silo knows the client before a reference to one of its observers can reach it.
        """
        if self.client_id == client_id:
            return
        self.client_id = client_id
        for conn in self._out.values():
            if not conn.closed:
                conn.identify(client_id)

    def open_endpoints(self) -> list[str]:
        """Endpoints (``host:port``) of the open connections we made."""
        return [ep for ep, c in self._out.items() if not c.closed]

    def connection_nowait(self, endpoint: str) -> Connection | None:
        """The open pooled connection to ``host:port``, or None (then ``await connect()``)."""
        conn = self._out.get(endpoint)
        return conn if conn is not None and not conn.closed else None

    async def connect(self, endpoint: str) -> Connection:
        """The pooled connection to ``host:port``, opened (and authenticated) if needed."""
        if self.closed:
            raise errors.SiloClosedError("transport")
        conn = self._out.get(endpoint)
        if conn is not None and not conn.closed:
            return conn
        opening = self._connecting.get(endpoint)
        if opening is None:
            # Opened in a task of the transport's own, which close() ends: one run in a caller's
            # task outlived a silo stopped meanwhile (a failure detector's shielded probe) and
            # pooled a connection nobody would close (the simulator's seed 89 of `silo`). A
            # caller that gives up waiting (its deadline) leaves it to finish for the pool.
            opening = asyncio.get_running_loop().create_task(self._open_pooled(endpoint), name=f"connect {endpoint}")
            self._connecting[endpoint] = opening
        return await asyncio.shield(opening)

    async def _open_pooled(self, endpoint: str) -> Connection:
        try:
            conn = await self._open(endpoint)
        except asyncio.CancelledError:
            if self.closed:
                raise errors.SiloClosedError("transport") from None
            raise
        finally:
            self._connecting.pop(endpoint, None)
        if self.closed:  # closed as the handshake finished
            conn.abort()
            raise errors.SiloClosedError("transport")
        if self.client_id is not None:
            conn.identify(self.client_id)  # before any request: the silo knows us when one arrives
        self._out[endpoint] = conn
        return conn

    def _stop_connecting(self) -> list[asyncio.Task[Connection]]:
        opening = list(self._connecting.values())
        for task in opening:
            task.cancel()
        return opening

    async def _open(self, endpoint: str) -> Connection:
        host, _, port = endpoint.rpartition(":")
        loop = asyncio.get_running_loop()
        timeout = self.settings.connect_timeout_s

        def factory() -> Connection:
            return self._connection(server_side=False)

        path = local_socket.socket_path(endpoint) if self.settings.local_sockets else None
        secure: dict[str, Any] = {}
        if self._client_ssl is not None:
            # The name is what tls_check_hostname compares (for an IP, no SNI is sent).
            secure = {"ssl": self._client_ssl, "server_hostname": host.strip("[]"), "ssl_handshake_timeout": timeout}
        conn = None
        try:
            if path is not None and path.exists():
                try:
                    conn = (await asyncio.wait_for(loop.create_unix_connection(factory, str(path), **secure), timeout))[1]
                except (OSError, TimeoutError):
                    pass  # stale (its silo is gone) or not ours to use: TCP decides
            if conn is None:
                conn = (await asyncio.wait_for(loop.create_connection(factory, host, int(port), **secure), timeout))[1]
            await asyncio.wait_for(conn.ready, timeout)
        except asyncio.CancelledError:
            if conn is not None:
                conn.abort()  # the transport closed mid-handshake
            raise
        except ssl.SSLError as exc:
            raise tls.refusal(endpoint, exc) from exc
        except TimeoutError as exc:
            if conn is not None and not secure:
                # A silo that requires TLS waits for a ClientHello and says nothing to us.
                detail = f"no handshake from the silo within {timeout:g}s (does it require TLS?)"
            else:
                detail = "timed out"
            if conn is not None:
                conn.abort()
            raise errors.SiloUnavailableError(endpoint, f"cannot connect ({detail})") from exc
        except OSError as exc:
            raise errors.SiloUnavailableError(endpoint, f"cannot connect ({exc})") from exc
        return conn

    def drop(self, endpoint: str) -> None:
        conn = self._out.pop(endpoint, None)
        if conn is not None:
            conn.abort()

    def _close_local(self) -> None:
        if self._local_server is not None:
            self._local_server.close()
        if self._local_path is not None:
            with contextlib.suppress(OSError):
                self._local_path.unlink()
            self._local_path = None

    async def close(self) -> None:
        self.closed = True
        opening = self._stop_connecting()
        self._close_local()
        if self._server is not None:
            self._server.close()
        for conn in [*self._out.values(), *self._inbound]:
            conn.close()
        self._out.clear()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except TimeoutError:
                pass
        for conn in list(self._inbound):
            conn.abort()
        await asyncio.gather(*opening, return_exceptions=True)

    def abort_all(self) -> None:
        """Drop every connection at once (a silo declared dead must stop serving)."""
        self.closed = True
        self._stop_connecting()
        self._close_local()
        if self._server is not None:
            self._server.close()
        for conn in [*self._out.values(), *self._inbound]:
            conn.abort()
        self._out.clear()

    def statistics(self) -> TransportStatistics:
        conns = [*self._out.values(), *self._inbound]
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

    def _connector(t: Transport) -> Connector:
        return t  # mypy: Transport is a Connector (and Connection a Link)
