"""Frame-level tests: hand-built frames from a raw socket against a live silo.

Malformed, oversized and unknown frames close that one connection (or, when
only the request body is bad, get an ERROR frame); the silo keeps serving
every other caller. The cluster-secret handshake is driven by hand too.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest
from pydantic import SecretStr

from silo.client import ClusterClient
from silo.codec import Codec
from silo.messaging.frame import AUTH, AUTH_OK, BUFLEN, ERROR, HELLO, PREFIX, REQUEST, RESPONSE
from silo.settings import TransportSettings
from silo.silo import Silo
from tests.sample_grains import Echo

ClusterFactory = Callable[..., Awaitable[list[Silo]]]
SECRET = "frame-level secret"


def frame(header: list[Any], meta: bytes = b"", buffers: list[bytes] = ()) -> bytes:  # type: ignore[assignment]
    h = msgpack.packb(header)
    lens = b"".join(BUFLEN.pack(len(b)) for b in buffers)
    return PREFIX.pack(len(h), len(meta), len(buffers)) + lens + h + meta + b"".join(buffers)


async def read_frame(reader: asyncio.StreamReader) -> tuple[list[Any], bytes, list[bytes]]:
    hlen, mlen, nbuf = PREFIX.unpack(await reader.readexactly(PREFIX.size))
    lens = [BUFLEN.unpack(await reader.readexactly(8))[0] for _ in range(nbuf)]
    header = msgpack.unpackb(await reader.readexactly(hlen))
    meta = await reader.readexactly(mlen)
    return header, meta, [await reader.readexactly(n) for n in lens]


class Raw:
    """A raw connection to a silo, past its HELLO (and AUTH when a secret is given)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nonce: bytes) -> None:
        self.reader, self.writer, self.nonce = reader, writer, nonce

    @classmethod
    async def open(cls, silo: Silo) -> Raw:
        assert silo.address is not None
        reader, writer = await asyncio.open_connection(silo.address.host, silo.address.port)
        header, _, _ = await read_frame(reader)
        assert header[0] == HELLO
        return cls(reader, writer, header[1])

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def closed_by_peer(self) -> bool:
        """True once the silo has closed this connection (EOF or reset)."""
        try:
            data = await asyncio.wait_for(self.reader.read(65536), 10)
        except ConnectionResetError:
            return True
        return data == b""

    def close(self) -> None:
        self.writer.close()


def request(req_id: int, method: str, args: tuple[Any, ...], key: str = "raw") -> bytes:
    enc = Codec().encode(args)
    return frame([REQUEST, req_id, "Echo", key, method, 5000, [], 0], enc.meta, [bytes(b) for b in enc.buffers])


@pytest.fixture
async def silo(cluster: ClusterFactory) -> Silo:
    (s,) = await cluster(1, transport=TransportSettings(max_frame_bytes=1 << 20))
    return s


async def assert_still_serving(client: ClusterClient, silo: Silo) -> None:
    assert await client.get_grain(Echo, "other").echo("still serving") == "still serving"
    raw = await Raw.open(silo)
    try:
        await raw.send(request(1, "echo", ("fresh",)))
        header, meta, bufs = await read_frame(raw.reader)
        assert header[:2] == [RESPONSE, 1] and Codec().decode(meta, bufs) == "fresh"
    finally:
        raw.close()


async def test_valid_raw_request_gets_a_response_on_the_same_connection(silo: Silo) -> None:
    raw = await Raw.open(silo)
    try:
        for i in range(1, 4):
            await raw.send(request(i, "echo", (i * 10,)))
            header, meta, bufs = await read_frame(raw.reader)
            assert header[:2] == [RESPONSE, i] and Codec().decode(meta, bufs) == i * 10
    finally:
        raw.close()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(PREFIX.pack(3, 0, 0) + b"\xc1\xc1\xc1", id="header-not-msgpack"),
        pytest.param(frame(["not", "a kind"]), id="header-kind-not-int"),
        pytest.param(frame([]), id="empty-header"),
        pytest.param(frame([99, 1]), id="unknown-kind"),
        pytest.param(PREFIX.pack(2 << 20, 0, 0), id="oversized-header"),
        pytest.param(PREFIX.pack(3, 0, 1) + BUFLEN.pack(8 << 20) + msgpack.packb([1, 1]), id="oversized-buffer"),
    ],
)
async def test_malformed_frame_closes_only_that_connection(
    silo: Silo, client: ClusterClient, data: bytes
) -> None:
    assert await client.get_grain(Echo, "other").echo(1) == 1
    raw = await Raw.open(silo)
    try:
        await raw.send(data)
        assert await raw.closed_by_peer()
    finally:
        raw.close()
    assert silo.transport.statistics().bad_frames == 1
    await assert_still_serving(client, silo)


def _tensor_ext(header: list[Any]) -> bytes:
    return msgpack.packb(msgpack.ExtType(8, msgpack.packb(header)))


