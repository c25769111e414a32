"""Small helpers shared by every Redis-backed component."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis.asyncio as aioredis
import redis.exceptions

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
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=30,
        retry_on_timeout=False,
    )
