"""A whole cluster on one machine: a private Redis plus silo subprocesses.

The one launcher of silo processes: ``redgrain demo``, the samples, the tests
and the benchmarks all start silos through :class:`LocalSilo`, alone or as a
:class:`LocalCluster`; also handy in a notebook::

    with LocalCluster(grains="samples.hello", silos=2) as lc:
        async with await ClusterClient.connect(lc.redis_url, cluster=lc.cluster) as client:
            ...

A silo is ``python -m silo --ready-file F ...`` (:mod:`silo.process`): the
silo writes its address to ``F`` once it is Active, so a start waits for that
file (there is nothing else to await across processes) and fails with the
tail of the silo's log when the process exits first or the file does not come
in time. :class:`SiloLaunch` says how the process is started (environment,
interpreter arguments such as ``-m cProfile``, a command prefix such as
``ip netns exec NS``, working directory, import path); :class:`LocalSilo`
owns one process's life (start, restart, signals, exit code, log).

Nothing outlives its owner. Each silo gets ``--parent-fd``: the read end of a
pipe whose write end only this process holds, so a silo whose launcher dies
(SIGKILL included) sees the pipe close and stops (``silo/process.py``); the
embedded Redis has a watcher of its own (``silo/testing/reaper.py``). SIGINT
to a script reaches ``with LocalCluster(...)``'s exit as KeyboardInterrupt, and
SIGTERM, which ends a Python process without running its ``finally`` blocks,
is covered by the pipes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from grains.ids import SiloAddress
from silo.testing.embedded import RedisServer


class SiloStartError(RuntimeError):
    """A silo process exited, or did not become Active in time; the message ends with its log."""


@dataclass(frozen=True)
class SiloLaunch:
    """How a silo process is started, apart from which cluster it joins.

    The command is ``[*prefix, python, *python_args, "-m", "silo", <silo args>, *extra_args]``.
    """

    env: Mapping[str, str] = field(default_factory=dict)
    """Added to the caller's environment (``REDGRAIN_*`` settings, thread counts)."""
    extra_args: Sequence[str] = ()
    """After the silo's own arguments: ``--host``, ``--cluster-secret-file`` and the like."""
    python_args: Sequence[str] = ()
    """Between the interpreter and ``-m silo``, e.g. ``("-m", "cProfile", "-o", "silo.prof")``."""
    prefix: Sequence[str] = ()
    """Before the interpreter, e.g. ``("ip", "netns", "exec", "ns1")``; it must exec the
    command, so that the pid signalled is the silo's."""
    cwd: Path | None = None
    """The process's working directory; ``None``: the caller's."""
    import_path: Sequence[str | Path] | None = None
    """Put first on ``PYTHONPATH`` so the silo imports the grain modules; ``None``: the
    caller's working directory (where a user's own grain modules usually are)."""

    def argv(self, silo_args: Sequence[str]) -> list[str]:
        return [*self.prefix, sys.executable, *self.python_args, "-m", "silo", *silo_args, *self.extra_args]

    def environ(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        first = self.import_path if self.import_path is not None else (os.getcwd(),)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*map(str, first), env.get("PYTHONPATH", "")) if p)
        return env


