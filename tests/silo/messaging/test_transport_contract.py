"""One contract, two transports: the socket Transport on loopback and the in-memory twin.

Each case runs a small request/response exchange against a bare handler (no
silo, no Redis) on both backends and asserts the same results and the same
error classes, so a unit test on the twin means what it would over TCP.
Deadlines here are real (tens of milliseconds): the socket transport's timers
follow the loop's real clock. The twin's own tests drive them with a
VirtualClock.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from pydantic import SecretStr

from silo import errors
from silo.codec import Codec
from silo.messaging.frame import CANCEL, REQUEST, Frame
from silo.messaging.transport import Transport
from silo.settings import TransportSettings
from silo.testing.transport import CutTo, InMemoryNetwork, InMemoryTransport


@dataclass
class EchoServer:
    """The handler: ``echo`` answers its body, ``gone``/``boom`` answer errors, ``hold`` never
    answers (the test keeps the connection), and every CANCEL is recorded."""

    ids: list[int] = field(default_factory=list)
    held: list[tuple[Any, int]] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    cancel_seen: asyncio.Event = field(default_factory=asyncio.Event)
    held_seen: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, conn: Any, frame: Frame) -> None:
        kind, req_id = frame.header[0], frame.header[1]
        if kind == CANCEL:
            self.cancelled.append(req_id)
            self.cancel_seen.set()
            return
        self.ids.append(req_id)
        method = frame.header[4]  # after kind, id, type, key
        body = conn.codec.decode(frame.meta, frame.buffers)
        if method == "echo":
            conn.send_response(req_id, body)
        elif method == "gone":
            conn.send_error(req_id, errors.GrainDeactivatedError("Echo/x", "deactivated meanwhile"))
        elif method == "boom":
            conn.send_error(req_id, ValueError("boom"))
        elif method == "hold":
            self.held.append((conn, req_id))
            self.held_seen.set()


class Backend:
    """Builds transports of one kind; closes them all at the end."""

    name = ""

    def __init__(self) -> None:
        self.made: list[Any] = []

    def _transport(self, settings: TransportSettings, handler: Any) -> Any:
        raise NotImplementedError

    def transport(self, handler: Any = None, secret: str | None = None) -> Any:
        settings = TransportSettings(
            local_sockets=False, cluster_secret=SecretStr(secret) if secret else None, connect_timeout_s=2.0
        )
        t = self._transport(settings, handler)
        self.made.append(t)
        return t

    async def server(self, handler: Any, secret: str | None = None) -> tuple[Any, str]:
        t = self.transport(handler, secret)
        port = await t.listen("127.0.0.1", 0)
        return t, f"127.0.0.1:{port}"

    def unused_endpoint(self) -> str:
        raise NotImplementedError

    async def silent_endpoint(self) -> str:
        """An endpoint whose connections never finish the handshake (no HELLO comes back)."""
        raise NotImplementedError

    async def close(self) -> None:
        for t in self.made:
            await t.close()


class Tcp(Backend):
    name = "tcp"

    def _transport(self, settings: TransportSettings, handler: Any) -> Any:
        return Transport(settings, Codec(), handler)

    def unused_endpoint(self) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"127.0.0.1:{port}"

    async def silent_endpoint(self) -> str:
        # The kernel completes the TCP handshake into the backlog; nobody ever accepts.
        self.silent = socket.socket()
        self.silent.bind(("127.0.0.1", 0))
        self.silent.listen(8)
        return f"127.0.0.1:{self.silent.getsockname()[1]}"

    async def close(self) -> None:
        await super().close()
        if hasattr(self, "silent"):
            self.silent.close()


class Twin(Backend):
    name = "twin"

    def __init__(self) -> None:
        super().__init__()
        self.network = InMemoryNetwork()

    def _transport(self, settings: TransportSettings, handler: Any) -> Any:
        return InMemoryTransport(settings, Codec(), handler, network=self.network)

    def unused_endpoint(self) -> str:
        return f"127.0.0.1:{self.network.free_port()}"

    async def silent_endpoint(self) -> str:
        _, endpoint = await self.server(EchoServer())
        self.network.links = CutTo(endpoint)  # the handshake is lost, as on a cut link
        return endpoint


@pytest.fixture(params=[Tcp, Twin], ids=["tcp", "twin"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    b: Backend = request.param()
    yield b
    await b.close()


def call(method: str) -> list[Any]:
    return [REQUEST, 0, "Echo", "x", method, 5000, [], 0]


async def test_values_come_back_as_a_remote_peer_decodes_them(backend: Backend) -> None:
    server = EchoServer()
    _, endpoint = await backend.server(server)
    conn = await backend.transport().connect(endpoint)
    big = np.arange(100_000, dtype=np.float32)  # 400 KB: travels as an out-of-band buffer
    sent = ({"a": [1, 2], "t": (3, "x")}, b"\x00" * 10, big)
    got = await conn.request(call("echo"), sent, 5.0)
    assert isinstance(got, tuple) and got[0] == {"a": [1, 2], "t": (3, "x")} and got[1] == b"\x00" * 10
    assert np.array_equal(got[2], big) and not np.shares_memory(got[2], big)
    assert await conn.request(call("echo"), [1, 2], 5.0) == [1, 2]
    assert server.ids == [1, 2]  # request ids count up per connection


async def test_errors_keep_their_class_or_become_remote_grain_errors(backend: Backend) -> None:
    _, endpoint = await backend.server(EchoServer())
    conn = await backend.transport().connect(endpoint)
    with pytest.raises(errors.GrainDeactivatedError):
        await conn.request(call("gone"), [], 5.0)
    with pytest.raises(errors.RemoteGrainError) as info:
        await conn.request(call("boom"), [], 5.0)
    assert info.value.type_name == "ValueError" and info.value.message == "boom"
    with pytest.raises(errors.CodecError):
        conn.request(call("echo"), object(), 5.0)  # not encodable: refused before sending
    assert await conn.ping(5.0) is None


async def test_an_expired_request_times_out_and_the_peer_is_told_to_cancel(backend: Backend) -> None:
    server = EchoServer()
    _, endpoint = await backend.server(server)
    client = backend.transport()
    conn = await client.connect(endpoint)
    with pytest.raises(errors.GrainTimeoutError) as info:
        await conn.request(call("hold"), [], 0.05, ("Echo/x", "hold"))
    assert (info.value.target, info.value.method) == ("Echo/x", "hold")
    await asyncio.wait_for(server.cancel_seen.wait(), 5)
    assert server.cancelled == [server.held[0][1]]
    # A late answer to the expired request is dropped; the connection goes on.
    held_conn, req_id = server.held[0]
    held_conn.send_response(req_id, "late")
    assert await conn.request(call("echo"), ["after"], 5.0) == ["after"]
    assert client.statistics().pending_calls == 0


async def test_connecting_where_nobody_listens_is_refused(backend: Backend) -> None:
    with pytest.raises(errors.SiloUnavailableError) as info:
        await backend.transport().connect(backend.unused_endpoint())
    assert isinstance(info.value.__cause__, ConnectionRefusedError)  # the probe's "process is gone"


async def test_a_peer_that_aborts_fails_requests_in_flight(backend: Backend) -> None:
    server = EchoServer()
    listener, endpoint = await backend.server(server)
    client = backend.transport()
    conn = await client.connect(endpoint)
    pending = conn.request(call("hold"), [], 5.0)
    await asyncio.wait_for(server.held_seen.wait(), 5)
    server.held[0][0].abort()
    with pytest.raises(errors.SiloUnavailableError):
        await pending
    assert conn.closed and client.connection_nowait(endpoint) is None
    with pytest.raises(errors.SiloUnavailableError):
        conn.request(call("echo"), [], 5.0)
    again = await client.connect(endpoint)  # a fresh connection; the listener still serves
    assert again is not conn and await again.request(call("echo"), [1], 5.0) == [1]
    listener.abort_all()  # the whole silo goes: in flight fails, new connects are refused
    pending = again.request(call("hold"), [], 5.0)
    with pytest.raises(errors.SiloUnavailableError):
        await pending
    with pytest.raises(errors.SiloUnavailableError) as info:
        await client.connect(endpoint)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


async def test_a_closed_transport_connects_nowhere(backend: Backend) -> None:
    _, endpoint = await backend.server(EchoServer())
    client = backend.transport()
    await client.connect(endpoint)
    await client.close()
    with pytest.raises(errors.SiloClosedError):
        await client.connect(endpoint)


async def test_a_call_in_flight_when_we_close_our_transport_fails_as_ours_not_the_peers(backend: Backend) -> None:
    # Errors are named for who is at fault: a client closed with a call under way told it
    # "SiloUnavailableError ... connection lost (closed by peer)", and a call made a moment later
    # "SiloClosedError"; a caller that retries a broken peer's calls retried its own close.
    _, endpoint = await backend.server(EchoServer())
    client = backend.transport()
    conn = await client.connect(endpoint)
    pending = asyncio.ensure_future(conn.request(call("hold"), [], 5.0))
    await asyncio.sleep(0)
    await client.close()
    with pytest.raises(errors.SiloClosedError, match="is closed"):
        await pending
    with pytest.raises(errors.SiloClosedError):
        await client.connect(endpoint)
    # An abort stays the peer's kind of loss (a silo declared dead drops its links so; its
    # callers elsewhere may go on): only an orderly close of our own is ours.
    aborting = backend.transport()
    conn = await aborting.connect(endpoint)
    pending = asyncio.ensure_future(conn.request(call("hold"), [], 5.0))
    await asyncio.sleep(0)
    aborting.abort_all()
    with pytest.raises(errors.SiloUnavailableError):
        await pending


async def test_a_transport_closed_while_a_connect_is_pending_leaves_no_task_and_no_connection(backend: Backend) -> None:
    # As the failure detector's probe connects: shielded, and given up on at its timeout. The
    # silo then stops (the simulator's seed 89 of `silo`: the connect outlived the stop).
    endpoint = await backend.silent_endpoint()
    client = backend.transport()
    before = asyncio.all_tasks()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(client.connect(endpoint)), 0.05)
    await client.close()
    for _ in range(3):
        await asyncio.sleep(0)  # the shielded caller hears of the close
    assert [t for t in asyncio.all_tasks() - before if not t.done()] == []
    assert client.statistics().connections == 0
    with pytest.raises(errors.SiloClosedError):
        await client.connect(endpoint)


async def test_the_cluster_secret_is_checked_both_ways(backend: Backend) -> None:
    listener, endpoint = await backend.server(EchoServer(), secret="s3")
    with pytest.raises(errors.AuthenticationError):
        await backend.transport().connect(endpoint)  # no secret: the silo asks for one
    with pytest.raises(errors.SiloUnavailableError):
        await backend.transport(secret="wrong").connect(endpoint)  # refused during the handshake
    assert listener.statistics().refused == 1
    conn = await backend.transport(secret="s3").connect(endpoint)
    assert await conn.request(call("echo"), ["ok"], 5.0) == ["ok"]
    _, open_endpoint = await backend.server(EchoServer())
    with pytest.raises(errors.AuthenticationError):
        await backend.transport(secret="s3").connect(open_endpoint)  # a silo outside our cluster


async def test_statistics_count_frames_and_bytes_on_both_sides(backend: Backend) -> None:
    listener, endpoint = await backend.server(EchoServer())
    client = backend.transport()
    conn = await client.connect(endpoint)
    for i in range(3):
        await conn.request(call("echo"), [i], 5.0)
    c, s = client.statistics(), listener.statistics()
    assert c.connections == 1 and s.connections == 1
    assert c.frames_out == 3 and s.frames_in == 3  # no secret: the HELLO is the only other frame
    assert s.frames_out == 4 and c.frames_in == 4
    assert c.bytes_out == s.bytes_in and s.bytes_out == c.bytes_in
    assert c.pending_calls == 0 and s.bad_frames == 0
