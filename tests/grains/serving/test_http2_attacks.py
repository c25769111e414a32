"""The gRPC server under the known HTTP/2 server attacks, each beside a well-behaved canary client.

Each attack runs on its own connection while a canary, on another, makes
calls one after another; the attack must end with the abusive connection
closed (a GOAWAY naming why) or throttled, and every canary call answered.
Frames are written by hand (test_http2.py's ``Peer``).
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import hpack
import pytest

from grains.serving.front import Front
from grains.serving.grpc_front import make_grpc_server
from grains.serving.grpc_server import GrpcServer, Method
from grains.serving.proto import grpc_predict_v2_pb2 as pb
from grains.serving.settings import FrontSettings, GrpcLimits
from tests.grains.serving.test_http2 import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    INFER,
    PING,
    PREFACE,
    RST,
    SETTINGS,
    WINDOW_UPDATE,
    Peer,
    answer,
    echo,
    message,
    raw,
    request_headers,
)  # fmt: skip

ENHANCE_YOUR_CALM = 11
NO_ERROR = 0


@asynccontextmanager
async def serving(limits: GrpcLimits | None = None, max_message: int = 1 << 20) -> AsyncIterator[tuple[GrpcServer, int]]:
    server = GrpcServer({INFER: Method(pb.ModelInferRequest, echo)}, max_receive=max_message, max_send=max_message,
                        limits=limits)  # fmt: skip
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.stop(1)


async def call(peer: Peer, sid: int, ident: str) -> str:
    """One call on ``peer``'s stream ``sid``: its answer's id."""
    peer.send(raw(HEADERS, END_HEADERS, sid, request_headers(peer.encoder)))
    peer.send(raw(DATA, END_STREAM, sid, message(pb.ModelInferRequest(id=ident))))
    frames = await peer.until(HEADERS, sid)
    frames += await peer.until(HEADERS, sid)
    return pb.ModelInferResponse.FromString(answer(frames, sid)[5:]).id


class Canary:
    """A well-behaved client on its own connection: one call after another until stopped."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.answered = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        peer = await Peer.open(self.port)
        # Its connection window opened as far as HTTP/2 allows, once: a canary that gives none back
        # would stop being answered after 65,535 bytes of answers, as flow control has it.
        peer.send(raw(WINDOW_UPDATE, 0, 0, (2**31 - 1 - 65_535).to_bytes(4, "big")))
        sid = 1
        try:
            while not self.stop.is_set():
                assert await call(peer, sid, f"canary {sid}") == f"canary {sid}"
                self.answered += 1
                sid += 2
        finally:
            peer.close()


@asynccontextmanager
async def canary(port: int, at_least: int = 5) -> AsyncIterator[Canary]:
    """A canary calling while the block runs; on exit, it must have had ``at_least`` calls answered."""
    c = Canary(port)
    task = asyncio.ensure_future(c.run())
    try:
        yield c
        while c.answered < at_least and not task.done():  # it keeps calling after the attack too
            await asyncio.sleep(0.01)
    finally:
        c.stop.set()
        await asyncio.wait_for(task, 30)  # a failed canary call raises here
    assert c.answered >= at_least


async def goaway_code(peer: Peer) -> int:
    """The error code of the GOAWAY the server ends the connection with (frames before it skipped)."""
    while (f := await peer.frame()) is not None:
        if f[0] == GOAWAY:
            return int.from_bytes(f[3][4:8], "big")
    raise AssertionError("the connection ended without a GOAWAY")


async def flood(peer: Peer, frames: bytes, most: int) -> None:
    """Send ``frames`` again and again (``most`` times at most) until the server closes the connection."""
    for _ in range(most):
        if peer.writer.is_closing() or peer.reader.at_eof():
            return
        try:
            peer.send(frames)
            await asyncio.wait_for(peer.writer.drain(), 10)
        except (ConnectionError, TimeoutError):
            return