class LocalSilo:
    """One silo subprocess: started (again after it exited) with a ready file, signalled, its log kept.

    The log is ``workdir/NAME.log``, appended to by every start; :meth:`output`
    and :meth:`tail` read what the current run wrote.
    """

    def __init__(
        self,
        redis_url: str,
        cluster: str,
        grains: str,
        workdir: Path,
        *,
        name: str,
        roles: Sequence[str] = (),
        launch: SiloLaunch | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.cluster = cluster
        self.grains = grains
        self.workdir = workdir
        self.name = name
        self.roles = tuple(roles)
        self.launch = launch if launch is not None else SiloLaunch()
        self.proc: subprocess.Popen[bytes] | None = None
        self.address: SiloAddress | None = None
        """The current run's address once it was ready (the last run's until a restart is)."""
        self.log_path = workdir / f"{name}.log"
        self._log_from = 0
        self._lifeline: int | None = None
        """Our end of the pipe the silo watches (--parent-fd); closed once it has exited."""

    @property
    def _ready_path(self) -> Path:
        return self.workdir / f"{self.name}.ready"

    def start(self, timeout_s: float = 60.0) -> Self:
        """Start the process and wait until it is Active; also restarts one that has exited."""
        self.spawn()
        return self.wait_ready(timeout_s)

    def spawn(self) -> None:
        """Start the process without waiting for it (:meth:`wait_ready` does)."""
        if self.alive():
            raise SiloStartError(f"silo {self.name} is already running (pid {self.pid})")
        self._close_lifeline()
        ready = self._ready_path
        ready.unlink(missing_ok=True)
        # The silo watches the read end; only we hold the write end (os.pipe() makes
        # both non-inheritable; pass_fds lets exactly this one through).
        read_end, write_end = os.pipe()
        argv = self.launch.argv([
            "--redis", self.redis_url, "--cluster", self.cluster,
            "--grains", self.grains, "--ready-file", str(ready), "--parent-fd", str(read_end),
            *[a for r in self.roles for a in ("--role", r)],
        ])  # fmt: skip
        try:
            with open(self.log_path, "ab") as log:
                self._log_from = log.seek(0, os.SEEK_END)
                # Its own session: a Ctrl-C meant for the caller does not reach the silos
                # (they are stopped in order by stop()).
                self.proc = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.launch.environ(),
                    cwd=self.launch.cwd,
                    start_new_session=True,
                    pass_fds=(read_end,),
                )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._lifeline = write_end

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def wait_ready(self, timeout_s: float = 60.0) -> Self:
        """Wait until the process :meth:`spawn` started is Active (its ready file is there)."""
        assert self.proc is not None, f"silo {self.name} was never started"
        ready = self._ready_path
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while not ready.exists():
            if self.proc.poll() is not None:
                raise SiloStartError(f"silo {self.name} exited with code {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise SiloStartError(f"silo {self.name} not ready after {timeout_s:.0f}s:\n{self.tail()}")
            time.sleep(delay)  # another process: nothing to await but its ready file
            delay = min(delay * 2, 0.02)
        self.address = SiloAddress.parse(ready.read_text().strip())
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"silo {self.name} was never started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` if the process is running (a no-op once it has exited)."""
        if self.proc is not None and self.alive():
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the process vanishes without a goodbye (a crashed node)."""
        if self.proc is not None and self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if not self.alive():
            self._close_lifeline()

    def pause(self) -> None:
        """SIGSTOP: a hung node (it keeps its sockets but answers nothing)."""
        self.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self.send_signal(signal.SIGCONT)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (a graceful drain) and wait, SIGKILL if it does not exit in time.

        Returns the exit code (negative: the signal that ended it, ``-9`` when it
        had to be killed); ``None`` if it was never started.
        """
        if self.proc is None:
            return None
        self.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode
        self._close_lifeline()
        return code

    def wait(self, timeout_s: float) -> int:
        """Wait for the process to exit on its own; its exit code."""
        assert self.proc is not None, f"silo {self.name} was never started"
        code = self.proc.wait(timeout_s)
        self._close_lifeline()
        return code

    def output(self) -> str:
        """Everything the current run has logged."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_from)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output().splitlines()[-lines:])


class LocalCluster:
    """An embedded Redis (or ``redis_url``) and ``silos`` silo subprocesses, all stopped on exit.

    :param roles: per silo, in start order; silos past the end get none.
    :param launch: how every silo is started (see :class:`SiloLaunch`).
    :param persist: the embedded Redis keeps an append-only file in the data
        directory; ``False`` writes nothing to disk (as the benchmarks want).
    """

    def __init__(
        self,
        grains: str,
        *,
        silos: int = 2,
        cluster: str = "local",
        redis_url: str | None = None,
        data_dir: str | Path | None = None,
        roles: Sequence[Sequence[str]] = (),
        launch: SiloLaunch | None = None,
        persist: bool = True,
    ) -> None:
        self.grains = grains
        self.n = silos
        self.cluster = cluster
        self._redis_url = redis_url
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._roles = list(roles)
        self.launch = launch if launch is not None else SiloLaunch()
        self._persist = persist
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

    def start(self) -> Self:
        if self._data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="redgrain-")
        else:
            self._data_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self._redis_url is None:
                self.redis = RedisServer(
                    data_dir=self.workdir / "redis" if self._persist else None, appendonly=self._persist
                ).start()
            # All spawned, then all awaited: the silos' imports (torch) overlap.
            started = [self._new_silo() for _ in range(self.n)]
            for silo in started:
                silo.spawn()
            for silo in started:
                silo.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def add_silo(self, roles: Sequence[str] | None = None, timeout_s: float = 60.0) -> LocalSilo:
        """Start one more silo (named ``silo-N``, N its start order) and wait until it is Active."""
        return self._new_silo(roles).start(timeout_s)

    def _new_silo(self, roles: Sequence[str] | None = None) -> LocalSilo:
        i = len(self.silos)
        if roles is None:
            roles = self._roles[i] if i < len(self._roles) else ()
        silo = LocalSilo(
            self.redis_url, self.cluster, self.grains, self.workdir, name=f"silo-{i}", roles=roles, launch=self.launch
        )
        self.silos.append(silo)
        return silo

    def stop(self) -> None:
        # Every silo drains at once; then each is waited for (and killed if it lingers).
        for silo in self.silos:
            silo.send_signal(signal.SIGTERM)
        for silo in self.silos:
            silo.stop(timeout_s=15)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
