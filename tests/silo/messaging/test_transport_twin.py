"""The transport twin's own rules: virtual-time deadlines, delivery on a later loop turn, no
shared objects, bad frames, the probe's view of it. (What it shares with the socket transport
is held in test_transport_contract.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from grains.ids import SiloAddress
from silo import errors
from silo.cluster.failure_detector import ProbeResult, transport_probe
from silo.codec import Codec
from silo.messaging.frame import CANCEL, HELLO, PREFIX, REQUEST, Frame
from silo.settings import TransportSettings
from silo.testing.clock import VirtualClock
from silo.testing.transport import CutTo, InMemoryNetwork, InMemoryTransport


class Recorder:
    """Keeps every frame; answers ``echo`` with its body, leaves ``hold`` unanswered."""

    def __init__(self) -> None:
        self.frames: list[list[Any]] = []
        self.bodies: list[Any] = []
        self.held: list[tuple[Any, int]] = []

    def __call__(self, conn: Any, frame: Frame) -> None:
        self.frames.append(frame.header)
        if frame.header[0] == CANCEL:
            return
        body = conn.codec.decode(frame.meta, frame.buffers)
        self.bodies.append(body)
        if frame.header[4] == "echo":
            conn.send_response(frame.header[1], body)
        else:
            self.held.append((conn, frame.header[1]))


def call(method: str) -> list[Any]:
    return [REQUEST, 0, "Echo", "x", method, 5000, [], 0]


@pytest.fixture
async def clock() -> AsyncIterator[VirtualClock]:
    with VirtualClock() as c:
        yield c


@pytest.fixture
def network() -> InMemoryNetwork:
    return InMemoryNetwork()


def transport(network: InMemoryNetwork, handler: Any = None, **settings: Any) -> InMemoryTransport:
    return InMemoryTransport(TransportSettings(**settings), Codec(), handler, network=network)


async def serve(network: InMemoryNetwork, handler: Any, **settings: Any) -> tuple[InMemoryTransport, str]:
    t = transport(network, handler, **settings)
    port = await t.listen("127.0.0.1", 0)
    return t, f"127.0.0.1:{port}"


async def test_a_deadline_fires_on_virtual_time_and_cancels_at_the_peer(
    clock: VirtualClock, network: InMemoryNetwork
) -> None:
    server = Recorder()
    _, endpoint = await serve(network, server)
    conn = await transport(network).connect(endpoint)
    fut = conn.request(call("hold"), [], 30.0, ("Echo/x", "hold"))
    await clock.advance(29.9)
    assert not fut.done() and server.held  # delivered, unanswered, not yet expired
    await clock.advance(0.2)
    with pytest.raises(errors.GrainTimeoutError):
        fut.result()
    assert server.frames[-1] == [CANCEL, server.held[0][1]]
    assert conn.pending == 0


async def test_frames_arrive_on_a_later_loop_turn_never_inside_the_send(
    clock: VirtualClock, network: InMemoryNetwork
) -> None:
    server = Recorder()
    _, endpoint = await serve(network, server)
    conn = await transport(network).connect(endpoint)
    fut = conn.request(call("echo"), [1], 5.0)
    assert server.frames == []  # the request is on its way, not handled re-entrantly
    await clock.settle()
    assert server.frames and fut.result() == [1]


async def test_peers_share_no_objects_and_receive_aligned_buffers_of_their_own(
    clock: VirtualClock, network: InMemoryNetwork
) -> None:
    server = Recorder()
    _, endpoint = await serve(network, server)
    conn = await transport(network).connect(endpoint)
    sent = [1, 2]
    big = np.zeros(50_000, dtype=np.float64)
    fut = conn.request(call("hold"), (sent, big), 5.0)
    sent.append(3)  # after sending: the peer must not see it
    big[0] = 7.0
    await clock.settle()
    got_list, got_array = server.bodies[0]
    assert got_list == [1, 2] and got_array[0] == 0.0
    assert not np.shares_memory(got_array, big) and got_array.ctypes.data % 64 == 0
    reply = {"answer": [1]}
    held_conn, req_id = server.held[0]
    held_conn.send_response(req_id, reply)
    reply["answer"].append(2)
    await clock.settle()
    assert fut.result() == {"answer": [1]}


async def test_a_garbage_header_aborts_that_connection_only(clock: VirtualClock, network: InMemoryNetwork) -> None:
    server = Recorder()
    listener, endpoint = await serve(network, server)
    client = transport(network)
    conn = await client.connect(endpoint)
    in_flight = conn.request(call("hold"), [], 5.0)
    client.write_raw(conn, PREFIX.pack(3, 0, 0) + b"\xc1\xc1\xc1")  # a header that is no msgpack
    with pytest.raises(errors.SiloUnavailableError):
        await in_flight
    assert listener.statistics().bad_frames == 1 and conn.closed
    for header in ([], ["REQUEST", 1], [99, 1]):  # empty, a kind that is no int, an unknown kind
        peer = network.open_raw(endpoint)
        peer.write_frame(header)
        await clock.settle()
        assert peer.closed and peer.frames[0].header[0] == HELLO
    assert listener.statistics().bad_frames == 4
    fresh = await transport(network).connect(endpoint)
    assert await fresh.request(call("echo"), ["still serving"], 5.0) == ["still serving"]


async def test_frames_over_the_limits_are_refused(clock: VirtualClock, network: InMemoryNetwork) -> None:
    listener, endpoint = await serve(network, Recorder(), max_frame_bytes=4096)
    conn = await transport(network).connect(endpoint)
    with pytest.raises(errors.SiloUnavailableError):
        await conn.request(call("echo"), [b"x" * 10_000], 5.0)
    assert listener.statistics().bad_frames == 1


async def test_in_flight_is_bounded_on_both_sides(clock: VirtualClock, network: InMemoryNetwork) -> None:
    server = Recorder()
    listener, endpoint = await serve(network, server, max_in_flight=1)
    conn = await transport(network, max_in_flight=2).connect(endpoint)
    first = conn.request(call("hold"), [], 5.0)
    second = conn.request(call("hold"), [], 5.0)  # the peer serves one at a time
    with pytest.raises(errors.OverloadedError):
        conn.request(call("hold"), [], 5.0)  # our own bound: two outstanding
    await clock.settle()
    with pytest.raises(errors.OverloadedError):
        second.result()
    assert not first.done() and listener.statistics().overloaded == 1


async def test_concurrent_connects_share_one_connection_and_an_endpoint_has_one_listener(
    clock: VirtualClock, network: InMemoryNetwork
) -> None:
    listener, endpoint = await serve(network, Recorder())
    client = transport(network)
    a, b = await asyncio.gather(client.connect(endpoint), client.connect(endpoint))
    assert a is b and client.connection_nowait(endpoint) is a
    host, _, port = endpoint.rpartition(":")
    with pytest.raises(OSError):
        await transport(network).listen(host, int(port))
    assert network.listening() == [endpoint]
    await listener.close()
    assert network.listening() == [] and a.closed


async def test_the_failure_detectors_probe_sees_a_gone_silo_as_refused(
    clock: VirtualClock, network: InMemoryNetwork
) -> None:
    listener, endpoint = await serve(network, Recorder())
    host, _, port = endpoint.rpartition(":")
    probe = transport_probe(transport(network))
    assert await probe(SiloAddress(host, int(port), 1), 1.0) is ProbeResult.OK
    listener.abort_all()
    await clock.settle()
    assert await probe(SiloAddress(host, int(port), 1), 1.0) is ProbeResult.REFUSED


async def test_a_listener_that_stops_while_a_handshake_to_it_is_lost_keeps_no_end_open(
    clock: VirtualClock, network: InMemoryNetwork
) -> None:
    # The simulator's seed 181 of `silo`: a silo restarted while a peer's connect to it hung on a
    # partition; the listener's end of that lost handshake stayed open after the silo stopped.
    listener, endpoint = await serve(network, Recorder())
    network.links = CutTo(endpoint)
    connecting = asyncio.ensure_future(transport(network, connect_timeout_s=5.0).connect(endpoint))
    await clock.settle()
    assert not connecting.done() and len(network.open_ends()) == 2
    await listener.close()
    assert [(local, remote) for _, local, remote in network.open_ends() if local == endpoint] == []
    await clock.advance(5.0)
    with pytest.raises(errors.SiloUnavailableError):
        await connecting  # the connector's own timeout ends its side
    assert network.open_ends() == []
