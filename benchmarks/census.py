"""Which component of an idle silo sends which Redis command, per second (issue 39).

``INFO commandstats`` says how many commands of each kind Redis ran; it cannot
say who sent them. ``MONITOR`` can, from what each command touches: a script
is named by the SHA-1 of its source (every Lua constant of ``silo/`` and
``grains/`` is hashed here), a plain command by its key (the key builders of
``silo/keys.py`` give each component its own names). Commands a script runs
inside Redis appear in MONITOR right after the ``EVALSHA`` (client type
``lua``) and are charged to that script, so the census adds up to what
``commandstats`` counts (both count a script's inner commands).

MONITOR costs Redis a copy of every command to one more client: run it for a
few seconds, after the ``commandstats`` window, not during it.
"""

from __future__ import annotations

import collections
import hashlib
import importlib
import pkgutil
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_SCRIPT_COMPONENT = {
    "silo.cluster.membership._HEARTBEAT": "heartbeat (thread)",
    "silo.cluster.membership._MOVED": "failure detector",
    "silo.cluster.membership._VOTE_DEAD": "failure detector",
    "silo.cluster.membership._VOTE_UNREACHABLE": "failure detector",
    "silo.cluster.rebalancer._RENEW": "rebalancer lease",
    "silo.cluster.rebalancer._RELEASE": "rebalancer lease",
    "silo.streams.agent._RENEW": "stream agents",
    "silo.streams.agent._RELEASE": "stream agents",
}
"""Scripts whose component is not simply their module's name."""

_KEY_COMPONENT: tuple[tuple[str, str], ...] = (
    # (regex over the normalised key, component); first match wins
    (r"members:seen:", "failure detector"),
    (r"members:hb$", "failure detector"),
    (r"suspicions|unreachable", "failure detector"),
    (r"members", "membership view"),
    (r"generation$", "membership view"),
    (r":control:", "control inbox"),
    (r":stats", "stats publisher"),
    (r"leader:", "rebalancer lease"),
    (r"reminders", "reminders"),
    (r":logs", "log stream"),
    (r"manifest", "manifests"),
    (r":stream", "stream agents"),
    (r":jobs|:job:", "jobs"),
    (r":events", "event log"),
)

_SILO = re.compile(r"\d+\.\d+\.\d+\.\d+:\d+@\d+")
_CLUSTER = re.compile(r"^rg:\{[^}:]+")


def script_names(packages: Iterable[str] = ("silo", "grains")) -> dict[str, str]:
    """SHA-1 of every Lua source held in a module-level string of ``packages`` -> ``module.NAME``."""
    out: dict[str, str] = {}
    for pkg_name in packages:
        pkg = importlib.import_module(pkg_name)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            if ".testing" in info.name or info.name.endswith("__main__"):
                continue
            try:
                module = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001, S112 - an optional dependency missing: no scripts from it
                continue
            for name, value in vars(module).items():
                if isinstance(value, str) and "redis.call" in value:
                    out.setdefault(hashlib.sha1(value.encode()).hexdigest(), f"{info.name}.{name}")
    return out


def _key_shape(key: str) -> str:
    return _SILO.sub("<silo>", _CLUSTER.sub("rg:{c", key))


def _component_of_script(script: str) -> str:
    if script in _SCRIPT_COMPONENT:
        return _SCRIPT_COMPONENT[script]
    if script.endswith("HEARTBEAT_LUA"):  # membership's _HEARTBEAT, imported by the heartbeat thread
        return "heartbeat (thread)"
    module = script.rsplit(".", 1)[0]
    return module.rsplit(".", 1)[-1]


def _component_of_key(shape: str) -> str:
    for pattern, component in _KEY_COMPONENT:
        if re.search(pattern, shape):
            return component
    return "other"


