"""A Redis Sentinel group on loopback for tests: one master, replicas, sentinels, all private.

Every process is a ``redis-server`` (sentinels run as ``redis-server conf
--sentinel``) on a free port of its own, so nothing touches a Redis the
machine may run::

    with SentinelGroup(tmp_path) as group:
        client = connect_redis(group.url)      # redis+sentinel://127.0.0.1:p1,.../rgmaster
        killed = group.kill_master()           # SIGKILL, as a crash
        group.wait_failover(killed)            # the sentinels promoted a replica
        group.restart(killed)                  # comes back; the sentinels make it a replica

``start()`` returns once every replica's link to the master is up and every
sentinel sees the replicas and the other sentinels, so a failover can happen
from the first moment a test runs.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis

from silo.errors import ConfigError
from silo.testing.embedded import Lifeline, RedisServer, find_redis_server, free_port, reap

__all__ = ["Failover", "SentinelGroup"]

_HOST = "127.0.0.1"
# A master waits 5 s by default before a diskless full sync (for more replicas to join it).
_NODE_ARGS = ("--repl-diskless-sync-delay", "0")


@dataclass(frozen=True, slots=True)
class Failover:
    """A promotion the sentinels agreed on."""

    old_port: int
    new_port: int
    config_epoch: int
    seconds: float
    """From ``wait_failover``'s start (or the kill it was given) until every sentinel named the new master."""


