"""The unary gRPC server the front runs on, called by grpc's own client (C-core, grpc.aio).

Each test serves small methods of its own over the front's messages, so what
is checked is the transport: deadlines, cancellation, flow control, limits,
statuses, bad input and stopping, not the inference front (test_grpc.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from grains.serving.grpc_server import Abort, Call, GrpcServer, Method, Status
from grains.serving.proto import grpc_predict_v2_pb2 as pb

INFER = "/inference.GRPCInferenceService/ModelInfer"
Handler = Callable[[pb.ModelInferRequest, Call], Awaitable[pb.ModelInferResponse]]


async def echo(request: pb.ModelInferRequest, call: Call) -> pb.ModelInferResponse:
    return pb.ModelInferResponse(id=request.id, raw_output_contents=list(request.raw_input_contents))


async def started(handler: Handler, **limits: int) -> tuple[GrpcServer, str]:
    server = GrpcServer({INFER: Method(pb.ModelInferRequest, handler)},
                        max_receive=limits.get("max_receive", 32 << 20), max_send=limits.get("max_send", 32 << 20))  # fmt: skip
    port = await server.start("127.0.0.1", 0)
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def echo_server() -> AsyncIterator[str]:
    server, url = await started(echo)
    yield url
    await server.stop(1)


def infer(channel: grpc.aio.Channel) -> Any:
    return channel.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                               response_deserializer=pb.ModelInferResponse.FromString)  # fmt: skip


async def test_many_calls_in_flight_on_one_connection_each_get_their_own_answer(echo_server):
    async with grpc.aio.insecure_channel(echo_server) as channel:
        method = infer(channel)
        # More calls than grpc's default of 100 streams a connection, with bodies of several sizes:
        # an answer given to the wrong stream, or a body joined across streams, shows as a mismatch.
        got = await asyncio.gather(*(method(pb.ModelInferRequest(id=str(i), raw_input_contents=[bytes([i % 251]) * i]))
                                     for i in range(300)))  # fmt: skip
    assert [(r.id, list(r.raw_output_contents)) for r in got] == [(str(i), [bytes([i % 251]) * i]) for i in range(300)]


async def test_messages_larger_than_every_window_cross_both_ways_intact(echo_server):
    # 24 MiB each way is past the server's 8 MiB receive window and far past the client's initial
    # 64 KiB one, so the answer goes out in pieces as the client opens its window; four at once
    # share the connection's window.
    blobs = [bytes(range(256)) * (24 << 12), *(bytes([k]) * (3 << 20) + b"end" for k in range(4))]
    async with grpc.aio.insecure_channel(echo_server, options=[("grpc.max_receive_message_length", 64 << 20),
                                                               ("grpc.max_send_message_length", 64 << 20)]) as channel:  # fmt: skip
        method = infer(channel)
        got = await asyncio.gather(*(method(pb.ModelInferRequest(id=str(k), raw_input_contents=[b]), timeout=60)
                                     for k, b in enumerate(blobs)))  # fmt: skip
    assert [r.raw_output_contents[0] == b for r, b in zip(got, blobs, strict=True)] == [True] * 5


async def test_a_message_over_a_limit_is_refused_each_way_and_the_connection_serves_on():
    server, url = await started(echo, max_receive=4 << 20, max_send=2 << 20)
    try:
        async with grpc.aio.insecure_channel(url, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
            method = infer(channel)
            with pytest.raises(grpc.aio.AioRpcError) as big_in:
                await method(pb.ModelInferRequest(raw_input_contents=[bytes(5 << 20)]), timeout=30)
            fits = await method(pb.ModelInferRequest(id="fits", raw_input_contents=[bytes(1 << 19)]), timeout=30)
            # A request of 3 MiB that fits, echoed: an answer of 3 MiB, over max_send.
            with pytest.raises(grpc.aio.AioRpcError) as big_out:
                await method(pb.ModelInferRequest(raw_input_contents=[bytes((1 << 20) - 64)] * 3), timeout=30)
            after = await method(pb.ModelInferRequest(id="after"), timeout=30)
    finally:
        await server.stop(1)
    assert big_in.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in big_in.value.details()
    assert big_out.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "answer is larger" in big_out.value.details()
    assert (fits.id, after.id) == ("fits", "after")


class Waits:
    """A handler that never answers a request without an id (echoes one with an id) and records
    each call's deadline, when it is entered and when it is cancelled."""

    def __init__(self) -> None:
        self.seen: list[float | None] = []
        self.entered, self.cancelled = asyncio.Event(), asyncio.Event()

    async def __call__(self, request: pb.ModelInferRequest, call: Call) -> pb.ModelInferResponse:
        if request.id:
            return await echo(request, call)
        self.seen.append(call.time_remaining())
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


async def test_a_call_past_its_deadline_has_its_handler_cancelled_and_saw_the_deadline():
    waits = Waits()
    seen, entered, cancelled = waits.seen, waits.entered, waits.cancelled
    server, url = await started(waits)
    try:
        async with grpc.aio.insecure_channel(url) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await infer(channel)(pb.ModelInferRequest(), timeout=0.5)
            await asyncio.wait_for(cancelled.wait(), 10)  # the client's RST_STREAM reached the handler
            entered.clear()
            hour = asyncio.ensure_future(infer(channel)(pb.ModelInferRequest(), timeout=3600))
            await asyncio.wait_for(entered.wait(), 10)
            await server.stop(0.1)  # its grace ends long before its deadline: cancelled
            with pytest.raises(grpc.aio.AioRpcError) as stopped:
                await hour
    finally:
        await server.stop(0.1)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stopped.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert seen[0] is not None and 0 < seen[0] <= 0.6
    assert seen[1] is not None and 3000 < seen[1] <= 3700  # grpc's client rounds its timeout up


