"""Small helpers shared by every Redis-backed component."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from silo import errors


@contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Turn redis-py's errors into StorageError naming the operation."""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        raise errors.StorageError(f"{what}: Redis unreachable ({exc})") from exc
    except redis.exceptions.RedisError as exc:
        raise errors.StorageError(f"{what}: Redis error ({exc})") from exc


def connect_redis(url: str, *, timeout_s: float = 5.0) -> aioredis.Redis:
    """An asyncio Redis client with bounded timeouts (a hung Redis must not hang a silo)."""
    # A blocking pool: a burst of calls waits for a connection instead of
    # failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=64,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=30,
    )
    # redis-py 8 retries 10 times with backoff by default; a silo must notice
    # a dead Redis in bounded time, and storage does its own bounded retries.
    client = aioredis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 1))
    # The pool is this client's alone: aclose() must close its connections too (a
    # client given a pool leaves it open by default, leaking a socket per client).
    client.auto_close_connection_pool = True
    return client
