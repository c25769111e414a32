"""A redgrain cluster whose processes live on separate network hosts (namespaces).

:class:`NetCluster` runs a real ``redis-server`` in the ``redis`` host, real
silo processes in ``s1``..``sN`` (each bound to its own address, started by the
shared launcher :class:`silo.testing.local.LocalSilo` behind ``ip netns exec``),
client workloads as processes in ``cl``, and optionally a slow/lossy relay in
``px`` that every link goes through (see :mod:`tests.netns.proxy`). The test
process reads Redis and calls silos over the observer link, which no fault
touches. :meth:`NetCluster.stop` kills every process it started; the network
itself is torn down by its owner (:class:`tests.netns.net.Network`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from grains.ids import SiloAddress
from silo.testing.local import LocalSilo, SiloLaunch
from tests.netns.net import Host, Network

REPO = Path(__file__).absolute().parents[2]
REDIS_PORT = 6379


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


class Process:
    """A process started inside a host's namespace (``ip netns exec`` execs it: same pid)."""

    def __init__(self, host: Host, argv: list[str], log: Path, env: Mapping[str, str]) -> None:
        self.host = host
        self.log_path = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                host.argv(*argv), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=REPO
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        _kill(self.proc)

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def output(self) -> str:
        return _tail(self.log_path, 1 << 20)


@dataclass
class NetSilo:
    host: Host
    process: LocalSilo
    address: SiloAddress
    started_at: float

    def alive(self) -> bool:
        return self.process.alive()


@dataclass
class Workload:
    """A client workload process (tests/netns/workload.py) and its record file."""

    process: Process
    out: Path
    stop_file: Path
    _seen: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)

    def read(self) -> list[dict[str, Any]]:
        """Every record written so far (re-reads only what is new)."""
        try:
            with open(self.out) as f:
                f.seek(self._seen)
                chunk = f.read()
        except FileNotFoundError:
            return self.records
        done = chunk.rfind("\n") + 1
        self._seen += done
        self.records += [json.loads(line) for line in chunk[:done].splitlines() if line]
        return self.records

    def ends(self) -> list[dict[str, Any]]:
        return [r for r in self.read() if r.get("ev") == "end"]

    def stop(self, timeout_s: float = 30.0) -> None:
        self.stop_file.write_text("stop")
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        self.read()


class NetCluster:
    """Redis, silos and clients on the hosts of ``net`` (see module docstring)."""

    def __init__(
        self,
        net: Network,
        workdir: Path,
        cluster: str,
        *,
        grains: str = "tests.netns.grains",
        env: Mapping[str, str] | None = None,
        redis_url: str,
        observer_redis_url: str,
        advertise: Mapping[str, str] | None = None,
    ) -> None:
        self.net = net
        self.workdir = workdir
        self.cluster = cluster
        self.grains = grains
        self.env = dict(env or {})
        self.redis_url = redis_url
        """Redis as silos and clients reach it (directly, or through the relay)."""
        self.observer_redis_url = observer_redis_url
        self.advertise = dict(advertise or {})
        """Host name -> address its silo advertises (a relay's), when not its own."""
        self.silos: list[NetSilo] = []
        self.processes: list[Process | LocalSilo] = []
        self._n = 0

    def _log(self, name: str) -> Path:
        self._n += 1
        return self.workdir / f"{self._n:02d}-{name}.log"

    def start_silo(self, host: Host, *, port: int = 0, timeout_s: float = 60.0) -> NetSilo:
        """A silo in ``host``'s namespace, bound to its address (the shared launcher, prefixed
        with ``ip netns exec``, which execs it: the pid signalled is the silo's)."""
        extra = ["--host", host.address]
        if port:
            extra += ["--port", str(port)]
        if host.name in self.advertise:
            extra += ["--advertise-host", self.advertise[host.name]]
        self._n += 1
        proc = LocalSilo(
            self.redis_url, self.cluster, self.grains, self.workdir, name=f"{self._n:02d}-silo-{host.name}",
            launch=SiloLaunch(env=self.env, extra_args=extra, prefix=host.argv(), cwd=REPO, import_path=(REPO,)),
        )  # fmt: skip
        self.processes.append(proc)
        proc.start(timeout_s)
        assert proc.address is not None
        silo = NetSilo(host, proc, proc.address, time.monotonic())
        self.silos.append(silo)
        return silo

    def start_silos(self, hosts: list[Host], ports: Mapping[str, int] | None = None) -> list[NetSilo]:
        """Start several silos at once (each start is mostly the interpreter's import time)."""
        from concurrent.futures import ThreadPoolExecutor

        ports = ports or {}
        with ThreadPoolExecutor(len(hosts)) as pool:
            return list(pool.map(lambda h: self.start_silo(h, port=ports.get(h.name, 0)), hosts))

    def start_workload(self, host: Host, name: str, *args: str) -> Workload:
        out = self.workdir / f"{name}.jsonl"
        stop = self.workdir / f"{name}.stop"
        stop.unlink(missing_ok=True)
        argv = [
            sys.executable, "-m", "tests.netns.workload", "--redis", self.redis_url,
            "--cluster", self.cluster, "--out", str(out), "--stop-file", str(stop), *args,
        ]  # fmt: skip
        proc = Process(host, argv, self._log(f"client-{name}"), {"PYTHONPATH": str(REPO)})
        self.processes.append(proc)
        w = Workload(proc, out, stop)
        deadline = time.monotonic() + 30
        while not any(r.get("ev") == "ready" for r in w.read()):
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"workload {name} did not start:\n{proc.output()[-3000:]}")
            time.sleep(0.05)  # another process: its first record is the only signal
        return w

    def redis(self) -> redis.Redis:
        """A client of Redis over the observer link (never cut)."""
        return redis.Redis.from_url(self.observer_redis_url, socket_timeout=5, socket_connect_timeout=5)

    def stop(self) -> None:
        for p in self.processes:
            p.kill()


def start_redis(host: Host, workdir: Path, observer_url: str) -> Process:
    """A real redis-server bound to ``host``'s address, no persistence (each test uses its own cluster)."""
    log = workdir / "redis.log"
    argv = [
        "redis-server", "--bind", host.address, "--port", str(REDIS_PORT), "--save", "",
        "--appendonly", "no", "--protected-mode", "no", "--dir", str(workdir),
    ]  # fmt: skip
    proc = Process(host, argv, log, {})
    client = redis.Redis.from_url(observer_url, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    try:
        while True:
            try:
                client.ping()
                return proc
            except redis.RedisError:
                if not proc.alive() or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"redis-server did not start:\n{_tail(log)}") from None
                time.sleep(0.05)  # another process: nothing to await but its port
    finally:
        client.close()
