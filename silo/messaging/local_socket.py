"""Where a silo's same-host Unix socket lives, derived from its advertised endpoint.

Peers on one host (and in one network namespace) exchange the same frames
over a Unix stream socket instead of loopback TCP: no TCP/IP stack and
bigger socket buffers, which for multi-megabyte tensors costs about half the
CPU per transfer and half the latency (benchmarks/bench_calls.py, the tensor
rows). A connector finds the socket by the endpoint it was given, so nothing
new travels in the membership table; where the file is missing, stale or
refused, it uses TCP, so the fast path can only ever fall back.

The directory is per user and per network namespace: processes in different
namespaces (the partition tests put silos in separate ones) never see each
other's sockets, so a cut link stays cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

# sockaddr_un's sun_path holds 108 bytes on Linux, including the terminating NUL.
_MAX_PATH = 107


def _namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:  # not Linux, or no /proc: one namespace as far as we can tell
        return "default"


def socket_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"redgrain-{os.getuid()}" / f"net-{_namespace()}"


def socket_path(endpoint: str) -> Path | None:
    """The socket of the silo advertised at ``host:port`` on this host, or None when the
    name would not fit in a socket address."""
    host, _, port = endpoint.rpartition(":")
    path = socket_dir() / f"{host.strip('[]').replace('/', '_')}_{port}.sock"
    return path if len(os.fsencode(path)) <= _MAX_PATH else None


def prepare(path: Path) -> None:
    """Create the private directory and remove a stale socket a dead silo left behind
    at this path (:func:`sweep` removes the others)."""
    for d in (path.parent.parent, path.parent):
        d.mkdir(mode=0o700, exist_ok=True)
    path.unlink(missing_ok=True)


def sweep(directory: Path) -> int:
    """Remove the sockets no process holds any more (their silos were killed); how many.

    A socket bound by a live process, listening or not yet, is listed in
    ``/proc/net/unix`` by its path; a SIGKILLed silo's file stays behind unlisted.
    Does nothing where that table is not readable.
    """
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return 0
    held = {fields[-1] for fields in (line.split() for line in lines) if len(fields) >= 8}
    removed = 0
    for path in directory.glob("*.sock"):
        if str(path) not in held:
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed
