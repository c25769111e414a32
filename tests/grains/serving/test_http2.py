"""The gRPC server's HTTP/2, frame by frame: what grpc's own client never sends, sent by hand.

Frames are written and read here with a few lines of struct work and
``hpack`` (not the server's own helpers), so a mistake in those shows as a
failure rather than agreeing with itself. test_grpc_server.py covers the same
server through grpc's client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import hpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grains.serving.grpc_server import MAX_FRAME, MAX_STREAMS, Call, GrpcServer, Method
from grains.serving.proto import grpc_predict_v2_pb2 as pb

INFER = "/inference.GRPCInferenceService/ModelInfer"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, END_HEADERS, PADDED = 0x1, 0x4, 0x8
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = (
    1,
    3,
    6,
    7,
    9,
)


def raw(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + sid.to_bytes(4, "big") + payload


def message(request: pb.ModelInferRequest) -> bytes:
    body = request.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def request_headers(encoder: hpack.Encoder, path: str = INFER) -> bytes:
    return encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "test"),
                           ("content-type", "application/grpc"), ("te", "trailers")])  # fmt: skip


async def echo(request: pb.ModelInferRequest, call: Call) -> pb.ModelInferResponse:
    return pb.ModelInferResponse(
        id=request.id, raw_output_contents=list(request.raw_input_contents)
    )


class Peer:
    """A hand-driven HTTP/2 client connection: writes raw frames, reads the server's one by one."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = hpack.Decoder()
        self.encoder = hpack.Encoder()
        self.blocks: dict[int, list[dict[bytes, bytes]]] = {}  # each stream's header blocks, decoded

    @classmethod
    async def open(cls, port: int, settings_payload: bytes = b"") -> Peer:
        peer = cls(*await asyncio.open_connection("127.0.0.1", port))
        peer.send(PREFACE + raw(SETTINGS, 0, 0, settings_payload))
        return peer

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def frame(self) -> tuple[int, int, int, bytes] | None:
        """The server's next frame (kind, flags, stream, payload), or None at the end of the connection."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), 10)
            payload = await asyncio.wait_for(
                self.reader.readexactly(int.from_bytes(head[:3], "big")), 10
            )
        except asyncio.IncompleteReadError:
            return None
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload

    async def until(self, kind: int, sid: int | None = None) -> list[tuple[int, int, int, bytes]]:
        """Frames up to and including the first of ``kind`` (on ``sid``); header blocks decoded on the way."""
        seen = []
        while (f := await self.frame()) is not None:
            seen.append(f)
            if f[0] == HEADERS:
                self.blocks.setdefault(f[2], []).append(dict(self.decoder.decode(f[3], raw=True)))
            if f[0] == kind and (sid is None or f[2] == sid):
                return seen
        raise AssertionError(f"the connection ended before a frame of type {kind}: {seen}")

    async def closed_with(self) -> int:
        """The error code of the GOAWAY the server ends the connection with."""
        last = None
        while (f := await self.frame()) is not None:
            last = f
        assert last is not None and last[0] == GOAWAY, last
        return int.from_bytes(last[3][4:8], "big")

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
async def port() -> AsyncIterator[int]:
    server = GrpcServer(
        {INFER: Method(pb.ModelInferRequest, echo)}, max_receive=32 << 20, max_send=32 << 20
    )
    yield await server.start("127.0.0.1", 0)
    await server.stop(1)


def answer(
    frames: list[tuple[int, int, int, bytes]], sid: int, decoder: hpack.Decoder | None = None
) -> bytes:
    return b"".join(f[3] for f in frames if f[0] == DATA and f[2] == sid)


async def test_split_headers_padded_data_and_pings_are_read_as_one_call(port):
    peer = await Peer.open(port)
    block = request_headers(peer.encoder)
    body = message(pb.ModelInferRequest(id="split", raw_input_contents=[b"x" * 300]))
    peer.send(
        raw(HEADERS, 0, 1, block[:3])
        + raw(CONTINUATION, 0, 1, block[3:7])
        + raw(CONTINUATION, END_HEADERS, 1, block[7:])
    )
    peer.send(raw(PING, 0, 0, b"12345678"))
    peer.send(
        raw(DATA, PADDED, 1, bytes([7]) + body[:100] + bytes(7))
        + raw(DATA, END_STREAM | PADDED, 1, bytes([0]) + body[100:])
    )
    frames = await peer.until(HEADERS, 1)  # the response's headers
    frames += await peer.until(HEADERS, 1)  # its trailers
    peer.close()
    assert (PING, 1, 0, b"12345678") in [
        (k, fl, s, p) for k, fl, s, p in frames
    ]  # acknowledged, same payload
    assert [(k, fl) for k, fl, s, _ in frames if s == 1] == [
        (HEADERS, END_HEADERS),
        (DATA, 0),
        (HEADERS, END_HEADERS | END_STREAM),
    ]
    got = answer(frames, 1)
    assert pb.ModelInferResponse.FromString(got[5:]) == pb.ModelInferResponse(
        id="split", raw_output_contents=[b"x" * 300]
    )


async def test_an_answer_larger_than_the_clients_window_waits_for_it_to_open(port):
    # The client's streams get a window of 1,000 bytes; a 5,000-byte answer must stop there.
    peer = await Peer.open(port, (4).to_bytes(2, "big") + (1000).to_bytes(4, "big"))
    blob = bytes(range(250)) * 20
    peer.send(raw(HEADERS, END_HEADERS, 1, request_headers(peer.encoder)))
    peer.send(
        raw(DATA, END_STREAM, 1, message(pb.ModelInferRequest(id="big", raw_input_contents=[blob])))
    )
    frames = await peer.until(DATA, 1)
    # A PING's acknowledgement comes after whatever the server could send before it: so all it sent
    # of the answer so far is in hand when the ACK is.
    peer.send(raw(PING, 0, 0, b"barrier!"))
    frames += await peer.until(PING)
    assert len(answer(frames, 1)) == 1000
    # A larger INITIAL_WINDOW_SIZE moves the open stream's window by the difference (RFC 9113,
    # 6.9.2): 2,000 bytes more, and no more than that.
    peer.send(raw(SETTINGS, 0, 0, (4).to_bytes(2, "big") + (3000).to_bytes(4, "big")))
    while len(answer(frames, 1)) < 3000:  # a server that ignored the change sends nothing: timeout
        frames += await peer.until(DATA, 1)
    peer.send(raw(PING, 0, 0, b"barrier2"))  # sent once the window's worth is in: nothing more came
    frames += await peer.until(PING)
    assert len(answer(frames, 1)) == 3000
    peer.send(raw(WINDOW_UPDATE, 0, 1, (100_000).to_bytes(4, "big")))
    frames += await peer.until(HEADERS, 1)  # the trailers, once the rest is through
    peer.close()
    got = answer(frames, 1)
    assert pb.ModelInferResponse.FromString(got[5:]).raw_output_contents == [blob]


async def test_streams_over_the_limit_are_refused_and_the_rest_answered(port):
    peer = await Peer.open(port)
    block = request_headers(peer.encoder)  # indexed from the second stream on: the same bytes
    opened = [2 * k + 1 for k in range(MAX_STREAMS + 1)]
    for sid in opened:  # each left open: none can finish before the last is refused
        peer.send(
            raw(HEADERS, END_HEADERS, sid, block if sid == 1 else request_headers(peer.encoder))
        )
    last = opened[-1]
    frames = await peer.until(RST, last)
    assert frames[-1][3] == REFUSED_STREAM.to_bytes(4, "big")
    peer.send(raw(DATA, END_STREAM, 1, message(pb.ModelInferRequest(id="first"))))
    frames = await peer.until(HEADERS, 1)
    frames += await peer.until(HEADERS, 1)
    peer.close()
    assert pb.ModelInferResponse.FromString(answer(frames, 1)[5:]).id == "first"


async def test_a_header_block_seen_before_is_read_again_once_the_table_changed(port):
    """The server keeps decoded header blocks; the same bytes mean other headers once the
    client's HPACK table has changed, and must be read as such."""
    peer = await Peer.open(port)
    peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 1, request_headers(peer.encoder)))  # fills the table
    indexed = request_headers(peer.encoder)  # now indexes only: the same bytes every call
    peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 3, indexed))
    # A new :path enters the table first, so the indexes of `indexed` now name other entries,
    # among them this :path.
    peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 5, request_headers(peer.encoder, "/x.Y/Nope")))
    peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 7, indexed))
    await peer.until(HEADERS, 7)
    peer.close()
    status = {sid: (peer.blocks[sid][-1][b"grpc-status"], peer.blocks[sid][-1].get(b"grpc-message", b""))
              for sid in (1, 3, 5, 7)}  # fmt: skip
    # ModelInfer with no body: INTERNAL; the unknown method: UNIMPLEMENTED, on 5 and on 7.
    assert status[1][0] == status[3][0] == b"13"
    assert status[5][0] == status[7][0] == b"12" and b"Nope" in status[7][1]


async def test_after_a_goaway_new_streams_are_refused_and_the_call_under_way_is_answered():
    release, entered = asyncio.Event(), asyncio.Event()

    async def held(request: pb.ModelInferRequest, call: Call) -> pb.ModelInferResponse:
        entered.set()
        await release.wait()
        return await echo(request, call)

    server = GrpcServer({INFER: Method(pb.ModelInferRequest, held)}, max_receive=1 << 20, max_send=1 << 20)
    peer = await Peer.open(await server.start("127.0.0.1", 0))
    peer.send(raw(HEADERS, END_HEADERS, 1, request_headers(peer.encoder)))
    peer.send(raw(DATA, END_STREAM, 1, message(pb.ModelInferRequest(id="under way"))))
    await asyncio.wait_for(entered.wait(), 10)
    stopping = asyncio.ensure_future(server.stop(30))
    frames = await peer.until(GOAWAY)
    assert int.from_bytes(frames[-1][3][:4], "big") == 1  # the last stream it will answer
    peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 3, request_headers(peer.encoder)))
    frames = await peer.until(RST, 3)
    assert frames[-1][3] == REFUSED_STREAM.to_bytes(4, "big")
    release.set()
    frames = await peer.until(HEADERS, 1)
    frames += await peer.until(HEADERS, 1)
    await asyncio.wait_for(stopping, 10)
    peer.close()
    assert pb.ModelInferResponse.FromString(answer(frames, 1)[5:]).id == "under way"
    assert peer.blocks[1][-1][b"grpc-status"] == b"0"