async def test_a_client_gone_mid_call_cancels_its_handler_and_others_are_served():
    waits = Waits()
    entered, cancelled = waits.entered, waits.cancelled
    server, url = await started(waits)
    try:
        channel = grpc.aio.insecure_channel(url)
        pending = asyncio.ensure_future(infer(channel)(pb.ModelInferRequest()))
        await asyncio.wait_for(entered.wait(), 10)
        await channel.close()  # the connection goes with the call on it
        await asyncio.wait_for(cancelled.wait(), 10)
        with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):  # the channel cancels its calls
            await pending
        async with grpc.aio.insecure_channel(url) as other:
            assert (await infer(other)(pb.ModelInferRequest(id="other"), timeout=10)).id == "other"
    finally:
        await server.stop(1)


async def test_statuses_and_messages_reach_the_client_as_given(caplog):
    message = "naïve 100% sure: ✓ (a\nnewline)"

    async def fails(request: pb.ModelInferRequest, call: Call) -> pb.ModelInferResponse:
        if request.id == "abort":
            raise Abort(Status.FAILED_PRECONDITION, message)
        raise KeyError("a bug")

    server, url = await started(fails)
    try:
        async with grpc.aio.insecure_channel(url) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as aborted:
                await infer(channel)(pb.ModelInferRequest(id="abort"), timeout=10)
            with caplog.at_level(logging.ERROR, logger="grains.serving.grpc_server"), \
                    pytest.raises(grpc.aio.AioRpcError) as bug:  # fmt: skip
                await infer(channel)(pb.ModelInferRequest(id="bug"), timeout=10)
            nope = channel.unary_unary("/inference.GRPCInferenceService/Nope")
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await nope(b"", timeout=10)
            raw = channel.unary_unary(INFER)  # bytes as they are: not a ModelInferRequest
            with pytest.raises(grpc.aio.AioRpcError) as garbled:
                await raw(b"\xff\xff\xff\xff", timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as squeezed:
                await infer(channel)(pb.ModelInferRequest(id="x" * 200), compression=grpc.Compression.Gzip, timeout=10)
            # Each failure ended one call, not the connection: a call that fails the same way still
            # reaches the handler on it.
            with pytest.raises(grpc.aio.AioRpcError) as second:
                await infer(channel)(pb.ModelInferRequest(id="abort"), timeout=10)
    finally:
        await server.stop(1)
    assert (aborted.value.code(), aborted.value.details()) == (grpc.StatusCode.FAILED_PRECONDITION, message)
    assert bug.value.code() == grpc.StatusCode.UNKNOWN and "KeyError" in bug.value.details()
    assert any("ModelInfer failed" in r.getMessage() for r in caplog.records)
    assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Nope" in unknown.value.details()
    assert garbled.value.code() == grpc.StatusCode.INTERNAL and "ModelInferRequest" in garbled.value.details()
    assert squeezed.value.code() == grpc.StatusCode.UNIMPLEMENTED and "identity" in squeezed.value.details()
    assert second.value.details() == message


async def test_garbage_on_a_connection_closes_only_that_connection(echo_server):
    host, port = echo_server.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # not the HTTP/2 preface
    await writer.drain()
    rest = await asyncio.wait_for(reader.read(), 10)  # to EOF: the server closed it
    writer.close()
    frames, at = [], 0
    while at + 9 <= len(rest):  # HTTP/2 frames: 3 bytes of length, the type, flags, stream, payload
        length = int.from_bytes(rest[at : at + 3], "big")
        frames.append((rest[at + 3], rest[at + 9 : at + 9 + length]))
        at += 9 + length
    kind, payload = frames[-1]
    assert kind == 7 and int.from_bytes(payload[4:8], "big") == 1  # GOAWAY, PROTOCOL_ERROR
    assert b"preface" in payload[8:]  # its debug data says what was wrong
    async with grpc.aio.insecure_channel(echo_server) as channel:
        assert (await infer(channel)(pb.ModelInferRequest(id="still"), timeout=10)).id == "still"


async def test_stop_refuses_new_calls_and_gives_calls_under_way_their_grace():
    release, entered = asyncio.Event(), asyncio.Event()

    async def held(request: pb.ModelInferRequest, call: Call) -> pb.ModelInferResponse:
        entered.set()
        await release.wait()
        return await echo(request, call)

    server, url = await started(held)
    async with grpc.aio.insecure_channel(url) as channel:
        under_way = asyncio.ensure_future(infer(channel)(pb.ModelInferRequest(id="under way"), timeout=30))
        await asyncio.wait_for(entered.wait(), 10)
        stopping = asyncio.ensure_future(server.stop(30))
        await asyncio.sleep(0)  # the stop has closed the listener and sent its GOAWAY
        async with grpc.aio.insecure_channel(url) as late:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await infer(late)(pb.ModelInferRequest(id="late"), timeout=5)
        assert not stopping.done()
        release.set()
        assert (await under_way).id == "under way"
        await asyncio.wait_for(stopping, 10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_port_in_use_is_refused_with_the_os_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]

        async def start() -> None:
            await GrpcServer({}, max_receive=1, max_send=1).start("127.0.0.1", port)

        with pytest.raises(OSError):
            asyncio.run(start())
