"""Small helpers shared by tests (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

from silo.testing.embedded import free_port as _free_port


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    return _free_port(host)


import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grains.ids import SiloAddress

REPO = Path(__file__).resolve().parent.parent


class SiloProcess:
    """A real ``redgrain silo`` subprocess you can SIGKILL, SIGSTOP or SIGTERM."""

    def __init__(
        self,
        redis_url: str,
        cluster: str,
        workdir: Path,
        *,
        grains: str = "tests.sample_grains",
        roles: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.redis_url = redis_url
        self.cluster = cluster
        self.workdir = workdir
        self.grains = grains
        self.roles = roles
        self.env = env or {}
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.address: SiloAddress | None = None
        self._n = 0

    def start(self, timeout_s: float = 30.0) -> SiloProcess:
        self._n += 1
        ready = self.workdir / f"silo-{id(self)}-{self._n}.ready"
        log = self.workdir / f"silo-{id(self)}-{self._n}.log"
        self.log_path = log
        cmd = [
            sys.executable, "-m", "silo",
            "--redis", self.redis_url, "--cluster", self.cluster,
            "--grains", self.grains, "--ready-file", str(ready),
            *[a for r in self.roles for a in ("--role", r)],
            *self.extra_args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"silo exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"silo not ready after {timeout_s}s:\n{log.read_text()[-3000:]}")
            time.sleep(delay)  # polling a readiness file; there is no event to await across processes
            delay = min(delay * 2, 0.1)
        self.address = SiloAddress.parse(ready.read_text().strip())
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful drain) and wait; returns the exit code."""
        assert self.proc is not None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")
