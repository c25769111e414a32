"""Nothing outlives what started it: `redgrain demo`, `redgrain silo` and LocalCluster scripts.

Each test starts the command as a subprocess with a marker in its environment
(every process it starts inherits it, redis-server included), waits for the
line that says it is up, records its process tree, sends the signal, and
then waits (bounded) until no process of that tree, and no process carrying
the marker, is left. The marker catches what the tree cannot: a process
started after the snapshot, or one already re-parented to init.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, free_port

pytestmark = pytest.mark.slow

MARK = "REDGRAIN_HYGIENE_MARK"


class Started:
    """A command under test: its process, its output lines as they come, its marker."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.mark = uuid.uuid4().hex
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", MARK: self.mark, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # the signal goes to it alone, as `kill PID` would
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_line(self, text: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {text!r} in {timeout_s:.0f}s:\n{self.text()}") from None
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait()}) before printing {text!r}:\n{self.text()}")
            if text in line:
                return

    def text(self) -> str:
        return "".join(self.output)[-40000:]

    def tree(self) -> list[psutil.Process]:
        me = psutil.Process(self.proc.pid)
        return [me, *me.children(recursive=True)]

    def marked(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get(MARK) == self.mark:
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        return found

    def kill_leftovers(self) -> None:
        for p in self.marked():
            try:
                p.kill()
            except psutil.Error:
                pass


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _describe(procs: list[psutil.Process]) -> str:
    lines = []
    for p in procs:
        try:
            lines.append(f"{p.pid} {' '.join(p.cmdline())[:150]}")
        except psutil.Error:
            lines.append(f"{p.pid} (gone)")
    return "\n".join(lines)


def assert_all_gone(started: Started, tree: list[psutil.Process], timeout_s: float = 60.0) -> None:
    """Wait until every process of ``tree`` and every marked one has exited, or fail naming them."""
    try:
        started.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {timeout_s:.0f} s after the signal\noutput:\n{started.text()}") from None
    deadline = time.monotonic() + timeout_s
    left: list[psutil.Process] = []
    while time.monotonic() < deadline:
        left = _alive(tree) + [p for p in _alive(started.marked()) if p not in tree]
        if not left:
            return
        psutil.wait_procs(left, timeout=min(0.5, max(0.0, deadline - time.monotonic())))
    raise AssertionError(f"left running after the signal:\n{_describe(left)}\noutput:\n{started.text()}")


@pytest.fixture
def start(tmp_path: Path) -> Iterator[type[Started]]:
    made: list[Started] = []

    class Tracked(Started):
        def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:  # type: ignore[override]
            super().__init__(argv, tmp_path, env)
            made.append(self)

    yield Tracked  # type: ignore[misc]
    for s in made:  # a failed test must not leave its processes to the next one
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        s.kill_leftovers()


def _silos(tree: list[psutil.Process]) -> int:
    """How many of ``tree`` are silo processes (``python -m silo ...``)."""
    n = 0
    for p in tree:
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        n += any(a == "-m" and b == "silo" for a, b in itertools.pairwise(argv))
    return n


def _tree_has(tree: list[psutil.Process], word: str) -> bool:
    for p in tree:
        try:
            if any(word in part for part in p.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


# --- redgrain demo ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_demo_stops_its_silos_dashboard_and_redis(start: type[Started], tmp_path: Path, sig: signal.Signals) -> None:
    demo = start([
        sys.executable, "-m", "grains.cli", "demo", "--silos", "2", "--steps", "100000", "--no-chaos",
        "--data-dir", str(tmp_path / "data"), "--dashboard-port", str(free_port()),
    ])  # fmt: skip
    demo.wait_for_line("training job")  # after Redis, both silos and the dashboard are up
    tree = demo.tree()
    assert _tree_has(tree, "redis-server") and _silos(tree) >= 2, _describe(tree)
    demo.proc.send_signal(sig)
    assert_all_gone(demo, tree)
    assert "stopped: silos, dashboard and Redis are gone" in demo.text()


# --- redgrain silo ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_redgrain_silo_stops_its_redis_and_dashboard(start: type[Started], sig: signal.Signals) -> None:
    port = free_port()
    silo = start([
        sys.executable, "-m", "grains.cli", "silo", "--embedded-redis", "--grains", "samples.hello",
        "--dashboard", str(port),
    ])  # fmt: skip
    silo.wait_for_line("dashboard at")
    tree = silo.tree()
    assert _tree_has(tree, "redis-server"), _describe(tree)
    silo.proc.send_signal(sig)
    assert_all_gone(silo, tree)
    assert silo.proc.returncode == 0, silo.text()


# --- a script using LocalCluster -------------------------------------------------------------------

LOCAL_CLUSTER_SCRIPT = """
import time
from silo.testing.local import LocalCluster

with LocalCluster(grains="samples.hello", silos=2) as lc:
    print("cluster up at", lc.redis_url, flush=True)
    time.sleep(3600)
"""


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"]
)
def test_signal_to_a_local_cluster_script_leaves_no_silo_or_redis(
    start: type[Started], tmp_path: Path, sig: signal.Signals
) -> None:
    script = tmp_path / "uses_local_cluster.py"
    script.write_text(textwrap.dedent(LOCAL_CLUSTER_SCRIPT))
    owner = start([sys.executable, str(script)])
    owner.wait_for_line("cluster up at")
    tree = owner.tree()
    assert _tree_has(tree, "redis-server") and _silos(tree) >= 2, _describe(tree)
    owner.proc.send_signal(sig)
    # SIGINT runs the `with` block's exit; SIGTERM and SIGKILL end the script at once,
    # and its silos and Redis see their pipes close.
    assert_all_gone(owner, tree)
