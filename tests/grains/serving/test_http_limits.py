"""The HTTP front's read deadlines and connection cap, against slow and idle clients, beside a canary.

The server is the front's uvicorn (``make_server``) around a two-line ASGI app:
what is tested is the connection handling, not the inference routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from grains.serving.http import make_server
from grains.serving.settings import HttpLimits
from tests.helpers import free_port


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body") or message["type"] != "http.request":
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % (len(body) + 2))]})
    await send({"type": "http.response.body", "body": b"ok" + body})


@asynccontextmanager
async def front(limits: HttpLimits) -> AsyncIterator[int]:
    port = free_port()
    server = make_server(app, port=port, limits=limits)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), task
        await asyncio.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes = b"") -> bytes:
    writer.write(b"POST / HTTP/1.1\r\nhost: test\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    return await asyncio.wait_for(reader.readexactly(len(body) + 2), 10)


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (read to its end)."""
    try:
        return await asyncio.wait_for(reader.read(), 30) == b""
    except ConnectionError:
        return True


async def test_slowloris_connections_are_closed_by_the_header_timeout_while_a_canary_is_served():
    slow_n = 300
    async with front(HttpLimits(header_timeout_s=1.0, max_connections=slow_n + 10)) as port:
        canary = await asyncio.open_connection("127.0.0.1", port)
        answered = 0

        async def slowloris() -> bool:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nhost: test\r\n")
            ended = asyncio.ensure_future(closed(reader))
            try:
                while not ended.done():  # one more header line now and then, never the blank line
                    writer.write(b"x-slow: 1\r\n")
                    await asyncio.wait([ended], timeout=0.25)
                return ended.result()
            finally:
                writer.close()

        attack = asyncio.gather(*(slowloris() for _ in range(slow_n)))
        while not attack.done():
            assert await get(*canary, b"alive") == b"okalive"
            answered += 1
            await asyncio.wait([attack], timeout=0.05)
        assert attack.result() == [True] * slow_n
        assert answered > 0
        assert await get(*canary) == b"ok"  # its keep-alive connection was never cut
        canary[1].close()


async def test_a_body_that_stops_arriving_is_closed_by_the_body_timeout():
    async with front(HttpLimits(body_timeout_s=0.5)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nhost: test\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        assert await closed(reader)
        writer.close()


async def test_connections_over_the_cap_are_closed_and_those_within_it_served():
    async with front(HttpLimits(max_connections=2)) as port:
        kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        assert await get(*kept[0]) == b"ok" and await get(*kept[1]) == b"ok"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed(reader)
        writer.close()
        assert await get(*kept[0], b"still") == b"okstill"
        for _, w in kept:
            w.close()


async def test_a_request_head_over_the_limit_is_answered_431_and_closed_while_others_are_served():
    async with front(HttpLimits(max_header_bytes=16 << 10)) as port:
        canary = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: test\r\n")
        for _ in range(64):  # 1 MiB of headers, the blank line never sent
            writer.write(b"x-big: " + b"y" * (16 << 10) + b"\r\n")
            try:
                await writer.drain()
            except ConnectionError:
                break
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
        # A head within the limit, with a body larger than it, is served.
        assert await get(*canary, b"z" * (64 << 10)) == b"ok" + b"z" * (64 << 10)
        canary[1].close()
