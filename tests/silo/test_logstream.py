"""The log stream handler: records reach Redis, by level, capped, tagged by context, never recursing."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from silo.keys import Keys
from silo.logstream import LogStream
from silo.records.logs import LogEntry, read_logs
from silo.redis_util import connect_redis
from silo.settings import LogStreamSettings
from silo.testing.embedded import RedisServer

_names = itertools.count()


async def until(check: Callable[[], Awaitable[Any]], timeout_s: float = 10.0) -> Any:
    """Poll ``check()`` until truthy: the writer runs on its own schedule, in this loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
def logger() -> logging.Logger:
    """A logger of the test's own (not the root), at DEBUG, so only the handler's level filters."""
    lg = logging.getLogger(f"redgrain.test.logstream{next(_names)}")
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    return lg


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect_redis(redis_url)
    yield client
    await client.aclose(close_connection_pool=True)


async def entries(redis: aioredis.Redis, keys: Keys) -> list[LogEntry]:
    found, _ = await read_logs(redis, keys, limit=2000)
    return found


def stream(redis: aioredis.Redis, keys: Keys, logger: logging.Logger, silo: str = "s1", **kw: Any) -> LogStream:
    s = LogStream(redis, keys, lambda: silo, LogStreamSettings(**kw), flush_interval_s=0.05)
    s.install(logger)
    return s


