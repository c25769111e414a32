"""A private Redis Cluster on loopback for tests: N masters (and a replica each), all stopped on exit.

Every node is a ``redis-server --cluster-enabled yes`` on a free port of its
own (with room for the cluster bus at port + 10000), in a directory of its
own; ``redis-cli --cluster create`` assigns the slots::

    with RedisClusterGroup(tmp_path, masters=3, replicas=1) as group:
        client = connect_redis(group.url)          # redis+cluster://127.0.0.1:p1,...
        group.failover(group.masters()[0])         # CLUSTER FAILOVER on its replica
        group.kill(port)                           # SIGKILL one node

``start()`` returns once every node reports ``cluster_state:ok`` and sees
every other node, and every replica's link to its master is up.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import redis

from silo.errors import ConfigError
from silo.testing.embedded import RedisServer, free_port

__all__ = ["RedisClusterGroup", "find_redis_cli"]

_HOST = "127.0.0.1"
_BUS_OFFSET = 10_000
# Fast failure detection; a master waits 5 s by default before a diskless full sync.
_NODE_ARGS = ("--cluster-node-timeout", "2000", "--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0")


def find_redis_cli() -> str:
    """Path of ``redis-cli`` (it comes with redis-server; ``make deps`` installs it on Debian)."""
    found = shutil.which("redis-cli")
    if found is None:
        raise ConfigError("no redis-cli on PATH: install the redis-tools package (make deps does)")
    return found


def _port() -> int:
    return next(p for p in iter(free_port, 0) if p + _BUS_OFFSET < 65536)


class RedisClusterGroup:
    """``masters`` masters with ``replicas`` replicas each, slots spread evenly.

    :param data_dir: one sub-directory per node (log, nodes.conf).
    :param appendonly: AOF on every node.
    """

    def __init__(self, data_dir: str | Path, *, masters: int = 3, replicas: int = 0, appendonly: bool = False) -> None:
        if masters < 3:
            raise ConfigError("redis-cli --cluster create needs at least 3 masters")
        self.data_dir = Path(data_dir)
        self.n_masters = masters
        self.n_replicas = replicas
        self.appendonly = appendonly
        self.nodes: dict[int, RedisServer] = {}

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node that was started (the client finds the rest)."""
        return "redis+cluster://" + ",".join(f"{_HOST}:{p}" for p in self.nodes)

    def start(self, timeout_s: float = 60.0) -> Self:
        cli = find_redis_cli()
        try:
            for _ in range(self.n_masters * (1 + self.n_replicas)):
                self._start_node()
            create = [cli, "--cluster", "create", *(f"{_HOST}:{p}" for p in self.nodes)]
            create += ["--cluster-replicas", str(self.n_replicas), "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s, check=False)
            if done.returncode != 0:
                raise ConfigError(f"redis-cli --cluster create failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, attempts: int = 5) -> None:
        # A free port (and its bus port) may be taken by another process before the node
        # binds it: try another.
        for attempt in range(attempts):
            port = _port()
            node = RedisServer(
                port=port,
                data_dir=self.data_dir / f"node-{port}",
                appendonly=self.appendonly,
                extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *_NODE_ARGS),
            )
            try:
                node.start()
            except ConfigError:
                if attempt == attempts - 1:
                    raise
                continue
            self.nodes[port] = node
            return

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host=_HOST, port=port, socket_timeout=5.0, socket_connect_timeout=5.0)

    def wait_ok(self, timeout_s: float = 60.0, *, without: tuple[int, ...] = ()) -> None:
        """Until every running node (but ``without``) says ``cluster_state:ok`` and all slots are served."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            states = []
            for port, node in self.nodes.items():
                if port in without or not node.running:
                    continue
                try:
                    with self.client(port) as c:
                        info = c.execute_command("CLUSTER", "INFO")
                        text = info.decode() if isinstance(info, bytes) else str(info)
                        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
                        states.append(fields.get("cluster_state") == "ok" and fields.get("cluster_slots_ok") == "16384")
                        if c.info("replication").get("role") == "slave":
                            states.append(c.info("replication").get("master_link_status") == "up")
                except (redis.RedisError, OSError) as exc:
                    last = str(exc)
                    states.append(False)
            if states and all(states):
                return
            time.sleep(0.1)
        raise TimeoutError(f"Redis Cluster not ok within {timeout_s} s ({last})")

    def masters(self) -> list[int]:
        """Ports of the running masters."""
        return [p for p, n in self.nodes.items() if n.running and self._role(p) == "master"]

    def replica_of(self, master: int) -> int:
        """Port of a running replica of ``master``."""
        for port, node in self.nodes.items():
            if port != master and node.running:
                with self.client(port) as c:
                    rep = c.info("replication")
                if rep.get("role") == "slave" and int(rep.get("master_port", 0)) == master:
                    return port
        raise LookupError(f"no running replica of {master}")

    def failover(self, master: int, timeout_s: float = 30.0) -> int:
        """Promote a replica of ``master`` with ``CLUSTER FAILOVER`` (coordinated: no write lost).

        Returns the new master's port, once every node agrees and the cluster is ok.
        """
        replica = self.replica_of(master)
        with self.client(replica) as c:
            c.execute_command("CLUSTER", "FAILOVER")
        deadline = time.monotonic() + timeout_s
        while self._role(replica) != "master" or self._role(master) != "slave":
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica} of {master} not promoted within {timeout_s} s")
            time.sleep(0.05)
        self.wait_ok(timeout_s)
        return replica

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash)."""
        self.nodes[port].kill()

    def master_of(self, slot: int) -> int:
        """Port of the master serving hash ``slot`` (``CLUSTER SLOTS``)."""
        with self.client(self.masters()[0]) as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(master[1])
        raise LookupError(f"no master serves slot {slot}")

    def keys_per_master(self) -> dict[int, int]:
        """DBSIZE of each running master."""
        out = {}
        for port in self.masters():
            with self.client(port) as c:
                out[port] = int(c.dbsize())
        return out

    def _role(self, port: int) -> str:
        try:
            with self.client(port) as c:
                return str(c.info("replication").get("role"))
        except (redis.RedisError, OSError):
            return "down"

    def stop(self) -> None:
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                node.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
