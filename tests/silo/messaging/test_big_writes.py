"""A big argument leaves the caller as the buffer it is, on asyncio's own loop as on uvloop's.

Python 3.11's transports inherit ``writelines()`` from ``WriteTransport``, which joins the
parts into one ``bytes``: a frame's header and its 1 MB buffer were copied whole on every
call from a client on asyncio's loop (a quarter of a 1 MB echo's CPU there).
"""

from __future__ import annotations

import asyncio
from typing import Any

from silo.client import ClusterClient
from tests.sample_grains import Echo

MB = 1 << 20


async def test_a_big_argument_is_written_without_a_copy_on_asyncios_loop(cluster: Any, client: ClusterClient) -> None:
    await cluster(1)
    echo = client.get_grain(Echo, "big")
    assert await echo.echo(b"warm") == b"warm"
    [conn] = [c for c in client.transport._out.values() if not c.closed]
    transport = conn._transport
    # The test loop is asyncio's: the kind of transport that joins what writelines() is given.
    assert type(transport).writelines is asyncio.WriteTransport.writelines, type(transport)
    seen: list[tuple[str, list[Any]]] = []
    write, writelines = transport.write, transport.writelines
    transport.write = lambda data: (seen.append(("write", [data])), write(data))[1]  # type: ignore[method-assign]
    transport.writelines = lambda parts: (seen.append(("writelines", list(parts))), writelines(parts))[1]  # type: ignore[method-assign]
    try:
        payload = b"y" * MB
        assert await echo.echo(payload) == payload
    finally:
        del transport.write, transport.writelines
    joined = [kind for kind, parts in seen if kind == "writelines" and any(len(p) >= 64 * 1024 for p in parts)]
    assert not joined, seen
    big = [p for _, parts in seen for p in parts if len(p) >= MB]
    # The caller's own bytes, by reference: no copy of it was made on the way to the socket.
    assert len(big) == 1 and isinstance(big[0], memoryview) and big[0].obj is payload, [type(p) for p in big]


async def test_big_arguments_queued_behind_a_huge_one_are_written_without_a_copy(
    cluster: Any, client: ClusterClient
) -> None:
    # A buffer over 1 MB is written in slices by a task; what is queued meanwhile (a frame's
    # header and a 512 KB buffer, then another huge one) goes out when it is done.
    await cluster(1)
    echo = client.get_grain(Echo, "queued")
    assert await echo.echo(b"warm") == b"warm"
    [conn] = [c for c in client.transport._out.values() if not c.closed]
    transport = conn._transport
    seen: list[tuple[str, list[Any]]] = []
    write, writelines = transport.write, transport.writelines
    transport.write = lambda data: (seen.append(("write", [data])), write(data))[1]  # type: ignore[method-assign]
    transport.writelines = lambda parts: (seen.append(("writelines", list(parts))), writelines(parts))[1]  # type: ignore[method-assign]
    try:
        payloads = [b"a" * (3 * MB), b"b" * (MB // 2), b"c" * (2 * MB), b"d" * (MB // 2)]
        assert await asyncio.gather(*(echo.echo(p) for p in payloads)) == payloads
    finally:
        del transport.write, transport.writelines
    joined = [kind for kind, parts in seen if kind == "writelines" and any(len(p) >= 64 * 1024 for p in parts)]
    assert not joined, [(k, [len(p) for p in parts]) for k, parts in seen]
    # Each payload left by reference: whole (up to 1 MB) or as slices of itself.
    sources = {id(p.obj) for _, parts in seen for p in parts if isinstance(p, memoryview)}
    assert {id(p) for p in payloads} <= sources
