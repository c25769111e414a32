"""The slow lease and its fence (issue 39), on the in-memory table with a fake clock.

Each silo has its failure detector and a :class:`Liveness` beaten the way the heartbeat thread
beats it (when ``next_beat`` says so); a probe that reaches a silo's loop tells its Liveness which
monitor sent it. The property every scenario checks: **a silo is fenced no later than the round
in which the others declare it Dead**, and an idle silo writes Redis only to renew its lease.
"""

from __future__ import annotations

from dataclasses import dataclass

from grains.ids import SiloAddress
from silo.cluster.failure_detector import FailureDetector, Liveness, ProbeResult
from silo.records.membership import MemberRow, SiloLoad, SiloStatus
from silo.settings import MembershipSettings
from silo.testing.clock import VirtualClock
from silo.testing.membership import InMemoryMembershipTable

SETTINGS = MembershipSettings(
    heartbeat_s=1.0, suspect_after_s=3.0, probe_timeout_s=1.0, dead_after_s=4.0, probe_interval_s=0.25, lease_s=20.0
)
STEP_S = 0.25


class Lease(Liveness):
    def __init__(self, settings: MembershipSettings, clock: VirtualClock) -> None:
        self._init_liveness(settings, clock)
        self.beats = 0


@dataclass
class Host:
    """What is wrong with one silo: ``stopped`` (SIGSTOP: nothing runs), ``busy`` (its loop is held,
    its heartbeat thread runs), ``isolated`` (cut from peers and Redis), ``no_redis``."""

    stopped: bool = False
    busy: bool = False
    isolated: bool = False
    no_redis: bool = False


class LeaseWorld:
    def __init__(self, n: int, settings: MembershipSettings = SETTINGS) -> None:
        self.settings = settings
        self.clock = VirtualClock(start=1000.0)
        self.table = InMemoryMembershipTable(clock=self.clock)
        self.silos = [SiloAddress("127.0.0.1", 7000 + i, 1) for i in range(n)]
        self.hosts = {s: Host() for s in self.silos}
        self.leases = {s: Lease(settings, self.clock) for s in self.silos}
        self.writes = 0
        self.detectors: dict[SiloAddress, FailureDetector] = {}
        for s in self.silos:
            self.table.rows[str(s)] = MemberRow(
                address=str(s), host=s.host, port=s.port, generation=1,
                status=SiloStatus.ACTIVE, heartbeat=self.clock(),
            )  # fmt: skip
            self.detectors[s] = FailureDetector(
                table=self.table,
                me=s,
                settings=settings,
                probe=lambda silo, timeout_s, me=s: self._probe(me, silo),
                clock=self.clock,
                on_monitors=self.leases[s].watch_monitors,
            )

    async def _probe(self, prober: SiloAddress, silo: SiloAddress) -> ProbeResult:
        src, dst = self.hosts[prober], self.hosts[silo]
        if src.isolated or dst.isolated:
            return ProbeResult.UNREACHABLE
        if dst.stopped or dst.busy:
            return ProbeResult.TIMEOUT  # the PING waits in its socket: its loop never sees it
        if not self.leases[prober].fenced():
            self.leases[silo].probed(str(prober))
        return ProbeResult.OK

    async def _beat(self, s: SiloAddress) -> None:
        lease, host = self.leases[s], self.hosts[s]
        if host.stopped or lease.dead or lease.next_beat(self.clock(), lease.beats == 0) > 0:
            return
        sent = self.clock()
        lease.beat_sent(sent)
        if host.isolated or host.no_redis:
            return
        self.writes += 1
        status = await self.table.heartbeat(str(s), sent, SiloLoad())
        if status is SiloStatus.DEAD:
            lease.dead = True
        else:
            lease.beats += 1
            lease.beat_confirmed(sent)

    async def step(self) -> None:
        self.clock.jump(STEP_S)
        for s in self.silos:
            await self._beat(s)
        for s, d in self.detectors.items():
            h = self.hosts[s]
            if self.status(s) is not SiloStatus.DEAD and not (h.stopped or h.busy or h.isolated):
                await d.check_once()
                await d.wait_probes()

    def status(self, s: SiloAddress) -> SiloStatus:
        return self.table.rows[str(s)].status

    async def run_until_dead(self, s: SiloAddress, limit_s: float) -> float:
        """Steps until ``s`` is declared Dead, checking it was fenced by then; the time it took."""
        elapsed = 0.0
        while self.status(s) is SiloStatus.ACTIVE:
            await self.step()
            elapsed += STEP_S
            assert elapsed <= limit_s, f"{s} not declared dead within {limit_s}s"
        assert self.leases[s].fenced(), "declared dead while it would still serve"
        return elapsed


