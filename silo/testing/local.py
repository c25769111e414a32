"""A whole cluster on one machine: a private Redis plus silo subprocesses.

Used by ``redgrain demo``, the samples and the benchmarks; also handy in a
notebook::

    with LocalCluster(grains="samples.hello", silos=2) as lc:
        async with await ClusterClient.connect(lc.redis_url, cluster=lc.cluster) as client:
            ...
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from grains.ids import SiloAddress
from silo import errors
from silo.testing.embedded import RedisServer


class LocalSilo:
    """One ``redgrain silo`` subprocess."""

    def __init__(
        self,
        redis_url: str,
        cluster: str,
        grains: str,
        workdir: Path,
        *,
        name: str,
        roles: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.redis_url = redis_url
        self.cluster = cluster
        self.grains = grains
        self.workdir = workdir
        self.name = name
        self.roles = tuple(roles)
        self.env = dict(env or {})
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.address: SiloAddress | None = None
        self.log_path = workdir / f"{name}.log"

    def start(self, timeout_s: float = 60.0) -> LocalSilo:
        ready = self.workdir / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "silo",
            "--redis", self.redis_url, "--cluster", self.cluster,
            "--grains", self.grains, "--ready-file", str(ready),
            *[a for r in self.roles for a in ("--role", r)],
            *self.extra_args,
        ]  # fmt: skip
        env = {**os.environ, **self.env}
        # Let the silo import grain modules from the caller's working directory.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while not ready.exists():
            if self.proc.poll() is not None:
                raise errors.ConfigError(
                    f"silo {self.name} exited with code {self.proc.returncode}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise errors.ConfigError(f"silo {self.name} not ready after {timeout_s:.0f}s:\n{self.tail()}")
            time.sleep(delay)  # another process: nothing to await but its ready file
            delay = min(delay * 2, 0.1)
        self.address = SiloAddress.parse(ready.read_text().strip())
        return self

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the process vanishes without a goodbye (a crashed node)."""
        if self.proc is not None and self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM: a graceful drain, then SIGKILL if it does not exit in time."""
        if self.proc is None or not self.alive:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


class LocalCluster:
    """An embedded Redis and ``silos`` silo subprocesses, all stopped on exit."""

    def __init__(
        self,
        grains: str,
        *,
        silos: int = 2,
        cluster: str = "local",
        redis_url: str | None = None,
        data_dir: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        roles: Sequence[Sequence[str]] = (),
    ) -> None:
        self.grains = grains
        self.n = silos
        self.cluster = cluster
        self._redis_url = redis_url
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._env = dict(env or {})
        self._roles = list(roles)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.redis: RedisServer | None = None
        self.silos: list[LocalSilo] = []

    @property
    def redis_url(self) -> str:
        if self._redis_url is not None:
            return self._redis_url
        assert self.redis is not None
        return self.redis.url

    @property
    def workdir(self) -> Path:
        if self._data_dir is not None:
            return self._data_dir
        assert self._tmp is not None
        return Path(self._tmp.name)

    def start(self) -> LocalCluster:
        if self._data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="redgrain-")
        else:
            self._data_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self._redis_url is None:
                self.redis = RedisServer(data_dir=self.workdir / "redis", appendonly=True).start()
            for i in range(self.n):
                self.add_silo()
        except BaseException:
            self.stop()
            raise
        return self

    def add_silo(self, roles: Sequence[str] | None = None) -> LocalSilo:
        i = len(self.silos)
        if roles is None:
            roles = self._roles[i] if i < len(self._roles) else ()
        silo = LocalSilo(
            self.redis_url, self.cluster, self.grains, self.workdir, name=f"silo-{i}", roles=roles, env=self._env
        )
        self.silos.append(silo)
        return silo.start()

    def stop(self) -> None:
        for silo in self.silos:
            if silo.alive and silo.proc is not None:
                silo.proc.send_signal(signal.SIGTERM)
        for silo in self.silos:
            silo.stop(timeout_s=15)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
