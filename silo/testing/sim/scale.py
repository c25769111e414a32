"""``python -m silo.testing.sim scale --silos 1000 --kill 3``: membership at scale, on virtual time.

The real-time scale benchmark (``benchmarks scale``) is sound only up to about
a hundred silos on a small machine: past that, starved event loops heartbeat
late and healthy silos are declared dead. Here each silo's membership runs
on the simulation's loop, where a late turn costs wall time but no virtual
time: N silos each with the real :class:`~silo.cluster.failure_detector.FailureDetector`
(ring monitors, PINGs over the in-memory transport's real connections,
votes), the real :class:`~silo.cluster.view.MembershipView`, and the loop
heartbeat, all over one membership twin whose calls are counted as the
Redis commands they stand for (one script or command each).

It measures, over ``window`` virtual seconds of idleness, the twin calls per
silo per second, then kills ``kill`` silos (their endpoints refuse, as a dead
process's port does) and reports the virtual seconds until each is declared
dead, and how many silos were declared dead that nobody killed.

What it leaves out: grain traffic (none: an idle cluster), the directory
and the stats publisher's records (their cost per silo is flat and measured
by ``benchmarks scale`` with real processes), and a real socket's cost (the
wall time printed is this process's, not a cluster's).

Two things differ from n processes so that one process's CPU goes round, and
neither changes what is simulated: the garbage collector is off during the
run, and detectors that see the same live silos share one ring object
(:func:`_shared_rings`; a detector that cached its own ring would make this
unnecessary).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from collections.abc import Iterable, Iterator

from grains.ids import SiloAddress
from silo.cluster import failure_detector
from silo.cluster.failure_detector import FailureDetector, Ring, transport_probe
from silo.cluster.view import MembershipView
from silo.codec import Codec, TypeRegistry
from silo.records.membership import MemberRow, SiloStatus
from silo.settings import MembershipSettings, TransportSettings
from silo.testing.membership import InMemoryMembershipTable
from silo.testing.sim.loop import SimLoop
from silo.testing.sim.runner import deterministic
from silo.testing.sim.world import SCENARIOS, LoopHeartbeat, RedisLink, World
from silo.testing.transport import InMemoryTransport

STAGING_BYTES = 4096
"""A scale run's connections stage reads in 4 KiB, not 256 KiB: a thousand silos' ten thousand
idle connections would otherwise hold gigabytes for pings of a few bytes."""


@contextlib.contextmanager
def _shared_rings() -> Iterator[None]:
    """Every detector's :class:`~silo.cluster.failure_detector.Ring` over the same live silos is one object.

    A detector rebuilds its ring from its rows every round (4 a second), hashing and sorting
    every live address: in one process holding n silos that is O(n²) a round of the cluster,
    a quarter of a 500-silo run's CPU time, and a larger share the more silos. A ring is a pure
    function of the set of addresses and ``k``, never changed once built, so the detectors
    that see the same live set (all of them, but around a join or a death) may share it; each
    still asks for its ring every round, as it does in a silo of its own.
    """
    real = failure_detector.Ring
    built: dict[tuple[frozenset[str], int], Ring] = {}

    def ring(addresses: Iterable[str], k: int) -> Ring:
        key = (frozenset(addresses), k)
        found = built.get(key)
        if found is None:
            if len(built) >= 64:  # the live sets of a past join or death: seen no more
                built.clear()
            found = built[key] = real(key[0], k)
        return found

    failure_detector.Ring = ring  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        failure_detector.Ring = real  # type: ignore[misc]


class _Node:
    def __init__(self, world: World, index: int, generation: int, settings: MembershipSettings, codec: Codec) -> None:
        self.name = f"s{index}.{generation}"
        self.context = world.context_for(self.name)
        self.link = RedisLink(world, self.name)
        self.address = SiloAddress("127.0.0.1", world.network.free_port(), generation)
        self.dead_at: float | None = None
        self.context.run(self._build, world, settings, codec)

    def _build(self, world: World, settings: MembershipSettings, codec: Codec) -> None:
        table = self.link.wrap(world.membership)
        self.transport = InMemoryTransport(TransportSettings(local_sockets=False), codec, network=world.network)
        self.view = MembershipView(table, refresh_s=settings.refresh_s)
        self.heartbeat = LoopHeartbeat(table, str(self.address), settings, self._dead, world.now)
        self.detector = FailureDetector(
            table=table, me=self.address, settings=settings,
            probe=transport_probe(self.transport, handshake=world.handshake), on_self_dead=self._dead, clock=world.now,
        )  # fmt: skip

    def _dead(self) -> None:
        self.dead_at = self.dead_at or asyncio.get_running_loop().time()

    async def join(self, table: InMemoryMembershipTable, now: float) -> None:
        await self.transport.listen(self.address.host, self.address.port)
        a = self.address
        await table.join(MemberRow(address=str(a), host=a.host, port=a.port, generation=a.generation,
                                   status=SiloStatus.ACTIVE, started=now, heartbeat=now, pid=0, hostname="sim"))  # fmt: skip

    async def start(self) -> None:
        await self.view.start()
        self.heartbeat.start()
        self.detector.start()

    async def kill(self) -> None:
        self.transport.abort_all()
        await self.detector.stop()
        await self.heartbeat.stop()
        await self.view.stop()


async def _scale(world: World, silos: int, kill: int, window_s: float, rng: random.Random) -> dict[str, object]:
    settings = MembershipSettings()
    codec = Codec(TypeRegistry())
    nodes: list[_Node] = []
    for i in range(silos):
        node = _Node(world, i, await world.membership.new_generation(), settings, codec)
        nodes.append(node)
        await world.loop.create_task(node.join(world.membership, world.now()), context=node.context.copy())
    # Every row first, then every silo's view and detector: a cluster that grew one silo at a
    # time would replay n joins to each of n silos, which measures the start, not the idle cost.
    for node in nodes:
        await world.loop.create_task(node.start(), context=node.context.copy())
    # Let every view and ring settle, then count an idle window.
    await asyncio.sleep(2 * settings.refresh_s + settings.suspect_after_s)
    # At least one period of the slowest idle reader (the detector's idle read, the view's poll):
    # a shorter window may count none of them (issue 39 made them 30 s and 15 s).
    window_s = max(window_s, settings.idle_read_s, settings.refresh_s)
    before = world.commands
    await asyncio.sleep(window_s)
    per_silo = (world.commands - before) / window_s / silos
    victims = rng.sample(nodes, kill)
    killed_at = world.now()
    for v in victims:
        await world.loop.create_task(v.kill(), context=v.context.copy())
    deadline = killed_at + 30.0
    gone = {str(v.address) for v in victims}
    while world.now() < deadline:
        rows = world.membership.rows
        if all(rows[a].status is SiloStatus.DEAD for a in gone):
            break
        await asyncio.sleep(0.05)
    detected = {}
    for v in victims:
        row = world.membership.rows[str(v.address)]
        detected[v.name] = world.membership_dead_at.get(str(v.address)) if row.status is SiloStatus.DEAD else None
    false = [a for a, r in world.membership.rows.items() if r.status is SiloStatus.DEAD and a not in gone]
    for n in nodes:
        if n not in victims:
            await world.loop.create_task(n.kill(), context=n.context.copy())
    return {"per_silo": per_silo, "killed_at": killed_at, "detected": detected, "false": false}


def run_scale(*, silos: int, kill: int, seed: int = 1, window_s: float = 20.0) -> int:
    from silo.messaging import receive

    started, cpu = time.perf_counter(), time.process_time()
    staging, receive._STAGING = receive._STAGING, STAGING_BYTES
    # The run makes millions of long-lived objects (connections, timers, rows) and almost no
    # cyclic garbage (a few thousand objects at 200 silos), so each full collection walks the
    # whole heap to free next to nothing: with the collector on, collections were more than
    # half of a 200-silo run's CPU time. Reference counting frees everything else.
    collecting = gc.isenabled()
    gc.disable()
    loop = SimLoop(random.Random(seed))
    try:
        with deterministic(seed), _shared_rings():
            world = World(seed, SCENARIOS["calls"], loop, faults=[])
            world.latency = False
            result = loop.run_until_complete(_scale(world, silos, kill, window_s, random.Random(seed)))
    finally:
        receive._STAGING = staging
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.close()
        if collecting:
            gc.enable()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(f"silos {silos}, killed {kill}, seed {seed}")
    print(f"false deaths {len(result['false'])}")  # type: ignore[arg-type]
    ok = not result["false"]
    for name, at in sorted(result["detected"].items()):  # type: ignore[attr-defined]
        if at is None:
            ok = False
            print(f"silo {name} detected in never (virtual s)")
        else:
            print(f"silo {name} detected in {at - result['killed_at']:.2f} s (virtual)")
    print(f"commands per silo per second {result['per_silo']:.2f}")
    print(f"wall time {wall:.1f} s (cpu {cpu:.1f} s)")
    return 0 if ok else 1