async def calmed(peer: Peer, frames: bytes, most: int = 20_000) -> int:
    """Flood ``frames``; the code of the GOAWAY the connection ends with."""
    sending = asyncio.ensure_future(flood(peer, frames, most))
    try:
        return await goaway_code(peer)
    finally:
        sending.cancel()
        peer.close()


async def test_rapid_reset_ends_the_connection_with_enhance_your_calm_and_the_canary_is_served():
    async with serving() as (server, port), canary(port):
        peer = await Peer.open(port)
        # The headers enter the table on stream 1; every stream's block after is the same bytes.
        peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 1, request_headers(peer.encoder)))
        block = request_headers(peer.encoder)
        body = message(pb.ModelInferRequest(id="reset me"))

        async def streams() -> None:  # 100 calls opened and reset at once, again and again
            sid = 3
            for _ in range(500):
                if peer.writer.is_closing():
                    return
                batch = []
                for s in range(sid, sid + 200, 2):
                    batch.append(raw(HEADERS, END_HEADERS, s, block) + raw(DATA, END_STREAM, s, body) + raw(RST, 0, s, (8).to_bytes(4, "big")))
                sid += 200
                try:
                    peer.send(b"".join(batch))
                    await asyncio.wait_for(peer.writer.drain(), 10)
                except (ConnectionError, TimeoutError):
                    return

        sending = asyncio.ensure_future(streams())
        assert await goaway_code(peer) == ENHANCE_YOUR_CALM
        sending.cancel()
        peer.close()
    assert server.statistics().calmed == 1


async def test_empty_continuation_frames_end_the_connection():
    async with serving() as (_, port), canary(port):
        peer = await Peer.open(port)
        peer.send(raw(HEADERS, 0, 1, request_headers(peer.encoder)))  # a header block never ended
        assert await calmed(peer, raw(CONTINUATION, 0, 1) * 1000) == ENHANCE_YOUR_CALM


async def test_empty_data_frames_end_the_connection():
    async with serving() as (_, port), canary(port):
        peer = await Peer.open(port)
        peer.send(raw(HEADERS, END_HEADERS, 1, request_headers(peer.encoder)))
        assert await calmed(peer, raw(DATA, 0, 1) * 1000) == ENHANCE_YOUR_CALM


async def test_a_ping_flood_ends_the_connection():
    async with serving() as (_, port), canary(port):
        peer = await Peer.open(port)
        assert await calmed(peer, raw(PING, 0, 0, b"flooding") * 1000) == ENHANCE_YOUR_CALM


async def test_a_settings_flood_ends_the_connection():
    async with serving() as (_, port), canary(port):
        peer = await Peer.open(port)
        assert await calmed(peer, raw(SETTINGS, 0, 0, (4).to_bytes(2, "big") + (65535).to_bytes(4, "big")) * 1000) == ENHANCE_YOUR_CALM


async def test_a_settings_frame_of_174762_entries_ends_the_connection_and_a_window_change_moves_streams_once():
    async with serving() as (_, port), canary(port):
        peer = await Peer.open(port, (4).to_bytes(2, "big") + (1000).to_bytes(4, "big"))
        # Entries within the bound: INITIAL_WINDOW_SIZE set 64 times, the last one counts.
        entries = [(4).to_bytes(2, "big") + (w).to_bytes(4, "big") for w in range(1, 64)] + [(4).to_bytes(2, "big") + (3000).to_bytes(4, "big")]
        blob = bytes(range(250)) * 20
        peer.send(raw(HEADERS, END_HEADERS, 1, request_headers(peer.encoder)))
        peer.send(raw(DATA, END_STREAM, 1, message(pb.ModelInferRequest(raw_input_contents=[blob]))))
        frames = await peer.until(DATA, 1)  # 1,000 bytes: the window the stream opened with
        peer.send(raw(SETTINGS, 0, 0, b"".join(entries)))
        while len(answer(frames, 1)) < 3000:
            frames += await peer.until(DATA, 1)
        peer.send(raw(PING, 0, 0, b"barrier!"))
        frames += await peer.until(PING)
        assert len(answer(frames, 1)) == 3000  # moved by 3,000 - 1,000, not by each entry's change
        huge = (4).to_bytes(2, "big") + (65535).to_bytes(4, "big")
        peer.send(raw(SETTINGS, 0, 0, huge * 174_762))
        assert await goaway_code(peer) == ENHANCE_YOUR_CALM
        peer.close()