class SentinelGroup:
    """``replicas`` + 1 Redis nodes and ``sentinels`` sentinels watching service ``service``.

    :param data_dir: one sub-directory per node and sentinel (logs, AOF, sentinel config).
    :param down_after_ms: the sentinels' ``down-after-milliseconds``.
    :param failover_timeout_ms: their ``failover-timeout`` (also paces repeated failovers).
    :param appendonly: AOF on every node (``appendfsync everysec``), so a killed node restarts with its data.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        replicas: int = 1,
        sentinels: int = 3,
        service: str = "rgmaster",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 4000,
        appendonly: bool = True,
    ) -> None:
        if replicas < 1 or sentinels < 1:
            raise ConfigError("a SentinelGroup needs at least one replica and one sentinel")
        self.dir = Path(data_dir)
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.quorum = sentinels // 2 + 1
        self.nodes = [
            RedisServer(data_dir=self.dir / f"node{i}", appendonly=appendonly, extra_args=_NODE_ARGS)
            for i in range(replicas + 1)
        ]
        self.sentinel_ports = [free_port(_HOST) for _ in range(sentinels)]
        self._sentinels: list[subprocess.Popen[bytes] | None] = [None] * sentinels
        self._finalizers: list[weakref.finalize] = []

    # --- addresses -------------------------------------------------------------

    @property
    def url(self) -> str:
        hosts = ",".join(f"{_HOST}:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}"

    def node(self, port: int) -> RedisServer:
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError(port)

    def master_port(self) -> int:
        """The master's port, as the first sentinel that answers names it."""
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError, OSError):
                addr = self._ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                if addr:
                    return int(addr[1])
        raise ConfigError("no sentinel answered")

    def config_epoch(self) -> int:
        """The highest configuration epoch any sentinel reports for the master."""
        best = 0
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError, OSError):
                best = max(best, int(self._master_state(port).get("config-epoch", 0)))
        return best

    # --- lifecycle ---------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> Self:
        deadline = time.monotonic() + timeout_s
        master, *replicas = self.nodes
        master.start()
        for r in replicas:
            r.extra_args = (*_NODE_ARGS, "--replicaof", _HOST, str(master.port))
            r.start()
        self._wait(deadline, "replicas in sync", lambda: all(self._link_up(r) for r in replicas))
        for i in range(len(self.sentinel_ports)):
            self._start_sentinel(i, master.port)
        want_replicas = len(replicas)
        want_peers = len(self.sentinel_ports) - 1

        def ready() -> bool:
            for port in self.sentinel_ports:
                state = self._master_state(port)
                if int(state.get("num-slaves", 0)) < want_replicas:
                    return False
                if int(state.get("num-other-sentinels", 0)) < want_peers:
                    return False
            return True

        self._wait(deadline, "sentinels to see the replicas and each other", ready)
        return self

    def stop(self) -> None:
        for f in self._finalizers:
            f()
        self._finalizers.clear()
        self._sentinels = [None] * len(self._sentinels)
        for n in self.nodes:
            n.stop()

    def kill_master(self) -> int:
        """SIGKILL the current master; returns its port."""
        port = self.master_port()
        self.node(port).kill()
        return port

    def restart(self, port: int) -> None:
        """Start a killed node again (same port and data) as a replica of the current master.

        The sentinels would demote a returning old master themselves, but only after their
        next look at it (up to 10 s); starting it as a replica is what an operator's
        supervisor does anyway, and the next failover can follow sooner.
        """
        node = self.node(port)
        master = self.master_port()
        node.extra_args = (*_NODE_ARGS, "--replicaof", _HOST, str(master)) if master != port else _NODE_ARGS
        node.start()

    def wait_failover(self, old_port: int, timeout_s: float = 30.0, *, since: float | None = None) -> Failover:
        """Wait until every sentinel names a master other than ``old_port`` and it says it is master."""
        start = since if since is not None else time.monotonic()
        deadline = time.monotonic() + timeout_s
        found: dict[str, int] = {}

        def promoted() -> bool:
            ports = set()
            for port in self.sentinel_ports:
                try:
                    addr = self._ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                except (redis.RedisError, OSError):
                    return False
                ports.add(int(addr[1]))
            if len(ports) != 1 or old_port in ports:
                return False
            (new,) = ports
            try:
                role = self._ask(new, "ROLE")
            except (redis.RedisError, OSError):
                return False
            if role[0] not in (b"master", "master"):
                return False
            found["port"] = new
            return True

        self._wait(deadline, f"a failover away from port {old_port}", promoted)
        return Failover(old_port, found["port"], self.config_epoch(), round(time.monotonic() - start, 2))

    def wait_replicas_synced(self, timeout_s: float = 30.0) -> None:
        """Wait until every node but the master is its replica with the link up."""
        deadline = time.monotonic() + timeout_s

        def synced() -> bool:
            try:
                master = self.master_port()
            except ConfigError:
                return False
            others = [n for n in self.nodes if n.port != master]
            return all(n.running and self._link_up(n, master) for n in others)

        self._wait(deadline, "every replica in sync", synced)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- internals ------------------------------------------------------------------

    def _start_sentinel(self, i: int, master_port: int) -> None:
        port = self.sentinel_ports[i]
        directory = self.dir / f"sentinel{i}"
        directory.mkdir(parents=True, exist_ok=True)
        conf = directory / "sentinel.conf"
        s = self.service
        conf.write_text(
            "\n".join(
                [
                    f"port {port}",
                    f"bind {_HOST}",
                    "daemonize no",
                    "protected-mode no",
                    f"dir {directory}",
                    f"sentinel monitor {s} {_HOST} {master_port} {self.quorum}",
                    f"sentinel down-after-milliseconds {s} {self.down_after_ms}",
                    f"sentinel failover-timeout {s} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {s} 1",
                    "",
                ]
            )
        )
        with open(directory / "sentinel.log", "ab") as log:
            proc = subprocess.Popen(
                [find_redis_server(), str(conf), "--sentinel"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        self._sentinels[i] = proc
        # The watcher stops the sentinel if this process dies unclean (SIGKILL, a CI timeout),
        # when no finalizer runs: it would live on, orphaned, as RedisServer's nodes would.
        self._finalizers.append(weakref.finalize(self, reap, proc, Lifeline(proc)))
        deadline = time.monotonic() + 10.0

        def answers() -> bool:
            if proc.poll() is not None:
                raise ConfigError(f"redis-server --sentinel exited with {proc.returncode}; see {directory}/sentinel.log")
            return bool(self._ask(port, "PING"))

        self._wait(deadline, f"sentinel on port {port}", answers)

    def _master_state(self, port: int) -> dict[str, Any]:
        with self._client(port) as client:
            state = client.sentinel_master(self.service)
        assert isinstance(state, dict)
        return state

    def _link_up(self, node: RedisServer, master_port: int | None = None) -> bool:
        with self._client(node.port) as client:
            fields = client.info("replication")
        if fields.get("role") != "slave" or fields.get("master_link_status") != "up":
            return False
        return master_port is None or int(fields.get("master_port", 0)) == master_port

    @staticmethod
    @contextlib.contextmanager
    def _client(port: int) -> Iterator[redis.Redis]:
        client = redis.Redis(host=_HOST, port=port, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            yield client
        finally:
            client.close()

    def _ask(self, port: int, *command: str) -> Any:
        with self._client(port) as client:
            return client.execute_command(*command)

    @staticmethod
    def _wait(deadline: float, what: str, ready: Any) -> None:
        while True:
            try:
                if ready():
                    return
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.05)
