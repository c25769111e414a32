"""Separate network hosts on one machine: Linux network namespaces on a private bridge.

Each *host* is a network namespace with one veth (``eth0``) whose peer sits in
a bridge that lives in a namespace of its own, so the only thing this touches
in the machine's own namespace is the optional *observer* link (the test
process's view of the subnet). All names carry a run id, and every run writes
what it created to ``/run/redgrain-netns/<id>.json``; the next run removes
what a crashed run (its pid gone) left behind.

Faults, all reversible:

* :meth:`Network.cut` drops every packet between two hosts, both ways, by
  pointing each side's neighbour entry for the other at a MAC address nobody
  has (silent loss: the real partition case; connects hang, established
  connections go quiet).
* :meth:`Network.isolate` takes a host's link down (it reaches nobody).

Needs root, ``ip`` (iproute2) and kernel support for namespaces, veth and
bridges; :func:`unavailable` says which is missing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

STATE_DIR = Path("/run/redgrain-netns")
PREFIX = "rgn"
_NOWHERE = "02:00:00:de:ad:01"
"""A locally administered MAC address no interface here has."""


class NetError(RuntimeError):
    """An ``ip`` command failed."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def unavailable() -> str | None:
    """Why this machine cannot run the namespace tests, or None when it can (checked for real)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (ip netns add); running as uid {os.geteuid()}"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        made = ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        veth = ip("-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b", check=False)
        if veth.returncode != 0:
            return f"veth pairs are not available: {veth.stderr.strip()}"
        bridge = ip("-n", probe, "link", "add", "name", "br", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"bridges are not available: {bridge.stderr.strip()}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One namespace with one address on the bridge."""

    name: str
    ns: str
    address: str
    cuts: set[str] = field(default_factory=set)
    """Addresses this host's namespace currently cannot reach."""

    def argv(self, *cmd: str) -> list[str]:
        """``cmd`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *cmd]


class Network:
    """A private /24 on a bridge; hosts are namespaces. Use as a context manager."""

    def __init__(self) -> None:
        _sweep_leftovers()
        self.id = secrets.token_hex(3)
        self.subnet = _free_subnet()
        self.bridge_ns = f"{PREFIX}{self.id}-br"
        self.hosts: dict[str, Host] = {}
        self.observer: str | None = None
        """Address of the test process's own link into the subnet (None until added)."""
        self._observer_link = f"{PREFIX}{self.id}o"
        self._next = 2
        self._state_file = STATE_DIR / f"{self.id}.json"
        self._created = False

    # --- building -------------------------------------------------------------
    def create(self) -> Self:
        self._record()
        ip("netns", "add", self.bridge_ns)
        self._created = True
        ip("-n", self.bridge_ns, "link", "set", "dev", "lo", "up")
        ip("-n", self.bridge_ns, "link", "add", "name", "br0", "type", "bridge")
        ip("-n", self.bridge_ns, "link", "set", "dev", "br0", "up")
        return self

    def _address(self, index: int) -> str:
        return str(self.subnet.network_address + index)

    def add_host(self, name: str) -> Host:
        """A new namespace ``name`` with its own address on the bridge."""
        if name in self.hosts or len(name) > 12:
            raise ValueError(f"bad or duplicate host name {name!r}")
        host = Host(name, f"{PREFIX}{self.id}-{name}", self._address(self._next))
        self._next += 1
        self.hosts[name] = host
        self._record()
        ip("netns", "add", host.ns)
        ip("-n", host.ns, "link", "set", "dev", "lo", "up")
        # Created inside the bridge namespace and moved: no name ever lands in the root namespace.
        ip("-n", self.bridge_ns, "link", "add", "name", name, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        ip("-n", self.bridge_ns, "link", "set", "dev", name, "master", "br0")
        ip("-n", self.bridge_ns, "link", "set", "dev", name, "up")
        ip("-n", host.ns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", host.ns, "link", "set", "dev", "eth0", "up")
        return host

    def add_address(self, host: Host) -> str:
        """One more address on ``host`` (a proxy listening in place of another host)."""
        addr = self._address(self._next)
        self._next += 1
        ip("-n", host.ns, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", "eth0")
        return addr

    def add_observer(self) -> str:
        """A link from the machine's own namespace into the subnet, for the test process."""
        addr = self._address(254)
        self._record()
        ip("link", "add", "name", self._observer_link, "type", "veth", "peer", "name", "obs", "netns", self.bridge_ns)
        ip("-n", self.bridge_ns, "link", "set", "dev", "obs", "master", "br0")
        ip("-n", self.bridge_ns, "link", "set", "dev", "obs", "up")
        ip("addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", self._observer_link)
        ip("link", "set", "dev", self._observer_link, "up")
        self.observer = addr
        return addr

    # --- faults ---------------------------------------------------------------
    def cut(self, a: Host, b: Host) -> None:
        """Drop every packet between ``a`` and ``b`` (both directions), silently.

        A ``blackhole`` route would fail a local connect() at once (EINVAL), which
        no real partition does. Instead each side's neighbour entry for the other
        names a MAC address nobody has: frames leave, the bridge floods them, and
        nobody takes them, so connects hang and established connections go quiet.
        """
        for src, dst in ((a, b), (b, a)):
            for addr in self._addresses_of(dst):
                if addr not in src.cuts:
                    ip("-n", src.ns, "neigh", "replace", addr, "lladdr", _NOWHERE, "dev", "eth0", "nud", "permanent")
                    src.cuts.add(addr)

    def heal(self, a: Host, b: Host) -> None:
        """Undo :meth:`cut` between ``a`` and ``b``."""
        for src, dst in ((a, b), (b, a)):
            for addr in self._addresses_of(dst):
                if addr in src.cuts:
                    ip("-n", src.ns, "neigh", "del", addr, "dev", "eth0", check=False)
                    src.cuts.discard(addr)

    def isolate(self, host: Host) -> None:
        """Take ``host``'s link down: it reaches nobody and nobody reaches it."""
        ip("-n", self.bridge_ns, "link", "set", "dev", host.name, "down")

    def rejoin(self, host: Host) -> None:
        ip("-n", self.bridge_ns, "link", "set", "dev", host.name, "up")

    def _addresses_of(self, host: Host) -> list[str]:
        out = ip("-n", host.ns, "-4", "-o", "addr", "show", "dev", "eth0").stdout
        return [line.split()[3].split("/")[0] for line in out.splitlines() if " inet " in line]

    # --- teardown ---------------------------------------------------------------
    def destroy(self) -> None:
        """Kill whatever still runs in our namespaces, then delete them and the observer link."""
        _remove(self._namespaces(), [self._observer_link])
        with contextlib.suppress(FileNotFoundError):
            self._state_file.unlink()

    def _namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts.values()] + [self.bridge_ns]

    def _record(self) -> None:
        # Written before each thing is created, so a crash at any point leaves a complete list.
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_file.write_text(
            json.dumps({"pid": os.getpid(), "namespaces": self._namespaces(), "links": [self._observer_link]})
        )

    def __enter__(self) -> Self:
        try:
            return self.create()
        except BaseException:
            self.destroy()
            raise

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _pids_in(ns: str) -> list[int]:
    out = ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _remove(namespaces: list[str], links: list[str]) -> None:
    for ns in namespaces:
        # Only processes started inside our own namespaces: nobody else's.
        for pid in _pids_in(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    for ns in namespaces:
        while _pids_in(ns) and time.monotonic() < deadline:
            time.sleep(0.05)  # killed processes of other parents: nothing to wait on but the list
        ip("netns", "del", ns, check=False)
    for link in links:
        ip("link", "del", link, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_leftovers() -> None:
    """Remove what earlier runs whose process is gone left behind (a crashed or killed test run)."""
    if not STATE_DIR.is_dir():
        return
    for path in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(int(state.get("pid", 0))):
            continue
        _remove(list(state.get("namespaces", [])), list(state.get("links", [])))
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.231.x.0/24 that no address of this machine's namespace is in."""
    used = ip("-4", "-o", "addr", "show").stdout
    taken = {ipaddress.ip_interface(line.split()[3]).network for line in used.splitlines() if " inet " in line}
    for _ in range(50):
        net = ipaddress.IPv4Network(f"10.231.{secrets.randbelow(250) + 1}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise NetError("no free 10.231.x.0/24 subnet")