async def test_one_byte_window_updates_wake_one_waiting_sender_each_not_all_of_them():
    async with serving() as (server, port):
        # Streams may take 1 MiB each; the connection keeps the default 65,535 bytes: 40 answers
        # of 4 KB fill it, and the rest wait for the connection's window.
        peer = await Peer.open(port, (4).to_bytes(2, "big") + (1 << 20).to_bytes(4, "big"))
        body = message(pb.ModelInferRequest(raw_input_contents=[bytes(4000)]))
        for sid in range(1, 81, 2):
            peer.send(raw(HEADERS, END_HEADERS, sid, request_headers(peer.encoder)) + raw(DATA, END_STREAM, sid, body))
        peer.send(raw(PING, 0, 0, b"barrier1"))
        await peer.until(PING)
        assert server.statistics().calls > 20  # waiting on the connection's window
        before = server.statistics().wakeups
        for _ in range(20):  # each in a read of its own, the woken sender's byte in hand before the next
            peer.send(raw(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")))
            await peer.until(DATA)
        assert server.statistics().wakeups - before <= 20  # one each; waking all would be 20 x 20 and more
        peer.close()


async def test_a_client_that_never_reads_stops_being_read_and_its_answers_do_not_pile_up():
    async with serving(max_message=1 << 20) as (server, port), canary(port):
        # Answers outside flow control: a call to an unknown method is answered with its trailers
        # only, which name the method: a 4,000-byte path asks for 4 KB of answer.
        peer = await Peer.open(port)  # its reader is never read: asyncio stops reading the socket
        peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 1, request_headers(peer.encoder)))  # fills the table
        # The path never indexed: the table stays as it is, and every stream's block is the same bytes.
        block = peer.encoder.encode([(":method", "POST"), (":scheme", "http"), ("content-type", "application/grpc"),
                                     hpack.NeverIndexedHeaderTuple(":path", "/x.Y/" + "n" * 4000)])  # fmt: skip
        sid, answers = 3, 0
        try:
            while answers < 48 << 20:  # what the server would hold, unread, if it went on reading
                batch = b"".join(raw(HEADERS, END_HEADERS | END_STREAM, s, block) for s in range(sid, sid + 2000, 2))
                sid += 2000
                answers += 1000 * 4000
                peer.send(batch)
                try:
                    await asyncio.wait_for(peer.writer.drain(), 2)
                except TimeoutError:
                    break  # the server stopped reading (or is slow): the client's own buffers are full
            for _ in range(400):  # a slow server may still be working through what it read
                if server.statistics().reading_paused:
                    break
                await asyncio.sleep(0.05)
            stats = server.statistics()
            assert stats.reading_paused == 1, stats
            assert stats.write_buffered_bytes < 8 << 20, stats
        finally:
            peer.writer.transport.abort()


async def opened(port: int) -> tuple[Peer, int]:
    """A connection, and the connection window the server opened it with."""
    peer = await Peer.open(port)
    peer.send(raw(PING, 0, 0, b"settled!"))
    frames = await peer.until(PING)
    return peer, 65_535 + sum(int.from_bytes(f[3], "big") for f in frames if f[0] == WINDOW_UPDATE and f[2] == 0)


async def test_data_past_the_receive_window_is_a_flow_control_error_and_buffered_requests_are_capped():
    # At most 4 MiB of unfinished requests: the connection's window is what is left of that, and
    # is given back only as handlers take requests (or refused ones are dropped).
    cap = 4 << 20
    async with serving(GrpcLimits(max_buffered_bytes=cap, max_message_bytes=1 << 20), max_message=1 << 20) as (server, port), canary(port):
        peer, window = await opened(port)
        assert window == cap
        almost = message(pb.ModelInferRequest(raw_input_contents=[bytes((1 << 20) - 64)]))[: (1 << 20) - 1024]
        for sid in (1, 3, 5, 7):  # four calls of nearly 1 MiB each, none finished
            peer.send(raw(HEADERS, END_HEADERS, sid, request_headers(peer.encoder)) + raw(DATA, 0, sid, almost))
        peer.send(raw(PING, 0, 0, b"barrier1"))
        frames = await peer.until(PING)
        assert not [f for f in frames if f[0] == WINDOW_UPDATE and f[2] == 0], "the connection's window given back for held bytes"
        assert server.statistics().buffered_bytes == 4 * len(almost)
        # A fifth fills what is left and cannot finish: refused, RESOURCE_EXHAUSTED, its room given back.
        rest = cap - 4 * len(almost)
        peer.send(raw(HEADERS, END_HEADERS, 9, request_headers(peer.encoder)) + raw(DATA, 0, 9, almost[:rest]))
        frames = await peer.until(HEADERS, 9)
        assert peer.blocks[9][-1][b"grpc-status"] == b"8"
        frames = await peer.until(WINDOW_UPDATE, 0)
        assert int.from_bytes(frames[-1][3], "big") == rest
        assert server.statistics().buffered_bytes == 4 * len(almost)
        # Past the window the server advertised: FLOW_CONTROL_ERROR.
        peer.send(raw(HEADERS, END_HEADERS, 11, request_headers(peer.encoder)) + raw(DATA, 0, 11, almost))
        assert await goaway_code(peer) == FLOW_CONTROL_ERROR
        peer.close()


def test_by_default_one_connection_buffers_at_most_one_message_plus_8_mib_well_under_64_mb():
    # Issue 37's bound: a client ignoring windows makes the front grow < 64 MB. A connection may
    # hold one whole message (the test above shows the cap is enforced), so the default message
    # cap (32 MiB) is that bound's lever; `benchmarks front_attacks` measures the RSS.
    limits = GrpcLimits()
    assert limits.max_buffered_bytes == limits.max_message_bytes + (8 << 20) < 64 << 20
    server = make_grpc_server(Front(None))
    assert (server.max_receive, server.limits.max_buffered_bytes) == (limits.max_message_bytes, limits.max_buffered_bytes)
    assert make_grpc_server(Front(None), max_message_bytes=48 << 20).limits.max_buffered_bytes >= (48 << 20) + 5


def test_raising_the_message_cap_raises_the_buffer_and_a_buffer_too_small_for_a_message_is_refused(monkeypatch):
    monkeypatch.setenv("REDGRAIN_FRONT__GRPC__MAX_MESSAGE_BYTES", str(64 << 20))
    assert FrontSettings().grpc.max_buffered_bytes == (64 + 8) << 20
    monkeypatch.setenv("REDGRAIN_FRONT__GRPC__MAX_BUFFERED_BYTES", str(16 << 20))
    with pytest.raises(ValueError, match="cannot hold one message"):
        FrontSettings()


async def test_the_connections_window_is_given_back_as_handlers_take_the_requests():
    async with serving(GrpcLimits(max_buffered_bytes=4 << 20, max_message_bytes=1 << 20), max_message=1 << 20) as (_, port):
        peer, _ = await opened(port)
        whole = message(pb.ModelInferRequest(id="held", raw_input_contents=[bytes((1 << 20) - 64)]))
        for sid in (1, 3, 5, 7):
            peer.send(raw(HEADERS, END_HEADERS, sid, request_headers(peer.encoder)) + raw(DATA, 0, sid, whole[:-10]))
        peer.send(raw(PING, 0, 0, b"barrier1"))
        frames = await peer.until(PING)
        assert not [f for f in frames if f[0] == WINDOW_UPDATE and f[2] == 0]
        peer.send(raw(DATA, END_STREAM, 1, whole[-10:]))  # the first call is whole: its handler takes it
        frames = await peer.until(WINDOW_UPDATE, 0)
        assert int.from_bytes(frames[-1][3], "big") >= len(whole) - 10
        peer.close()


