"""An idle silo's membership traffic does not grow with its number of peers.

Real silos in this process over the session's redis-server; every command is
seen through MONITOR and counted per failure-detector round (counts, not a
rate: a slow machine runs fewer rounds, not different ones).
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

from silo.silo import Silo
from tests.conftest import FAST_MEMBERSHIP

MONITORS = 2
RING = FAST_MEMBERSHIP.model_copy(update={"monitors": MONITORS})
_LINE = re.compile(r'^[\d.]+ \[\d+ ([^\]]+)\] (.*)$')


@dataclass
class Seen:
    commands: list[list[str]] = field(default_factory=list)
    """Every command a client sent (not those a script ran), as words."""


async def _monitor(redis_url: str, seen: Seen, stop: asyncio.Event) -> None:
    url = urlparse(redis_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(b"MONITOR\r\n")
    await writer.drain()
    try:
        await reader.readline()  # +OK
        while not stop.is_set():
            line = await reader.readline()
            if not line:
                return
            m = _LINE.match(line.decode(errors="replace").lstrip("+").strip())
            if m and m.group(1) != "lua":
                seen.commands.append(shlex.split(m.group(2)))
    finally:
        writer.close()


async def _idle_window(redis_url: str, silos: list[Silo], rounds_each: int) -> tuple[Seen, int]:
    """Commands seen while every silo's failure detector runs ``rounds_each`` more rounds."""
    seen, stop = Seen(), asyncio.Event()
    start = sum(s.detector.rounds for s in silos)
    task = asyncio.create_task(_monitor(redis_url, seen, stop))
    target = start + rounds_each * len(silos)
    while sum(s.detector.rounds for s in silos) < target:
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait({task}, timeout=2.0)
    task.cancel()
    return seen, sum(s.detector.rounds for s in silos) - start


async def _ring_settled(silos: list[Silo]) -> None:
    """Until every detector follows the ring of all the silos: each watched by MONITORS others."""
    addrs = {str(s.address) for s in silos}

    def settled() -> bool:
        watching = [set(s.detector.monitored()) for s in silos]
        return all(w <= addrs for w in watching) and all(sum(a in w for w in watching) == MONITORS for a in addrs)

    while not settled():
        await asyncio.sleep(0.05)


def _membership_commands(seen: Seen, prefix: str) -> list[list[str]]:
    out = []
    for words in seen.commands:
        name = words[0].lower()
        keys = words[3:4] if name in ("evalsha", "eval") else words[1:2]
        if keys and keys[0].startswith(prefix + "members"):
            out.append(words)
    return out


async def test_idle_membership_commands_per_silo_do_not_grow_with_peers(
    cluster: Callable[..., Awaitable[list[Silo]]], redis_url: str
) -> None:
    silos = await cluster(3, membership=RING)
    prefix = silos[0].keys.prefix
    per_round: dict[int, float] = {}
    for n in (3, 9):
        if n > len(silos):
            silos += await cluster(n - len(silos), membership=RING)
            await _ring_settled(silos)
        seen, rounds = await _idle_window(redis_url, silos, rounds_each=12)
        cmds = _membership_commands(seen, prefix)
        whole = [w for w in cmds if w[0].lower() == "hgetall" and w[1] == prefix + "members"]
        assert whole == [], f"an idle silo read the whole membership table ({n} silos)"
        beats = [w for w in cmds if w[0].lower() != "evalsha" and w[1] == prefix + "members:hb"]
        assert beats == [], "heartbeat values read by a client (a detector's script reads flags)"
        for w in cmds:  # the detector's round: 4 keys, then the TTL and the watched silos
            if w[0].lower() == "evalsha" and w[3] == prefix + "members" and w[6] == prefix + "members:version":
                assert len(w) - 9 <= MONITORS, f"heartbeats read beyond the ring successors: {w}"
        per_round[n] = len(cmds) / rounds
    assert per_round[9] <= per_round[3] * 1.25, per_round
