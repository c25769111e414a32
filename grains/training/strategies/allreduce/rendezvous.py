"""A ``torch.distributed.Store`` on the cluster's Redis: where an all-reduce group meets.

torch.distributed needs a key-value store for its rendezvous: every rank
publishes its gloo/NCCL address there and waits for the others'. This one
keeps the keys in the cluster's Redis under ``Keys.rendezvous(job,
generation)``, so each group generation meets under its own prefix and a
stale rank of an older generation can never join a newer group. Redis
outlives any one silo, unlike a TCPStore hosted by one of them (see
docs/decisions.md).

The store is synchronous (torch calls it from C++ on the thread that builds
the group), on its own redis-py connection pool. Blocking waits poll Redis
with a short backoff and give up at once when ``abandon`` is set, so a group
that the coordinator has already replaced never keeps a thread waiting for a
peer that will not come.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import redis
import torch.distributed as dist

from silo.errors import RedgrainError
from silo.redis_util import sync_twin

__all__ = ["GroupAbandonedError", "RedisStore", "sync_client_like"]


class GroupAbandonedError(RedgrainError):
    """The coordinator replaced this all-reduce group generation; whatever waited on it stops."""


# Rendezvous keys outlive a group only as garbage; Redis drops them after this.
_KEY_TTL_S = 3600
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.02

# compare_set in one step (torch's semantics: a missing key matches an empty expected value).
_COMPARE_SET = """
local cur = redis.call('GET', KEYS[1])
if (not cur and ARGV[1] == '') or (cur and cur == ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return ARGV[2]
end
if not cur then return ARGV[1] end
return cur
"""


def sync_client_like(client: Any, *, timeout_s: float = 5.0) -> redis.Redis:
    """A synchronous redis-py client to the same server, credentials and TLS as an asyncio one."""
    twin = sync_twin(client, timeout_s=timeout_s)  # a Sentinel master: its pool names no host
    if twin is not None:
        return twin
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs)
    name = pool.connection_class.__name__
    allowed = {"host", "port", "db", "username", "password", "path", "client_name"}
    conn: Any = redis.Connection
    if name == "SSLConnection":
        conn = redis.SSLConnection
        allowed |= {k for k in kwargs if k.startswith("ssl_")}
    elif name == "UnixDomainSocketConnection":
        conn = redis.UnixDomainSocketConnection
    kept = {k: v for k, v in kwargs.items() if k in allowed}
    if conn is not redis.UnixDomainSocketConnection:
        kept["socket_connect_timeout"] = timeout_s
    kept["socket_timeout"] = timeout_s
    return redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=conn, max_connections=8, **kept)
    )


class RedisStore(dist.Store):
    """torch's Store interface over Redis strings under ``prefix`` (one group generation)."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        timeout_s: float,
        abandon: threading.Event | None = None,
    ):
        super().__init__()
        self._r = client
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._abandon = abandon or threading.Event()
        self._compare_set = client.register_script(_COMPARE_SET)

    def _k(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        self._r.set(self._k(key), _bytes(value), ex=_KEY_TTL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._r.get(self._k(key))
        if value is None:  # deleted between the wait and the read
            raise KeyError(key)
        return value if isinstance(value, bytes) else str(value).encode()

    def add(self, key: str, amount: int) -> int:
        pipe = self._r.pipeline(transaction=True)
        pipe.incrby(self._k(key), amount)
        pipe.expire(self._k(key), _KEY_TTL_S)
        return int(pipe.execute()[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        out = self._compare_set(
            keys=[self._k(key)], args=[_bytes(expected), _bytes(desired), _KEY_TTL_S]
        )
        return out if isinstance(out, bytes) else str(out).encode()

    def check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        return int(self._r.exists(*(self._k(k) for k in keys))) == len(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout is not None else self._timeout_s
        deadline = time.monotonic() + limit
        delay = _POLL_MIN_S
        # Polling: rendezvous happens once per group generation, and a blocking Redis
        # primitive would need a second key per value and could not see `abandon`.
        while not self.check(keys):
            if self._abandon.is_set():
                raise GroupAbandonedError(
                    f"rendezvous under {self._prefix} abandoned: the group was replaced"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rendezvous under {self._prefix}: keys {keys} not set after {limit:.1f}s"
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def delete_key(self, key: str) -> bool:
        return bool(self._r.delete(self._k(key)))

    def num_keys(self) -> int:
        pattern = _glob_escape(self._prefix) + "*"
        return sum(1 for _ in self._r.scan_iter(match=pattern, count=1000))

    def clear(self) -> int:
        """Delete this generation's keys (once the group has formed, or was replaced)."""
        names = list(self._r.scan_iter(match=_glob_escape(self._prefix) + "*", count=1000))
        return int(self._r.delete(*names)) if names else 0


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)