async def test_a_connection_that_sends_half_a_preface_is_closed_by_the_handshake_timeout():
    async with serving(GrpcLimits(handshake_timeout_s=0.2)) as (server, port), canary(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(PREFACE[:10])
        await asyncio.wait_for(reader.read(), 10)  # up to the end of the connection
        writer.close()
        assert server.statistics().timed_out == 1


async def test_an_idle_connection_is_closed_with_a_goaway():
    async with serving(GrpcLimits(idle_timeout_s=0.2)) as (server, port):
        peer = await Peer.open(port)
        assert await call(peer, 1, "before idling") == "before idling"
        assert await peer.closed_with() == NO_ERROR
        peer.close()
        assert server.statistics().timed_out == 1


async def test_connections_over_the_limit_are_closed_and_those_within_it_served():
    async with serving(GrpcLimits(max_connections=2)) as (server, port):
        kept = [await Peer.open(port), await Peer.open(port)]
        assert await call(kept[0], 1, "one") == "one"
        assert await call(kept[1], 1, "two") == "two"
        extra = await Peer.open(port)
        frames = await extra.until(GOAWAY)
        assert b"connection limit" in frames[-1][3]
        assert await extra.frame() is None
        extra.close()
        assert await call(kept[0], 3, "still") == "still"
        for p in kept:
            p.close()
        assert server.statistics().refused_connections == 1


async def test_the_header_cache_is_bounded_in_bytes():
    async with serving(GrpcLimits(header_cache_bytes=16 << 10)) as (server, port):
        peer = await Peer.open(port)
        peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 1, request_headers(peer.encoder)))  # fills the table
        for k in range(64):  # distinct blocks of ~4 KiB, the table left as it is (literals never indexed)
            # The padding never indexed (RFC 7541, 6.2.3): the table stays as it is, the block is new.
            block = peer.encoder.encode([(":method", "POST"), (":path", INFER), ("content-type", "application/grpc"),
                                         hpack.NeverIndexedHeaderTuple("x-pad", f"{k:02d}" + "p" * 4000)])  # fmt: skip
            peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 3 + 2 * k, block))
        await peer.until(HEADERS, 3 + 2 * 63)
        peer.close()
        assert 0 < server.statistics().header_cache_bytes <= 16 << 10


def h2load() -> str:
    path = shutil.which("h2load")
    if path is None:
        pytest.fail("h2load is missing: `make test` installs it as root; else run "
                    "'sudo apt-get install -y --no-install-recommends nghttp2-client' (Debian's package)")  # fmt: skip
    return path


async def test_h2load_opening_200_connections_past_a_cap_of_20_is_refused_and_the_canary_is_served(tmp_path):
    body = tmp_path / "request.bin"
    body.write_bytes(message(pb.ModelInferRequest(id="h2load")))
    async with serving(GrpcLimits(max_connections=20)) as (server, port), canary(port, at_least=20):
        load = await asyncio.create_subprocess_exec(
            h2load(), "-c", "200", "-n", "2000", "-m", "4", "-d", str(body), "-H", "content-type: application/grpc",
            "-H", "te: trailers", f"http://127.0.0.1:{port}{INFER}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(load.communicate(), 120)
        report = out.decode()
        served = re.search(r"(\d+) succeeded", report)
        assert served is not None and int(served[1]) > 0, report  # the connections within the cap were served
        stats = server.statistics()
    # The canary holds one of the 20; h2load's others were closed as they came, its first 19 served.
    assert stats.refused_connections >= 150, (stats, report)
