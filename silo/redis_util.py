"""Redis clients for every Redis-backed component: the one place a URL becomes a client.

:func:`connect_redis` (asyncio) and :func:`connect_redis_sync` (the heartbeat
thread, torch.distributed's store) take any URL :mod:`silo.redis_url` parses:
one server, or the master of a Sentinel service. A Sentinel client asks the
sentinels for the master before every new connection, and a connection that
breaks or meets a demoted master (``READONLY``) is dropped, so after a
failover the next command goes to the promoted replica (redis-py's
``SentinelConnectionPool``; ours blocks for a free connection like the plain
pool does).

Replication is asynchronous: a master can acknowledge a write and die before
any replica has it, and Sentinel then promotes a replica without it.
:func:`run_replicated` narrows that window for the writes that matter (a
directory registration, a state write): the script and a ``WAIT`` go in one
pipeline, on one connection (``WAIT`` counts only the writes of its own
connection), bounded by the URL's ``wait_timeout_ms``. A wait that runs out
does not fail the write (the replica may only be slow, or gone with no
failover possible); it is counted, and waiting pauses for a second so a
missing replica does not add the timeout to every write. A connection lost
before the ``WAIT`` answered fails the write: its fate is unknown, as for
any write whose reply was lost. A master with fewer online replicas than
``wait_replicas`` (``INFO replication``, read again every second while writes
go to it) is not waited on at all: a promoted replica has none until another
node syncs from it, and waiting out the timeout on every write for it was a
penalty that lasted as long as the shard had no replica. Every write
acknowledged with fewer replicas than asked is counted (``short_replication``
in :func:`redis_statistics`, ``redgrain_redis_short_replication_total`` on
/metrics). What this does and does not guarantee is in docs/reliability.md,
"Redis failover".

The plain and Sentinel pools block: a call that finds every connection in use
waits up to the socket timeout for one, and then fails with
:class:`PoolExhaustedError`, which callers report as "connection pool
exhausted", never as "Redis unreachable"; the waits are counted.

:func:`connect_redis` also takes a Redis Cluster (``redis+cluster://``): it
gives redis-py's asyncio ``RedisCluster`` (typed as ``aioredis.Redis``: the
commands redgrain uses have the same signatures; every multi-key command and
script names keys of one slot, ``silo/keys.py``). :func:`open_redis` is what
a silo and a client call: it connects, PINGs, and when a ``redis://`` URL
names a node with ``cluster_enabled:1`` it reconnects as a cluster client.
With ``wait_replicas`` on a cluster, the script and its ``WAIT`` go on one
connection to the master of the script's slot. The cluster client's
connections send ``ASKING`` on the connection of the command it is for
(:class:`_AskingConnection`; redis-py sends the two as separate pooled
commands), so a key of a migrating slot that has moved is reachable mid-move
(docs/cluster.md, "Resharding").

:func:`fence_epoch_hint` gives the directory's register script the highest
Sentinel configuration epoch this client has seen, so the fencing tokens of a
promoted master sort above every token of the masters before it (see
``silo/cluster/directory.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
import redis.exceptions
import redis.retry
import redis.sentinel
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript

from silo import errors
from silo.keys import warm_slot_tags
from silo.redis_url import (
    ClusterTarget,
    RedisTarget,
    SentinelTarget,
    cluster_of,
    parse_redis_url,
    redact,
)

__all__ = [
    "CLOSED_UNDER_US",
    "PoolExhaustedError",
    "RedisClientStatistics",
    "ReplicationStatistics",
    "close_redis",
    "closed_under_us",
    "connect_redis",
    "connect_redis_sync",
    "fence_epoch_hint",
    "is_cluster",
    "open_redis",
    "redis_errors",
    "redis_statistics",
    "replication_statistics",
    "run_replicated",
    "run_script_batch",
    "sync_twin",
    "verify_redis",
]

log = logging.getLogger("redgrain.redis")

_MAX_CONNECTIONS = 64
_CLUSTER_BATCH = 32
"""Scripts :func:`run_script_batch` runs again at once, routed one by one, on a cluster client."""
_CLUSTER_MAX_CONNECTIONS = 256
"""Per node. The cluster client fails a call past it (no blocking pool), so it is generous."""
_PAUSE_AFTER_SHORT_WAIT_S = 1.0
_REPLICAS_CHECK_S = 1.0
"""How long a master's count of connected replicas is trusted before it is read again."""
_SENTINEL_TIMEOUT_S = 1.0