@pytest.mark.parametrize(
    ("meta", "buffers", "message"),
    [
        pytest.param(_tensor_ext(["float32", [4], 0]), [b"\0" * 15], "needs 16 bytes", id="tensor-size-mismatch"),
        pytest.param(_tensor_ext(["no-such-dtype", [1], 0]), [b"\0" * 4], "unknown tensor dtype", id="tensor-dtype"),
        pytest.param(_tensor_ext(["float32", [1], 3]), [], "out of range", id="tensor-buffer-index"),
        pytest.param(msgpack.packb(msgpack.ExtType(77, b"")), [], "unknown ext type", id="unknown-ext-type"),
        pytest.param(msgpack.packb({"not": "args"}), [], "argument tuple", id="body-not-args"),
        pytest.param(b"\xc1", [], "malformed", id="body-not-msgpack"),
    ],
)
async def test_bad_request_body_gets_a_codec_error_and_the_connection_keeps_working(
    silo: Silo, client: ClusterClient, meta: bytes, buffers: list[bytes], message: str
) -> None:
    raw = await Raw.open(silo)
    try:
        body = meta if "argument tuple" in message or "malformed" in message else msgpack.packb(
            msgpack.ExtType(2, msgpack.packb([msgpack.unpackb(meta, ext_hook=msgpack.ExtType)]))
        )
        await raw.send(frame([REQUEST, 7, "Echo", "raw", "echo", 5000, [], 0], body, buffers))
        header, err_meta, bufs = await read_frame(raw.reader)
        assert header[:2] == [ERROR, 7]
        err = Codec().decode(err_meta, bufs)
        assert err["code"] == "codec" and message in err["message"], err
        await raw.send(request(8, "echo", ("after",)))
        header, meta2, bufs = await read_frame(raw.reader)
        assert header[:2] == [RESPONSE, 8] and Codec().decode(meta2, bufs) == "after"
    finally:
        raw.close()
    await assert_still_serving(client, silo)


async def test_frames_split_into_single_bytes_and_many_frames_per_packet_parse(silo: Silo) -> None:
    raw = await Raw.open(silo)
    try:
        one = request(1, "echo", (b"z" * 100_000,))  # a buffer big enough to go out of band
        for i in range(len(one)):
            raw.writer.write(one[i : i + 1])
            if i % 4096 == 0:
                await raw.writer.drain()
        await raw.send(b"".join(request(i, "echo", (i,)) for i in range(2, 200)))
        seen = {}
        for _ in range(199):
            header, meta, bufs = await read_frame(raw.reader)
            seen[header[1]] = Codec().decode(meta, bufs)
        assert seen[1] == b"z" * 100_000 and all(seen[i] == i for i in range(2, 200))
    finally:
        raw.close()


# --- the cluster-secret handshake ---------------------------------------------------------
@pytest.fixture
async def secret_silo(cluster: ClusterFactory) -> Silo:
    (s,) = await cluster(1, transport=TransportSettings(cluster_secret=SecretStr(SECRET)))
    return s


async def test_connection_that_skips_the_handshake_is_refused_and_counted(secret_silo: Silo) -> None:
    raw = await Raw.open(secret_silo)
    try:
        assert len(raw.nonce) == 16
        await raw.send(request(1, "echo", ("sneaky",)))
        assert await raw.closed_by_peer()
    finally:
        raw.close()
    assert secret_silo.transport.statistics().refused == 1


async def test_wrong_hmac_is_refused_and_counted(secret_silo: Silo) -> None:
    raw = await Raw.open(secret_silo)
    try:
        wrong = hmac.new(b"not the secret", raw.nonce, hashlib.sha256).digest()
        await raw.send(frame([AUTH, wrong]))
        assert await raw.closed_by_peer()
    finally:
        raw.close()
    assert secret_silo.transport.statistics().refused == 1


async def test_big_frame_before_authentication_is_refused(secret_silo: Silo) -> None:
    raw = await Raw.open(secret_silo)
    try:
        await raw.send(PREFIX.pack(1 << 16, 0, 0))  # over the pre-auth limit of 4 KiB
        assert await raw.closed_by_peer()
    finally:
        raw.close()
    assert secret_silo.transport.statistics().bad_frames == 1


async def test_right_hmac_is_accepted_and_calls_work(secret_silo: Silo) -> None:
    raw = await Raw.open(secret_silo)
    try:
        good = hmac.new(SECRET.encode(), raw.nonce, hashlib.sha256).digest()
        await raw.send(frame([AUTH, good]))
        header, _, _ = await read_frame(raw.reader)
        assert header[0] == AUTH_OK
        await raw.send(request(1, "echo", ("authenticated",)))
        header, meta, bufs = await read_frame(raw.reader)
        assert header[:2] == [RESPONSE, 1] and Codec().decode(meta, bufs) == "authenticated"
    finally:
        raw.close()
    assert secret_silo.transport.statistics().refused == 0


def test_prefix_layout_is_what_the_module_docstring_says() -> None:
    assert PREFIX.format == "<IIH" and BUFLEN.format == "<Q"
    assert struct.calcsize(PREFIX.format) == 10


async def test_received_tensors_start_on_64_byte_boundaries(silo: Silo, client: ClusterClient) -> None:
    import torch

    grain = client.get_grain(Echo, "aligned")
    for n in (1, 3, 1000, 70_000, 200_000):  # in the staging buffer, and received directly
        t = torch.arange(n, dtype=torch.float32)
        back = await grain.echo([(b"odd" * n)[: n % 7], t])  # an odd-sized part first
        assert back[1].data_ptr() % 64 == 0, n
        assert torch.equal(back[1], t)