@dataclass(frozen=True, slots=True)
class Census:
    """Commands Redis ran during ``window_s``, by component and by what was sent."""

    window_s: float
    by_component: Mapping[str, int]
    """Commands (a script's inner ones included) per component."""
    by_command: Mapping[tuple[str, str], int]
    """(component, ``COMMAND key-shape`` or ``script name``) -> commands."""

    def per_silo_s(self, silos: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """(component, commands/s per silo, [(what, commands/s per silo)]), the busiest first."""
        scale = 1.0 / (self.window_s * silos)
        rows = []
        for comp, total in sorted(self.by_component.items(), key=lambda kv: -kv[1]):
            parts = sorted(((w, n * scale) for (c, w), n in self.by_command.items() if c == comp), key=lambda x: -x[1])
            rows.append((comp, total * scale, parts))
        return rows


def census(redis_url: str, window_s: float, ignore_port: int | None = None) -> Census:
    """MONITOR ``redis_url`` for ``window_s`` and charge every command to a component."""
    import redis as sync_redis

    shas = script_names()
    r = sync_redis.Redis.from_url(redis_url)
    by_component: collections.Counter[str] = collections.Counter()
    by_command: collections.Counter[tuple[str, str]] = collections.Counter()
    script: tuple[str, str] | None = None  # (component, name) of the last top-level EVALSHA
    own = set()
    with r.monitor() as mon:
        # The monitor's own connection sends nothing after MONITOR; our reads (none) are ignored.
        own.add(mon.connection.port if mon.connection is not None else None)
        stop = time.monotonic() + window_s
        # listen() blocks until the next command: a timer pings so an idle Redis still ends the window.
        pinger = threading.Timer(window_s + 0.05, lambda: sync_redis.Redis.from_url(redis_url).echo("census-end"))
        pinger.start()
        try:
            for entry in mon.listen():
                if time.monotonic() >= stop:
                    break
                command: str = entry["command"]
                words = command.split(" ", 2)
                verb = words[0].upper()
                if entry.get("client_type") == "lua":
                    if script is None:
                        continue
                    comp, name = script
                    by_component[comp] += 1
                    by_command[(comp, f"{name}: {verb.lower()}")] += 1
                    continue
                if verb in ("EVALSHA", "EVAL") and len(words) > 1:
                    name = shas.get(words[1].lower(), "unknown script")
                    comp = _component_of_script(name)
                    script = (comp, name.rsplit(".", 1)[-1] if name != "unknown script" else name)
                    by_component[comp] += 1
                    by_command[(comp, f"EVALSHA {script[1]}")] += 1
                    continue
                script = None
                if verb in ("MONITOR", "ECHO", "CONFIG", "INFO", "HELLO", "CLIENT", "SCRIPT"):
                    continue  # the benchmark's own, and connection set-up
                key = words[1].strip('"') if len(words) > 1 else ""
                shape = _key_shape(key)
                comp = _component_of_key(shape) if key else "other"
                by_component[comp] += 1
                by_command[(comp, f"{verb} {shape}".strip())] += 1
        finally:
            pinger.cancel()
    return Census(window_s, dict(by_component), dict(by_command))


def commandstats_total(info: Mapping[str, Any]) -> int:
    """Calls in an ``INFO commandstats`` reply (a script's inner commands included)."""
    return sum(int(v["calls"]) for k, v in info.items() if not k.startswith("cmdstat_config"))


def print_census(rows: list[tuple[str, float, list[tuple[str, float]]]], limit: int = 4) -> None:
    """Print :meth:`Census.per_silo_s`: each component, its rate, its ``limit`` busiest commands."""
    width = max([len("component"), *(len(comp) for comp, _, _ in rows)])
    print(f"{'component'.ljust(width)}  cmds/s/silo  busiest commands (cmds/s/silo)")
    for comp, rate, parts in rows:
        top = "; ".join(f"{w} {r:.2f}" for w, r in parts[:limit])
        print(f"{comp.ljust(width)}  {rate:11.2f}  {top}")
    print(f"{'total'.ljust(width)}  {sum(rate for _, rate, _ in rows):11.2f}")