CLOSED_UNDER_US = (AttributeError, RuntimeError)
"""The exception types :func:`closed_under_us` may recognise (catch these, then ask it)."""


def closed_under_us(exc: BaseException) -> bool:
    """A call on a connection redis-py closed as it was handed out: a lost connection.

    redis-py's asyncio cluster client, handling a failed node, disconnects that node's free
    connections while other calls may be taking one (seen during a master's failover and
    during resharding); the call then fails before (or while) it is sent: with an
    AttributeError on the closed stream under asyncio's loop, or with uvloop's
    ``RuntimeError: unable to perform operation on <TCPTransport closed=True ...>; the handler
    is closed``. Either way the connection is lost and the call's fate unknown, as for any
    lost reply.
    """
    if isinstance(exc, AttributeError):
        return "'NoneType' object has no attribute" in str(exc)
    return isinstance(exc, RuntimeError) and "handler is closed" in str(exc)


@contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Turn redis-py's errors into StorageError naming the operation."""
    try:
        yield
    except (PoolExhaustedError, redis.exceptions.MaxConnectionsError) as exc:
        raise errors.StorageError(f"{what}: Redis connection pool exhausted ({exc})") from exc
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        raise errors.StorageError(f"{what}: Redis unreachable ({exc})") from exc
    except CLOSED_UNDER_US as exc:
        if not closed_under_us(exc):
            raise
        raise errors.StorageError(f"{what}: Redis connection closed during the call ({exc})") from exc
    except redis.exceptions.RedisError as exc:
        raise errors.StorageError(f"{what}: Redis error ({exc})") from exc
    except redis.exceptions.RedisClusterException as exc:
        raise errors.StorageError(f"{what}: Redis Cluster not usable ({exc})") from exc


# --- replication waits ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicationStatistics:
    waits: int
    """Writes followed by a ``WAIT``."""
    short_waits: int
    """Waits that ran out before ``wait_replicas`` replicas had the write (it was kept anyway)."""
    skipped: int
    """Writes not waited for because a wait ran short less than a second before."""
    lost_replies: int
    """Writes whose ``WAIT`` reply never came (connection lost): failed, their fate unknown."""
    replica_less: int = 0
    """Writes not waited for because their master had fewer connected replicas than
    ``wait_replicas`` online (``INFO replication``, looked at again every second)."""
    replica_less_masters: int = 0
    """Masters seen with too few online replicas when last looked at."""

    @property
    def short_replication(self) -> int:
        """Writes acknowledged with fewer replicas than asked for: short waits and unwaited writes."""
        return self.short_waits + self.skipped + self.replica_less


class _Replication:
    """The URL's wait policy and its counters, carried by the client it belongs to.

    Per master ("" for the one master of a single server or Sentinel; on a Redis Cluster one
    shard that lost its replica must not stop the others' waits): a master whose ``INFO
    replication`` shows fewer online replicas than ``wait_replicas`` is not waited on (a
    promoted replica has none until another node syncs from it, and waiting the full timeout on
    every write for one that is not there was a lasting penalty after every failover). Looked
    at again every ``_REPLICAS_CHECK_S``. A wait that runs short on a master that does have its
    replicas (a slow link) pauses waiting there for ``_PAUSE_AFTER_SHORT_WAIT_S``.
    """

    def __init__(self, replicas: int, timeout_ms: int) -> None:
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self.clock: Callable[[], float] = time.monotonic
        """Injectable for tests."""
        self.paused_until: dict[str, float] = {}
        self._replica_less: dict[str, tuple[float, bool]] = {}
        self.waits = self.short_waits = self.skipped = self.lost_replies = self.replica_less = 0

    async def active(self, node: str, replicas_of: Callable[[], Awaitable[int | None]]) -> bool:
        """Wait for replicas after this write to ``node``? ``replicas_of`` counts its connected ones."""
        if self.replicas <= 0:
            return False
        now = self.clock()
        if now < self.paused_until.get(node, 0.0):
            self.skipped += 1
            return False
        seen = self._replica_less.get(node)
        if seen is None or now >= seen[0]:
            try:
                n = await replicas_of()
            except (redis.exceptions.RedisError, OSError, *CLOSED_UNDER_US) as exc:
                if isinstance(exc, CLOSED_UNDER_US) and not closed_under_us(exc):
                    raise
                n = None  # unknown (INFO denied to this ACL user, or a failing node): wait as asked
            less = n is not None and n < self.replicas
            if less and not (seen and seen[1]):
                log.warning(
                    "master %s has %d connected replica(s), fewer than wait_replicas=%d: writes to it are "
                    "not waited for until it has them (looked at every %.1f s)",
                    node or "(the one)", n, self.replicas, _REPLICAS_CHECK_S,
                )  # fmt: skip
            seen = (now + _REPLICAS_CHECK_S, less)
            self._replica_less[node] = seen
        if seen[1]:
            self.replica_less += 1
            return False
        return True

    def record(self, acked: int, node: str = "") -> None:
        self.waits += 1
        if acked < self.replicas:
            self.short_waits += 1
            # Look at the master's replicas before the next write: gone (a failover) or slow?
            self._replica_less.pop(node, None)
            self.paused_until[node] = self.clock() + _PAUSE_AFTER_SHORT_WAIT_S
            log.warning(
                "only %d of %d replicas acknowledged a write within %d ms; not waiting for %.0f s",
                acked, self.replicas, self.timeout_ms, _PAUSE_AFTER_SHORT_WAIT_S,
            )  # fmt: skip

    def statistics(self) -> ReplicationStatistics:
        less = sum(1 for _, flag in self._replica_less.values() if flag)
        return ReplicationStatistics(
            self.waits, self.short_waits, self.skipped, self.lost_replies, self.replica_less, less
        )


