"""Hostile frames against a live silo process: it answers errors or closes, never crashes or leaks.

One silo subprocess serves the whole module. Every hypothesis example opens
a raw connection, reads the HELLO, sends its bad input, then a PING: the silo
must answer (ERROR frames, then the PONG) or close the connection. After each
test a normal client call must still work and the process must be alive.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Iterator

import msgpack
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from silo.client import ClusterClient
from silo.testing.embedded import RedisServer
from tests.conftest import FAST_ENV
from tests.fuzz.wire import (
    BUFLEN,
    ERROR,
    PING,
    PONG,
    PREFIX,
    REQUEST,
    RESPONSE,
    RawPeer,
    frame,
    pack,
    request,
)
from tests.helpers import SiloProcess
from tests.sample_grains import Echo

CLUSTER = "fuzz"
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.fixture(scope="module")
def silo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SiloProcess]:
    workdir = tmp_path_factory.mktemp("fuzz")
    with RedisServer() as server:
        # A small frame limit so "oversized" is cheap to reach.
        env = {**FAST_ENV, "REDGRAIN_TRANSPORT__MAX_FRAME_BYTES": str(1 << 20)}
        proc = SiloProcess(server.url, CLUSTER, workdir, env=env).start(timeout_s=120)
        proc.redis_url = server.url
        try:
            yield proc
        finally:
            proc.kill()


@pytest.fixture
async def client(silo: SiloProcess) -> AsyncIterator[ClusterClient]:
    c = await ClusterClient.connect(silo.redis_url, cluster=CLUSTER)
    yield c
    # The silo survived the batch and still serves real calls.
    assert silo.alive(), silo.output()[-3000:]
    assert await c.get_grain(Echo, "after").echo([1, "two"]) == [1, "two"]
    await c.close()


def _endpoint(silo: SiloProcess) -> str:
    assert silo.address is not None
    return silo.address.endpoint


def _send_then_ping(silo: SiloProcess, data: bytes, *, complete: bool = True) -> None:
    """Send ``data``; if it was a whole frame, a PING must get its PONG unless the silo closed."""
    peer = RawPeer(_endpoint(silo))
    try:
        if not peer.send(data) or not complete:
            return
        if not peer.send(frame(pack([PING, 424242]))):
            return
        for _ in range(64):
            header = peer.read_frame()
            if header is None:
                return  # closed: an allowed answer to a bad frame
            if header[0] == PONG and header[1:] == [424242]:
                return
            # ERROR answers bad requests, PONG a fuzzed PING, RESPONSE a request that happened to be valid.
            assert header[0] in (ERROR, PONG, RESPONSE), f"unexpected answer {header!r}"
        raise AssertionError("no PONG after 64 frames")
    finally:
        peer.close()


_junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)


@FUZZ
@given(
    header=st.lists(_junk, min_size=0, max_size=10),
    kind=st.sampled_from([REQUEST, 3, 4, 5, 6, 7, 8, 9, 10, 11, 99, -1]),
)
def test_headers_with_wrong_types_get_errors_or_a_closed_connection(
    silo: SiloProcess, client: ClusterClient, header: list[object], kind: int
) -> None:
    _send_then_ping(silo, frame(pack([kind, *header])))


@FUZZ
@given(header=_junk)
def test_headers_that_are_not_lists_close_the_connection(
    silo: SiloProcess, client: ClusterClient, header: object
) -> None:
    _send_then_ping(silo, frame(pack(header)))


@FUZZ
@given(header=st.binary(max_size=64), meta=st.binary(max_size=64))
def test_bad_msgpack_in_header_or_meta(
    silo: SiloProcess, client: ClusterClient, header: bytes, meta: bytes
) -> None:
    _send_then_ping(silo, frame(header, meta))
    _send_then_ping(silo, request(1, "Echo", "k", "echo", meta))


@FUZZ
@given(data=st.binary(min_size=1, max_size=200), cut=st.integers(min_value=0, max_value=199))
def test_truncated_frames(silo: SiloProcess, client: ClusterClient, data: bytes, cut: int) -> None:
    whole = request(7, "Echo", "k", "echo", pack([data]))
    _send_then_ping(silo, whole[: min(cut, len(whole) - 1)], complete=False)


@FUZZ
@given(
    hlen=st.integers(0, 2**32 - 1),
    mlen=st.integers(0, 2**32 - 1),
    lens=st.lists(st.integers(0, 2**64 - 1), max_size=8),
    nbuf_lie=st.integers(0, 2**16 - 1),
)
def test_oversized_or_lying_length_prefixes(
    silo: SiloProcess, client: ClusterClient, hlen: int, mlen: int, lens: list[int], nbuf_lie: int
) -> None:
    data = (
        PREFIX.pack(hlen, mlen, nbuf_lie) + b"".join(BUFLEN.pack(n) for n in lens) + b"\x91\x01" * 8
    )
    _send_then_ping(silo, data, complete=False)
    # A frame that declares more than max_frame_bytes must be refused outright.
    peer = RawPeer(_endpoint(silo))
    try:
        peer.send(
            frame(
                pack([REQUEST, 1, "Echo", "k", "echo", 5000, [], 0]), b"", declared=[(1 << 20) + 1]
            )
        )
        assert peer.closed_by_peer(), "an oversized frame was not refused"
    finally:
        peer.close()


_dtypes = st.sampled_from(
    [
        "float32",
        "int64",
        "uint8",
        "bool",
        "bfloat16",
        "complex128",
        "object",
        "<f4",
        "|O",
        "",
        "nope",
    ]
)
_shape = st.lists(st.integers(-(2**40), 2**40), max_size=4) | _junk


@FUZZ
@given(
    code=st.sampled_from([7, 8, 9]),
    dtype=_dtypes,
    shape=_shape,
    index=st.integers(-3, 5) | _junk,
    buffers=st.lists(st.binary(max_size=64), max_size=3),
    declared_extra=st.integers(0, 64),
)
def test_tensor_headers_with_mismatched_sizes(
    silo: SiloProcess,
    client: ClusterClient,
    code: int,
    dtype: str,
    shape: object,
    index: object,
    buffers: list[bytes],
    declared_extra: int,
) -> None:
    ext_body = pack(index) if code == 7 else pack([dtype, shape, index])
    meta = pack([msgpack.ExtType(code, ext_body)])
    header = pack([REQUEST, 3, "Echo", "k", "echo", 5000, [], 0])
    _send_then_ping(silo, frame(header, meta, buffers))
    if buffers:
        # The declared buffer sizes lie about what follows.
        declared = [len(b) + declared_extra for b in buffers]
        _send_then_ping(
            silo, frame(header, meta, buffers, declared=declared), complete=declared_extra == 0
        )


@FUZZ
@given(
    type_name=st.sampled_from(["Echo", "Counter", "Nope", "os:system", "$silo", ""]) | _junk,
    method=st.sampled_from(["echo", "add", "sleep", "__init__", "_private", "activate", "state"])
    | _junk,
    body=_junk,
    ext=st.lists(st.tuples(st.integers(0, 127), st.binary(max_size=16)), max_size=3),
)
def test_valid_looking_requests_with_garbage_bodies(
    silo: SiloProcess,
    client: ClusterClient,
    type_name: object,
    method: object,
    body: object,
    ext: list[tuple[int, bytes]],
) -> None:
    meta = pack([body, *[msgpack.ExtType(c, b) for c, b in ext]])
    _send_then_ping(silo, request(5, type_name, "k", method, meta, timeout_ms=200))


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


async def test_100k_bad_frames_do_not_grow_the_silos_memory(
    silo: SiloProcess, client: ClusterClient
) -> None:
    """Bad requests on kept-open connections (answered with errors) plus connection-closing junk."""
    endpoint = _endpoint(silo)
    garbage = [
        request(1, "Nope", "k", "x", pack([1])),  # unknown type
        request(2, "Echo", "k", "nope", pack([1])),  # unknown method
        request(3, "Echo", "k", "echo", b"\xc1"),  # bad msgpack body
        request(4, "Echo", "k", "echo", pack({"not": "a tuple"})),  # wrong body type
        request(
            5, "Echo", "k", "echo", pack([msgpack.ExtType(8, pack(["float32", [1 << 20], 0]))])
        ),  # tensor, no buffer
    ]
    batch = b"".join(garbage) * 200  # 1000 bad frames per write

    async def burst(frames: int) -> None:
        sent = 0
        reader, writer = await asyncio.open_connection(*endpoint.rsplit(":", 1))
        try:
            await _read_one_frame(reader)  # HELLO
            while sent < frames:
                writer.write(batch)
                await writer.drain()
                sent += 1000
                for _ in range(1000):  # every bad request gets its ERROR back
                    header = await _read_one_frame(reader)
                    assert header is not None and header[0] == ERROR, header
        finally:
            writer.close()

    async def closers(n: int) -> None:
        for _ in range(n):
            _, writer = await asyncio.open_connection(*endpoint.rsplit(":", 1))
            writer.write(frame(b"\xc1\xc1", b"") * 5)  # bad msgpack: the silo drops the connection
            writer.close()

    pid = silo.pid
    await asyncio.gather(burst(5_000), closers(100))  # warm-up: allocator pools, caches
    before = _rss(pid)
    for _ in range(3):
        await asyncio.gather(burst(30_000), burst(3_000), closers(300))
    after = _rss(pid)
    growth_mb = (after - before) / 1e6
    print(
        f"\nRSS before {before / 1e6:.1f} MB, after 99k bad frames + 900 bad connections {after / 1e6:.1f} MB"
    )
    assert growth_mb < 25, f"silo RSS grew by {growth_mb:.1f} MB over ~100k bad frames"


async def _read_one_frame(reader: asyncio.StreamReader) -> list[object] | None:
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError:
        return None
    hlen, mlen, nbuf = PREFIX.unpack(prefix)
    lens = [BUFLEN.unpack(await reader.readexactly(BUFLEN.size))[0] for _ in range(nbuf)]
    header = msgpack.unpackb(await reader.readexactly(hlen))
    await reader.readexactly(mlen + sum(lens))
    return header  # type: ignore[no-any-return]


def test_wire_helpers_round_trip() -> None:
    data = frame(pack([REQUEST, 1]), b"m", [b"abc"])
    hlen, mlen, nbuf = PREFIX.unpack_from(data)
    assert (hlen, mlen, nbuf) == (3, 1, 1) and struct.unpack_from("<Q", data, PREFIX.size)[0] == 3
