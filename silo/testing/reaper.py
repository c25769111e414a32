"""``python -m silo.testing.reaper PID CREATED``: stop process group PID once its owner is gone.

A child we cannot change (``redis-server``) does not notice that the process
that started it died, even by SIGKILL, and lives on as an orphan holding its
port. So :class:`~silo.testing.embedded.RedisServer` starts this watcher next
to each server: its stdin is the read end of a pipe whose only write end the
owner holds. The owner writes one byte when it stops the server itself (the
watcher then just exits); any exit of the owner closes the write end, and a
read that ends without that byte means the owner died: the watcher sends
SIGTERM to the server's process group, then SIGKILL after ``GRACE_S``.

Why a pipe and not ``PR_SET_PDEATHSIG``: the kernel closes a dead process's
descriptors however it died, on every POSIX system; the parent-death signal
is Linux-only, fires when the *thread* that forked the child exits (a server
started from ``asyncio.to_thread`` would die with that worker thread), and
needs ``preexec_fn``, which is not safe in a process with threads.

``CREATED`` (the server's start time, as psutil reports it) guards against a
recycled pid: a process that is not the one we watched is never signalled.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

GRACE_S = 5.0


def _same(pid: int, created: float) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - created) < 0.01 else None
    except psutil.Error:
        return None


def main(argv: list[str]) -> int:
    pid, created = int(argv[0]), float(argv[1])
    # Its own session already; a stray Ctrl-C must not leave the server unwatched.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.read(0, 1):
        return 0  # the owner stops the server itself
    proc = _same(pid, created)
    if proc is None:
        return 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return 0
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and _same(pid, created) is not None:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    return 0  # gone; its new parent (init) reaps it
            except psutil.Error:
                return 0
            time.sleep(0.05)
        if _same(pid, created) is None:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