async def _connected_replicas(info: Awaitable[Any]) -> int | None:
    """Replicas an ``INFO replication`` reply shows online (None when it is not a master's).

    ``connected_slaves`` counts a replica still loading its first full sync too; ``WAIT``
    counts only one that streams (``slaveN: ... state=online``).
    """
    raw = await info
    if not isinstance(raw, dict) or raw.get("role") != "master":
        return None
    return sum(
        1 for k, v in raw.items() if k.startswith("slave") and k[5:].isdigit() and isinstance(v, dict) and v.get("state") == "online"
    )


class _EpochSentinel(Sentinel):
    """A Sentinel manager that remembers the highest configuration epoch it saw for a master."""

    config_epoch = 0

    def check_master_state(self, state: dict[str, Any], service_name: str) -> bool:
        ok = bool(super().check_master_state(state, service_name))
        if ok:
            self.config_epoch = max(self.config_epoch, int(state.get("config-epoch") or 0))
        return ok


class PoolExhaustedError(redis.exceptions.ConnectionError):
    """Every connection of the client's pool stayed in use for the whole wait (Redis may be fine:
    the process has more calls in flight than connections). :func:`redis_errors` and the state
    store report it as such, never as "Redis unreachable"."""


class _CountingPool:
    """Mixed into a blocking pool: counts the calls that found every connection in use and how
    long they waited, and names an exhausted pool for what it is.

    A caller that finds none free waits (redis-py's ``BlockingConnectionPool``) up to the pool's
    ``timeout`` (the client's socket timeout), then fails with :class:`PoolExhaustedError`.
    """

    max_connections: int
    timeout: float | None
    waits = 0
    exhausted = 0
    wait_s = 0.0

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        waited = not self.can_get_connection()  # type: ignore[attr-defined]  # the pool's own
        start = time.monotonic()
        if waited:
            self.waits += 1
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[misc]
        except redis.exceptions.ConnectionError as exc:
            if str(exc) != "No connection available.":
                raise
            self.exhausted += 1
            raise PoolExhaustedError(
                f"connection pool exhausted: all {self.max_connections} connections stayed in use "
                f"for {self.timeout} s"
            ) from exc
        finally:
            if waited:
                self.wait_s += time.monotonic() - start


class _BlockingPool(_CountingPool, aioredis.BlockingConnectionPool):
    """A pool that waits for a free connection instead of failing a burst of calls."""