async def test_a_warning_reaches_the_stream_with_its_silo_logger_and_traceback(
    redis: aioredis.Redis, logger: logging.Logger, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    s = stream(redis, keys, logger, silo="127.0.0.1:7000@1")
    logger.warning("disk %s is %d%% full", "/data", 93)
    try:
        raise ValueError("bad shard")
    except ValueError:
        logger.exception("shard failed")
    found = await until(lambda: _at_least(redis, keys, 2))
    warn, err = found
    assert (warn.level, warn.logger, warn.message, warn.silo, warn.exc) == (
        "WARNING", logger.name, "disk /data is 93% full", "127.0.0.1:7000@1", ""
    )
    assert err.level == "ERROR" and "ValueError: bad shard" in err.exc and "Traceback" in err.exc
    assert abs(warn.time - time.time()) < 5
    await s.stop()
    assert s.statistics().published == 2 and s.statistics().dropped == 0
    logger.warning("after stop")
    assert len(await entries(redis, keys)) == 2  # detached: nothing more is taken


async def _at_least(redis: aioredis.Redis, keys: Keys, n: int) -> list[LogEntry] | None:
    found = await entries(redis, keys)
    return found if len(found) >= n else None


async def test_info_is_published_only_when_the_level_asks_for_it(
    redis: aioredis.Redis, logger: logging.Logger, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    s = stream(redis, keys, logger)
    logger.info("quiet")
    logger.debug("quieter")
    logger.warning("loud")
    (only,) = await until(lambda: _at_least(redis, keys, 1))  # in order: the info would be first
    assert only.message == "loud"
    await s.stop()

    keys = Keys(cluster_name + "-info")
    s = stream(redis, keys, logger, level="INFO")
    logger.debug("quieter")
    logger.info("quiet")
    logger.warning("loud")
    found = await until(lambda: _at_least(redis, keys, 2))
    assert [(e.level, e.message) for e in found] == [("INFO", "quiet"), ("WARNING", "loud")]
    await s.stop()


async def test_the_stream_is_capped_at_about_max_len(
    redis: aioredis.Redis, logger: logging.Logger, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    s = stream(redis, keys, logger, max_len=100, queue=5000)
    for i in range(1000):
        logger.warning("n%d", i)
    await until(lambda: _published(s, 1000))
    length = await redis.xlen(keys.logs)
    assert 100 <= length <= 200  # MAXLEN ~ trims whole stream nodes (100 entries each)
    newest, _ = await read_logs(redis, keys, limit=1)
    assert newest[0].message == "n999"
    await s.stop()


async def _published(s: LogStream, n: int) -> bool:
    return s.statistics().published >= n


async def test_a_full_queue_drops_the_oldest_and_counts_them(
    redis: aioredis.Redis, logger: logging.Logger, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    s = stream(redis, keys, logger, queue=10)
    for i in range(25):  # no await: the writer cannot run in between
        logger.warning("n%d", i)
    assert (s.statistics().pending, s.statistics().dropped) == (10, 15)
    found = await until(lambda: _at_least(redis, keys, 10))
    assert [e.message for e in found] == [f"n{i}" for i in range(15, 25)]
    await s.stop()


async def test_records_go_to_the_stream_of_the_context_that_logged_them(
    redis: aioredis.Redis, logger: logging.Logger, cluster_name: str
) -> None:
    """Two silos' streams in one process: each takes its own tasks' records; a thread's go to the first."""
    keys = Keys(cluster_name)
    streams: dict[str, LogStream] = {}
    ready = {name: asyncio.Event() for name in ("A", "B")}
    go = asyncio.Event()

    async def silo(name: str) -> None:
        streams[name] = stream(redis, keys, logger, silo=name)
        ready[name].set()
        await go.wait()

        async def child() -> None:
            logger.warning("from a task of %s", name)  # a task made later inherits the silo

        await asyncio.get_running_loop().create_task(child())

    loop = asyncio.get_running_loop()
    tasks = []
    for name in ("A", "B"):  # each silo starts in a context of its own, as in a test process
        tasks.append(loop.create_task(silo(name), context=contextvars.Context()))
        await ready[name].wait()
    go.set()
    await asyncio.gather(*tasks)
    thread = threading.Thread(target=lambda: logger.warning("from a bare thread"))
    thread.start()
    thread.join()
    found = await until(lambda: _at_least(redis, keys, 3))
    assert sorted((e.silo, e.message) for e in found) == [
        ("A", "from a bare thread"), ("A", "from a task of A"), ("B", "from a task of B")
    ]  # fmt: skip
    for s in streams.values():
        await s.stop()


async def test_with_redis_down_logging_neither_blocks_nor_recurses_and_recovers(
    fresh_redis: RedisServer, logger: logging.Logger, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    client = connect_redis(fresh_redis.url, timeout_s=0.5)
    inner = logging.getLogger(logger.name + ".redis")  # under the handler's logger: would feed it
    real_pipeline = client.pipeline

    def logging_pipeline(*args: Any, **kw: Any) -> Any:
        inner.warning("the redis client speaking from inside the writer")
        return real_pipeline(*args, **kw)

    client.pipeline = logging_pipeline  # type: ignore[method-assign]
    s = stream(client, keys, logger)
    try:
        logger.warning("before")
        await until(lambda: _published(s, 1))
        fresh_redis.kill()
        t0 = time.perf_counter()
        for i in range(500):
            logger.warning("while down %d", i)
        assert time.perf_counter() - t0 < 0.5  # emit is an append, whatever Redis does
        await until(lambda: _failed(s))
        assert s.statistics().pending <= LogStreamSettings().queue

        fresh_redis.start()
        logger.warning("after")
        found = await until(lambda: _has(client, keys, "after"), timeout_s=15)
        messages = [e.message for e in found]
        assert not any("inside the writer" in m for m in messages)  # never taken: no recursion
        stats = s.statistics()
        assert stats.write_failures >= 1 and stats.dropped >= 1
    finally:
        await s.stop()
        await client.aclose(close_connection_pool=True)


async def _failed(s: LogStream) -> bool:
    return s.statistics().write_failures > 0


async def _has(redis: aioredis.Redis, keys: Keys, message: str) -> list[LogEntry] | None:
    try:
        found = await entries(redis, keys)
    except Exception:  # noqa: BLE001 - Redis still coming back
        return None
    return found if any(e.message == message for e in found) else None