async def settle(w: LeaseWorld, seconds: float = 30.0) -> None:
    for _ in range(int(seconds / STEP_S)):
        await w.step()


async def test_an_idle_silo_writes_redis_only_to_renew_its_lease() -> None:
    w = LeaseWorld(3)
    await settle(w, 5.0)  # the first beats, the detectors' first reads
    w.writes = 0
    await settle(w, 60.0)
    assert w.writes == 3 * 6  # one renewal every lease_s / 2 each
    assert not any(lease.fenced() for lease in w.leases.values())
    assert all(w.status(s) is SiloStatus.ACTIVE for s in w.silos)


async def test_isolated_silo_is_fenced_before_it_is_declared_dead() -> None:
    """The hole a slow lease opens: cut from its peers and Redis, its lease is still young when the
    others declare it; its monitors' silence fences it first."""
    w = LeaseWorld(3)
    await settle(w)
    cut = w.silos[2]
    w.hosts[cut].isolated = True
    await w.run_until_dead(cut, 2 * SETTINGS.dead_after_s + 1.0)
    assert w.leases[cut].fenced()


async def test_hung_silo_is_declared_dead_as_fast_as_with_a_beat_a_second_and_resumes_fenced() -> None:
    w = LeaseWorld(3)
    await settle(w)
    hung = w.silos[0]
    w.hosts[hung].stopped = True
    took = await w.run_until_dead(hung, SETTINGS.dead_after_s + 1.0)
    assert took >= SETTINGS.dead_after_s
    # SIGCONT: the PINGs that queued up, and those of a monitor that has not heard yet, reach it
    # before its heartbeat thread runs: it stays fenced, then hears it is Dead.
    w.hosts[hung].stopped = False
    for m in w.leases[hung]._heard:
        w.leases[hung].probed(m)
    assert w.leases[hung].fenced()
    await w.step()
    assert w.leases[hung].dead


async def test_busy_silo_whose_loop_does_not_answer_beats_and_is_not_declared_dead() -> None:
    w = LeaseWorld(3)
    await settle(w)
    busy = w.silos[1]
    w.hosts[busy].busy = True
    w.writes = 0
    await settle(w, 30.0)
    assert w.status(busy) is SiloStatus.ACTIVE
    assert w.writes >= 25, "its monitors' silence makes it beat every heartbeat_s"
    w.hosts[busy].busy = False
    await settle(w, 5.0)
    assert not w.leases[busy].fenced()
    assert w.leases[busy].doubt_since is None


async def test_a_monitor_that_dies_costs_beats_not_a_fence() -> None:
    w = LeaseWorld(3)
    await settle(w)
    victim = w.silos[0]
    w.hosts[victim].stopped = True
    others = [s for s in w.silos if s != victim]
    while w.status(victim) is SiloStatus.ACTIVE:
        await w.step()
        assert not any(w.leases[s].fenced() for s in others)
    await settle(w, 5.0)
    assert not any(w.leases[s].fenced() for s in others)


async def test_silo_cut_from_redis_fences_by_its_lease_before_the_others_vote() -> None:
    w = LeaseWorld(3)
    await settle(w)
    cut = w.silos[1]
    w.hosts[cut].no_redis = True
    took = await w.run_until_dead(cut, SETTINGS.lease_s + SETTINGS.dead_after_s + SETTINGS.idle_read_s + 2.0)
    assert took >= SETTINGS.dead_after_s


async def test_a_lone_silo_is_fenced_by_its_lease_only() -> None:
    w = LeaseWorld(1)
    await settle(w, 5.0)
    lease = w.leases[w.silos[0]]
    assert lease.vouched_until == float("inf")
    w.hosts[w.silos[0]].no_redis = True
    w.clock.jump(lease.last_confirmed + SETTINGS.lease_s - 1.0 - w.clock())
    assert not lease.fenced()
    w.clock.jump(2.0)
    assert lease.fenced()


async def test_probes_from_a_silo_that_is_not_a_monitor_do_not_count() -> None:
    clock = VirtualClock(start=1000.0)
    lease = Lease(SETTINGS, clock)
    lease.watch_monitors(["m1"])
    clock.jump(SETTINGS.dead_after_s + 0.1)  # m1 silent past silence_s, the lease's last beat old
    lease.probed("stranger")
    assert lease.fenced()
    lease.probed("m1")
    assert lease.fenced(), "the doubt latches: only a confirmed beat lifts it"
    lease.beat_sent(clock())
    lease.beat_confirmed(clock())
    assert not lease.fenced()