class _BlockingSentinelPool(_CountingPool, SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A Sentinel pool that waits for a free connection instead of failing a burst of calls."""


@dataclass(frozen=True, slots=True)
class RedisClientStatistics:
    """A client's connection pool and its replica waits (the silo's ``redis`` statistics)."""

    pool_size: int
    """Connections the pool may open (``max_connections``; per node on a Redis Cluster)."""
    pool_in_use: int
    """Connections in use now (all nodes together on a Redis Cluster)."""
    pool_waits: int
    """Calls that found every connection in use and waited for one."""
    pool_wait_s: float
    """Seconds those calls waited, in total."""
    pool_exhausted: int
    """Calls that waited the whole pool timeout and failed (``connection pool exhausted``)."""
    replica_waits: int
    """Writes followed by a ``WAIT`` for replicas."""
    short_replication: int
    """Writes acknowledged with fewer replicas than ``wait_replicas`` (waits that ran short,
    and writes not waited for because their master had no replica or had just run short)."""
    replica_less_masters: int
    """Masters that had too few online replicas when last looked at (their writes are not waited for)."""


class RedgrainRedis(aioredis.Redis):
    """An asyncio client made by :func:`connect_redis`: it knows its URL and wait policy."""

    target: RedisTarget
    replication: _Replication
    sentinel_manager: _EpochSentinel | None


class RedgrainCluster(aiocluster.RedisCluster):
    """An asyncio Redis Cluster client made by :func:`connect_redis`."""

    target: RedisTarget
    replication: _Replication


_ASKING_FOR: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("redgrain_asking_for", default=None)
"""The node whose next command in this task must carry ``ASKING`` (see :class:`_AskingConnection`)."""


class _AskingConnection(aioredis.Connection):
    """Sends ``ASKING`` on the same connection as the command it is for.

    redis-py's asyncio cluster client answers an ``ASK`` redirection (a key of a migrating
    slot that has moved) with two pooled commands to the target, ``ASKING`` and then the
    command; its free list is first-in first-out, so with more than one idle connection they
    travel on different ones: the command, without the flag, meets ``MOVED`` back to the
    source, and the call loops until its redirections run out, failing for as long as the slot
    migrates (and a stray flag is left on another connection). Here ``ASKING`` alone is not
    sent: it is remembered for this task (the client sends the command right after it, in the
    same task) and goes out in front of that command on whichever connection carries it.
    """

    _fake_ok = False
    _ask_pending = False
    _ask_reply = False

    def pack_command(self, *args: Any) -> list[bytes]:
        if len(args) == 1 and str(args[0].decode() if isinstance(args[0], bytes) else args[0]).upper() == "ASKING":
            _ASKING_FOR.set((self.host, self.port))
            self._fake_ok = True
            return []
        target = _ASKING_FOR.get()
        if target is not None:
            _ASKING_FOR.set(None)
            self._ask_pending = target == (self.host, self.port)
        return super().pack_command(*args)

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._fake_ok and not command:
            return  # the remembered ASKING: nothing to send, nothing that can fail before its read
        if self._ask_pending:
            self._ask_pending = False
            # Connect (and its handshake, which reads replies of its own) before the flag is set.
            if not self.is_connected:
                await self.connect_check_health(check_health=False)
            if check_health:
                await self.check_health()
            check_health = False
            if isinstance(command, str):
                command = command.encode()
            command = [*super().pack_command("ASKING"), *([command] if isinstance(command, bytes) else command)]
            self._ask_reply = True
        try:
            await super().send_packed_command(command, check_health)
        except BaseException:
            self._ask_reply = False  # nothing of it will be read: the connection is dropped
            raise

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        if self._fake_ok:
            self._fake_ok = False
            return b"OK"
        if self._ask_reply:
            self._ask_reply = False
            # Both replies are read whatever the first was, so the stream stays in step.
            try:
                await super().read_response(*args, **kwargs)
            except redis.exceptions.ResponseError:
                pass  # the command's own reply says what went wrong
        return await super().read_response(*args, **kwargs)


class _AskingSSLConnection(_AskingConnection, aioredis.SSLConnection):
    """:class:`_AskingConnection` over TLS."""


def is_cluster(client: Any) -> bool:
    """Is ``client`` a Redis Cluster client (asyncio or sync)?"""
    return isinstance(client, (aiocluster.RedisCluster, redis.cluster.RedisCluster))


def connect_redis(url: str, *, timeout_s: float = 5.0) -> aioredis.Redis:
    """An asyncio Redis client with bounded timeouts (a hung Redis must not hang a silo).

    ``url`` is any URL :func:`silo.redis_url.parse_redis_url` accepts; a bad one
    raises ConfigError here, before anything connects.
    """
    return _connect(parse_redis_url(url), timeout_s)


def _connect(target: RedisTarget, timeout_s: float) -> aioredis.Redis:
    url = target.url
    if target.wait_replicas and target.wait_timeout_ms >= timeout_s * 1000:
        raise errors.ConfigError(
            f"wait_timeout_ms={target.wait_timeout_ms} in {redact(url)} must be below the socket timeout "
            f"({timeout_s * 1000:.0f} ms), or every WAIT that runs out would look like a dead Redis"
        )
    if target.cluster is not None:
        return _connect_cluster(target, target.cluster, timeout_s)
    sentinel: _EpochSentinel | None = None
    pool: aioredis.ConnectionPool
    if target.sentinel is not None:
        sentinel, pool = _sentinel_pool(target.sentinel, timeout_s)
    else:
        assert target.direct_url is not None
        # A blocking pool: a burst of calls waits for a connection instead of
        # failing with "Too many connections".
        pool = _BlockingPool.from_url(
            target.direct_url,
            max_connections=_MAX_CONNECTIONS,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
        )
    # redis-py 8 retries 10 times with backoff by default; a silo must notice
    # a dead Redis in bounded time, and storage does its own bounded retries.
    client = RedgrainRedis(connection_pool=pool, retry=Retry(NoBackoff(), 1))
    # The pool is this client's alone: aclose() must close its connections too (a
    # client given a pool leaves it open by default, leaking a socket per client).
    client.auto_close_connection_pool = True
    client.target = target
    client.replication = _Replication(target.wait_replicas, target.wait_timeout_ms)
    client.sentinel_manager = sentinel
    return client


def _connect_cluster(target: RedisTarget, cluster: ClusterTarget, timeout_s: float) -> aioredis.Redis:
    client = RedgrainCluster(
        startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in cluster.nodes],
        # The same bound as a single server: one retry, then the caller's own bounded retries.
        retry=Retry(NoBackoff(), 1),
        max_connections=_CLUSTER_MAX_CONNECTIONS,
        **_cluster_kwargs(cluster, timeout_s),
    )
    # Every node's connections, those of nodes found later too (the nodes manager builds them
    # from this same dict), send ASKING with the command it is for.
    asking = _AskingSSLConnection if cluster.tls else _AskingConnection
    client.connection_kwargs["connection_class"] = asking
    for node in client.startup_nodes:
        node.connection_class = asking
    client.target = target
    client.replication = _Replication(target.wait_replicas, target.wait_timeout_ms)
    # Duck-typed: the commands redgrain uses have the same signatures on both clients.
    return client  # type: ignore[return-value]


def _cluster_kwargs(cluster: ClusterTarget, timeout_s: float) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "username": cluster.username,
        "password": cluster.password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
    }
    opts: dict[str, Any] = dict(cluster.connection_options)
    if "ssl_check_hostname" in opts:
        opts["ssl_check_hostname"] = str(opts["ssl_check_hostname"]).lower() in ("1", "true", "yes")
    if cluster.tls:
        opts["ssl"] = True
    else:
        opts = {k: v for k, v in opts.items() if not k.startswith("ssl_")}
    kw.update(opts)
    return kw


async def open_redis(url: str, what: str, *, timeout_s: float = 5.0) -> aioredis.Redis:
    """Connect and check (:func:`verify_redis`); a ``redis://`` URL of a Redis Cluster node gives a cluster client.

    On failure the client is closed and the error (StorageError, ConfigError) raised.
    """
    target = parse_redis_url(url)
    client = _connect(target, timeout_s)
    try:
        if await verify_redis(client, what) and target.cluster is None:
            await close_redis(client)
            client = _connect(cluster_of(target), timeout_s)
            await verify_redis(client, what)
    except BaseException:
        await close_redis(client)
        raise
    if is_cluster(client):
        # The per-slot fencing keys need the slot -> tag table: built here, off the loop.
        await asyncio.to_thread(warm_slot_tags)
    return client


async def close_redis(client: aioredis.Redis) -> None:
    """Close a client from :func:`connect_redis` and its connections (either kind)."""
    if is_cluster(client):
        await client.aclose()
    else:
        await client.aclose(close_connection_pool=True)


def _sentinel_pool(target: SentinelTarget, timeout_s: float) -> tuple[_EpochSentinel, _BlockingSentinelPool]:
    sentinel = _EpochSentinel(
        list(target.sentinels),
        min_other_sentinels=target.min_other_sentinels,
        sentinel_kwargs=_sentinel_kwargs(target, timeout_s),
    )
    pool = _BlockingSentinelPool(
        target.service,
        sentinel,
        max_connections=_MAX_CONNECTIONS,
        timeout=timeout_s,
        is_master=True,
        **_node_kwargs(target, timeout_s),
    )
    return sentinel, pool


def _node_kwargs(target: SentinelTarget, timeout_s: float) -> dict[str, Any]:
    """Connection options for the master (the sentinels say where it is)."""
    kw: dict[str, Any] = {
        "db": target.db,
        "username": target.username,
        "password": target.password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 30,
    }
    kw.update(_tls_kwargs(target))
    return kw


def _sentinel_kwargs(target: SentinelTarget, timeout_s: float) -> dict[str, Any]:
    # Short: a dead sentinel is skipped for the next one, and a failover must be found fast.
    t = min(timeout_s, _SENTINEL_TIMEOUT_S)
    kw: dict[str, Any] = {"socket_timeout": t, "socket_connect_timeout": t}
    if target.sentinel_password is not None:
        kw["username"] = target.sentinel_username
        kw["password"] = target.sentinel_password
    kw.update(_tls_kwargs(target))
    return kw


def _tls_kwargs(target: SentinelTarget) -> dict[str, Any]:
    opts: dict[str, Any] = dict(target.connection_options)
    if "ssl_check_hostname" in opts:
        opts["ssl_check_hostname"] = str(opts["ssl_check_hostname"]).lower() in ("1", "true", "yes")
    if target.tls:
        opts["ssl"] = True
    else:
        opts = {k: v for k, v in opts.items() if not k.startswith("ssl_")}
    return opts


def connect_redis_sync(url: str, *, timeout_s: float = 5.0, max_connections: int = 8) -> redis.Redis:
    """A synchronous client to the same Redis (Sentinel master, Redis Cluster), for threads without a loop.

    A ``redis://`` URL is probed with ``INFO cluster`` (best effort: an unreachable or
    ACL-limited server gives the plain client) so a cluster node gets a cluster client.
    """
    target = parse_redis_url(url)
    if target.cluster is not None:
        return _connect_cluster_sync(target.cluster, timeout_s, max_connections)
    if target.sentinel is None:
        assert target.direct_url is not None
        plain = redis.Redis.from_url(
            target.direct_url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
        )
        try:
            clustered = int(plain.info("cluster").get("cluster_enabled", 0) or 0)
        except (redis.exceptions.RedisError, OSError):
            clustered = 0
        if not clustered:
            return plain
        plain.close()
        cluster = cluster_of(target).cluster
        assert cluster is not None
        return _connect_cluster_sync(cluster, timeout_s, max_connections)
    s = target.sentinel
    manager = redis.sentinel.Sentinel(
        list(s.sentinels),
        min_other_sentinels=s.min_other_sentinels,
        sentinel_kwargs=_sentinel_kwargs(s, timeout_s),
    )
    client: redis.Redis = manager.master_for(s.service, max_connections=max_connections, **_node_kwargs(s, timeout_s))
    return client


def _connect_cluster_sync(cluster: ClusterTarget, timeout_s: float, max_connections: int) -> redis.Redis:
    client = redis.cluster.RedisCluster(
        startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in cluster.nodes],
        retry=redis.retry.Retry(NoBackoff(), 1),
        max_connections=max_connections,
        **_cluster_kwargs(cluster, timeout_s),
    )
    return client  # type: ignore[return-value]


def sync_twin(client: aioredis.Redis, *, timeout_s: float = 5.0) -> redis.Redis | None:
    """A synchronous client to the Sentinel master ``client`` follows; None for any other client.

    (A single server's sync twin can be built from the pool's connection options; a
    Sentinel pool's options name no host, so it is built again from the URL.)
    """
    if isinstance(client, RedgrainRedis) and client.target.sentinel is not None:
        return connect_redis_sync(client.target.url, timeout_s=timeout_s)
    if isinstance(client, RedgrainCluster):
        return connect_redis_sync(client.target.url, timeout_s=timeout_s)
    return None


# --- what a write does on a client from connect_redis -------------------------------


async def run_replicated(
    client: aioredis.Redis, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
) -> Any:
    """Run a write script; when the URL asks for replicas, ``WAIT`` for them on the same connection.

    Returns the script's result. Clients not made by :func:`connect_redis`, and URLs
    with ``wait_replicas=0``, run the script alone.
    """
    policy = client.replication if isinstance(client, (RedgrainRedis, RedgrainCluster)) else None
    if policy is None or policy.replicas <= 0:
        return await script(keys=keys, args=args)
    if isinstance(client, RedgrainCluster):
        return await _run_replicated_on_node(client, policy, script, keys, args)
    if not await policy.active("", lambda: _connected_replicas(client.info("replication"))):
        return await script(keys=keys, args=args)
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        pipe.wait(policy.replicas, policy.timeout_ms)
        try:
            result, acked = await pipe.execute()
        except redis.exceptions.NoScriptError:
            # A promoted replica has none of the scripts its old master had loaded.
            if attempt:
                raise
            script.sha = await client.script_load(script.script)
            continue
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            policy.lost_replies += 1
            raise
        finally:
            await pipe.reset()
        policy.record(int(acked))
        return result
    raise AssertionError("unreachable")


async def _run_replicated_on_node(
    client: RedgrainCluster, policy: _Replication, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
) -> Any:
    """The script and its WAIT on one connection to the master of the script's slot.

    A moved slot (MOVED, a failover under way) or a node without the script falls back
    to the cluster client's own routing, unwaited (counted as skipped).
    """
    await client.initialize()
    node = client.get_node_from_key(keys[0])
    if node is None:  # no master known yet: the client's own routing
        return await script(keys=keys, args=args)
    if not await policy.active(node.name, lambda: _connected_replicas(node.execute_command("INFO", "replication"))):
        return await script(keys=keys, args=args)  # no replica there, or its waits paused
    conn = node.acquire_connection()
    try:
        await conn.send_packed_command(
            conn.pack_commands([("EVALSHA", script.sha, len(keys), *keys, *args), ("WAIT", policy.replicas, policy.timeout_ms)])
        )
        first: Any = None
        failed: redis.exceptions.ResponseError | None = None
        try:
            first = await conn.read_response()
        except redis.exceptions.ResponseError as exc:  # both replies are read, whatever the first was
            failed = exc
        acked = await conn.read_response()
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError, *CLOSED_UNDER_US) as exc:
        if isinstance(exc, CLOSED_UNDER_US) and not closed_under_us(exc):
            raise
        policy.lost_replies += 1
        await conn.disconnect()
        # This path bypasses the client's routing, so it flags the node as the client's own
        # command path does: the next call (``initialize()`` above) reads the slot map again,
        # where a dead master's replica may be serving the slot by now.
        node.update_active_connections_for_reconnect()
        client.nodes_manager.move_node_to_end_of_cached_nodes(node.name)
        client._initialize = True
        if isinstance(exc, CLOSED_UNDER_US):
            raise redis.exceptions.ConnectionError(f"connection to {node.name} closed under us") from exc
        raise
    finally:
        node.release(conn)
    if failed is not None:
        redirected = isinstance(failed, (redis.exceptions.NoScriptError, redis.exceptions.MovedError, redis.exceptions.AskError))
        if not redirected and not str(failed).startswith(("MOVED", "ASK", "NOSCRIPT", "TRYAGAIN", "CLUSTERDOWN")):
            raise failed
        policy.skipped += 1  # not run there: the client routes it, unwaited
        return await script(keys=keys, args=args)
    policy.record(int(acked), node.name)
    return first


async def run_script_batch(client: aioredis.Redis, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> list[Any]:
    """Run one script many times, pipelined (not atomic together: each call is its own script).

    redis-py's cluster pipeline refuses scripts, so on a cluster the calls are grouped by the
    master of their first key and each group goes as one pipeline on one connection to it,
    the groups at once; a call that meets a redirection (a slot moving), ``NOSCRIPT`` or
    ``TRYAGAIN`` there, or whose connection failed, runs again routed by the client. So each
    script must be safe to run twice (the purge's compare-and-delete is). Returns each call's
    result, in order.
    """
    if not calls:
        return []
    if is_cluster(client):
        return await _run_script_batch_per_node(client, script, calls)
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        try:
            return list(await pipe.execute())
        except redis.exceptions.NoScriptError:
            if attempt:
                raise
            script.sha = await client.script_load(script.script)
        finally:
            await pipe.reset()
    raise AssertionError("unreachable")


async def _run_script_batch_per_node(
    client: Any, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]
) -> list[Any]:
    await client.initialize()
    groups: dict[str, tuple[Any, list[int]]] = {}
    again: list[int] = []
    for i, (keys, _) in enumerate(calls):
        node = client.get_node_from_key(keys[0])
        if node is None:
            again.append(i)
        else:
            groups.setdefault(node.name, (node, []))[1].append(i)
    out: list[Any] = [None] * len(calls)

    async def on_node(node: Any, idx: list[int]) -> None:
        for attempt in range(2):
            missing = await _pipeline_on_node(node, script, calls, idx, out, again)
            if not missing or attempt:
                again.extend(missing)
                return
            # A node that has not seen the script yet (a new master, a first purge): load it there.
            await node.execute_command("SCRIPT", "LOAD", script.script)
            idx = missing

    await asyncio.gather(*(on_node(node, idx) for node, idx in groups.values()))
    for start in range(0, len(again), _CLUSTER_BATCH):
        part = sorted(again)[start : start + _CLUSTER_BATCH]
        for i, res in zip(part, await asyncio.gather(*(script(keys=calls[i][0], args=calls[i][1]) for i in part)), strict=True):
            out[i] = res
    return out


async def _pipeline_on_node(
    node: Any, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]], idx: list[int],
    out: list[Any], again: list[int],
) -> list[int]:
    """The calls ``idx`` as one pipeline on one connection to ``node``; results into ``out``,
    calls to run again routed into ``again``. Returns the calls the node had no script for."""
    conn = node.acquire_connection()
    read = 0
    noscript: list[int] = []
    try:
        await conn.send_packed_command(
            conn.pack_commands([("EVALSHA", script.sha, len(calls[i][0]), *calls[i][0], *calls[i][1]) for i in idx])
        )
        for i in idx:
            try:
                out[i] = await conn.read_response()
            except redis.exceptions.NoScriptError:
                noscript.append(i)
            except redis.exceptions.ResponseError:
                again.append(i)  # MOVED, ASK, TRYAGAIN, or the script's own error: routed by the client
            read += 1
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError, *CLOSED_UNDER_US) as exc:
        if isinstance(exc, CLOSED_UNDER_US) and not closed_under_us(exc):
            raise
        await conn.disconnect()  # replies left unread: the connection cannot be reused
        again.extend(idx[read:])
    finally:
        node.release(conn)
    return noscript


def redis_statistics(client: aioredis.Redis) -> RedisClientStatistics:
    """The pool and replica-wait figures of a client (zeros where a client has none of them)."""
    rep = replication_statistics(client)
    size = in_use = waits = exhausted = 0
    wait_s = 0.0
    if is_cluster(client):
        size = int(getattr(client, "max_connections", 0) or _CLUSTER_MAX_CONNECTIONS)
        for node in client.get_nodes():  # type: ignore[attr-defined]
            # redis-py keeps no public count: every connection opened less the free ones.
            in_use += len(getattr(node, "_connections", ())) - len(getattr(node, "_free", ()))
    else:
        pool = client.connection_pool
        size = int(getattr(pool, "max_connections", 0) or 0)
        in_use = len(getattr(pool, "_in_use_connections", ()))
        if isinstance(pool, _CountingPool):
            waits, exhausted, wait_s = pool.waits, pool.exhausted, pool.wait_s
    return RedisClientStatistics(
        pool_size=size,
        pool_in_use=in_use,
        pool_waits=waits,
        pool_wait_s=round(wait_s, 6),
        pool_exhausted=exhausted,
        replica_waits=rep.waits if rep else 0,
        short_replication=rep.short_replication if rep else 0,
        replica_less_masters=rep.replica_less_masters if rep else 0,
    )


def replication_statistics(client: aioredis.Redis) -> ReplicationStatistics | None:
    """The wait counters of a client from :func:`connect_redis` (None for any other client)."""
    return client.replication.statistics() if isinstance(client, (RedgrainRedis, RedgrainCluster)) else None


def fence_epoch_hint(client: aioredis.Redis) -> int:
    """The highest Sentinel configuration epoch this client has seen (0 without Sentinel)."""
    if isinstance(client, RedgrainRedis) and client.sentinel_manager is not None:
        return client.sentinel_manager.config_epoch
    return 0


async def verify_redis(client: aioredis.Redis, what: str) -> bool:
    """PING; True if the server is a Redis Cluster node (``INFO cluster``: ``cluster_enabled:1``).

    A cluster client learns the slot map first (StorageError when no node answers). An
    ACL user denied INFO is taken as not clustered (a Cluster node then fails on its
    first MOVED).
    """
    with redis_errors(what):
        if is_cluster(client):
            await client.initialize()  # type: ignore[attr-defined]
            await client.ping()
            return True
        await client.ping()
        try:
            info = await client.info("cluster")
        except redis.exceptions.NoPermissionError:
            return False
    return bool(int(info.get("cluster_enabled", 0) or 0))