@pytest.mark.parametrize(
    ("name", "frames", "code"),
    [
        ("HEADERS on a server's (even) stream", lambda e: raw(HEADERS, END_HEADERS, 2, request_headers(e)), PROTOCOL_ERROR),
        # Its header alone: refused on its length, before the payload (which, unread, would make
        # the kernel reset the connection rather than deliver the GOAWAY).
        ("a frame over the largest size", lambda e: raw(DATA, 0, 1, bytes(MAX_FRAME + 1))[:9], FRAME_SIZE_ERROR),
        ("DATA on a stream never opened", lambda e: raw(DATA, 0, 5, b"x"), PROTOCOL_ERROR),
        ("a header block HPACK cannot read", lambda e: raw(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff"), COMPRESSION_ERROR),
        ("a PING of 7 bytes", lambda e: raw(PING, 0, 0, bytes(7)), FRAME_SIZE_ERROR),
        ("CONTINUATION after no HEADERS", lambda e: raw(CONTINUATION, END_HEADERS, 1, b""), PROTOCOL_ERROR),
        ("HEADERS interrupted by a PING", lambda e: raw(HEADERS, 0, 1, request_headers(e)) + raw(PING, 0, 0, bytes(8)), PROTOCOL_ERROR),
        ("SETTINGS of 5 bytes", lambda e: raw(SETTINGS, 0, 0, bytes(5)), FRAME_SIZE_ERROR),
        ("a connection window past 2^31 - 1", lambda e: raw(WINDOW_UPDATE, 0, 0, (2**31 - 1).to_bytes(4, "big")), FLOW_CONTROL_ERROR),
        ("padding longer than its frame", lambda e: raw(HEADERS, END_HEADERS | PADDED, 1, bytes([9]) + b"abc"), PROTOCOL_ERROR),
    ],
)  # fmt: skip
async def test_broken_http2_ends_the_connection_with_a_goaway_naming_the_error(
    port, name, frames, code
):
    peer = await Peer.open(port)
    peer.send(frames(peer.encoder))
    assert await peer.closed_with() == code, name
    peer.close()


# --- anything at all -----------------------------------------------------------------------------

frame_strategy = st.one_of(
    st.builds(raw, st.integers(0, 10), st.integers(0, 255), st.sampled_from([0, 1, 2, 3, 5, 2**31 - 1]),
              st.binary(max_size=40)),
    # Pieces of a real call on stream 1, with any flags: a body, a body cut short, a window update.
    st.builds(raw, st.just(DATA), st.integers(0, 255), st.just(1),
              st.sampled_from([message(pb.ModelInferRequest(id="fuzz")), b"\x00\x00\x00\x00\x09abc", b""])),
    st.builds(raw, st.just(WINDOW_UPDATE), st.just(0), st.sampled_from([0, 1]), st.binary(min_size=4, max_size=4)),
)  # fmt: skip


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(opened=st.booleans(), frames=st.lists(frame_strategy, max_size=8))
def test_any_frames_get_answers_or_a_goaway_and_break_nothing_else(opened, frames, caplog):
    """Whatever a peer sends after the preface, the server answers, refuses or closes that
    connection with a GOAWAY; it raises nothing, and a well-formed call on another connection
    is answered after it."""

    async def scenario() -> tuple[list[Any], bool]:
        loop = asyncio.get_running_loop()
        errors: list[Any] = []
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        server = GrpcServer(
            {INFER: Method(pb.ModelInferRequest, echo)}, max_receive=1 << 16, max_send=1 << 16
        )
        port = await server.start("127.0.0.1", 0)
        try:
            fuzz = await Peer.open(port)
            if opened:  # stream 1 opened as a real call would, so the frames after it reach a call
                fuzz.send(raw(HEADERS, END_HEADERS, 1, request_headers(fuzz.encoder)))
            fuzz.send(b"".join(frames) + raw(PING, 0, 0, b"finally!"))
            alive = False
            while (f := await fuzz.frame()) is not None:
                if f[0] == PING and f[3] == b"finally!":
                    alive = True
                    break
                if f[0] == GOAWAY and int.from_bytes(f[3][4:8], "big") != 0:
                    break  # closed, naming an error: fine
            fuzz.close()
            good = await Peer.open(port)
            good.send(raw(HEADERS, END_HEADERS, 1, request_headers(good.encoder)))
            good.send(raw(DATA, END_STREAM, 1, message(pb.ModelInferRequest(id="after"))))
            got = await good.until(HEADERS, 1)
            got += await good.until(HEADERS, 1)
            good.close()
            assert pb.ModelInferResponse.FromString(answer(got, 1)[5:]).id == "after"
        finally:
            await server.stop(1)
        return errors, alive

    with caplog.at_level(logging.ERROR):
        errors, _ = asyncio.run(scenario())
    assert errors == [] and not [r for r in caplog.records if r.levelno >= logging.ERROR]
