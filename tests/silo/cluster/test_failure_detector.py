"""The failure detector's rules, on the in-memory table with a fake clock: nothing sleeps."""

from __future__ import annotations

from grains.ids import SiloAddress
from silo.cluster.failure_detector import FailureDetector, HeartbeatThread, ProbeResult
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloLoad, SiloStatus
from silo.settings import MembershipSettings
from silo.testing.clock import VirtualClock
from silo.testing.membership import InMemoryMembershipTable

SETTINGS = MembershipSettings(
    heartbeat_s=1.0, suspect_after_s=3.0, probe_timeout_s=1.0, dead_after_s=4.0, probe_interval_s=0.25
)


class World:
    """n silos in one in-memory table; each has a detector; probes answer from a dict."""

    def __init__(self, n: int, settings: MembershipSettings = SETTINGS) -> None:
        self.settings = settings
        self.clock = VirtualClock(start=1000.0)
        self.table = InMemoryMembershipTable(clock=self.clock)
        self.silos = [SiloAddress("127.0.0.1", 7000 + i, 1) for i in range(n)]
        self.answers: dict[SiloAddress, ProbeResult] = {s: ProbeResult.OK for s in self.silos}
        self.cuts: set[frozenset[SiloAddress]] = set()
        """Pairs of silos that cannot reach each other over the network."""
        self.self_dead: list[SiloAddress] = []
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
                on_self_dead=lambda s=s: self.self_dead.append(s),
                clock=self.clock,
            )

        self.probed: dict[SiloAddress, set[SiloAddress]] = {s: set() for s in self.silos}
        """Prober -> the silos it probed (cleared by tests)."""

    async def _probe(self, prober: SiloAddress, silo: SiloAddress) -> ProbeResult:
        self.probed[prober].add(silo)
        if frozenset((prober, silo)) in self.cuts:
            return ProbeResult.UNREACHABLE
        return self.answers[silo]

    async def beat(self, *silos: SiloAddress) -> None:
        for s in silos:
            await self.table.heartbeat(str(s), self.clock(), SiloLoad())

    async def round(self, *, advance: float = 0.5, beating: tuple[SiloAddress, ...] = ()) -> None:
        """Advance the clock, let the ``beating`` silos heartbeat, run every live detector once."""
        self.clock.jump(advance)
        await self.beat(*beating)
        for s, d in self.detectors.items():
            if self.status(s) is not SiloStatus.DEAD:
                await d.check_once()
                await d.wait_probes()

    def status(self, s: SiloAddress) -> SiloStatus:
        return self.table.rows[str(s)].status


async def test_hung_silo_is_declared_dead_after_dead_after_s_not_before() -> None:
    w = World(3)
    a, b, hung = w.silos
    w.answers[hung] = ProbeResult.TIMEOUT
    await w.round(advance=0.0)  # detectors first see every heartbeat
    elapsed = 0.0
    while w.status(hung) is SiloStatus.ACTIVE:
        await w.round(beating=(a, b))
        elapsed += 0.5
        assert elapsed <= SETTINGS.dead_after_s + 1.0, "hung silo not declared dead in time"
    assert elapsed >= SETTINGS.dead_after_s
    assert w.status(a) is w.status(b) is SiloStatus.ACTIVE
    assert sum(d.declared for d in w.detectors.values()) == 1


async def test_busy_silo_whose_loop_does_not_answer_but_heartbeats_is_never_suspected() -> None:
    w = World(3)
    busy = w.silos[2]
    w.answers[busy] = ProbeResult.TIMEOUT  # a 30 s step holds its event loop
    for _ in range(40):  # 20 s
        await w.round(beating=tuple(w.silos))
    assert w.status(busy) is SiloStatus.ACTIVE
    assert all(not d.statistics().suspected for d in w.detectors.values())


async def test_refused_connection_votes_at_once_and_two_peers_declare_death() -> None:
    w = World(3)
    a, b, killed = w.silos
    await w.round(advance=0.0)
    w.answers[killed] = ProbeResult.REFUSED
    w.clock.jump(0.25)
    await w.detectors[a].check_once()
    await w.detectors[a].wait_probes()
    assert w.status(killed) is SiloStatus.ACTIVE, "one vote of three silos is not enough"
    w.clock.jump(0.25)
    await w.detectors[b].check_once()
    await w.detectors[b].wait_probes()
    assert w.status(killed) is SiloStatus.DEAD
    assert w.clock() - 1000.0 < 1.0


async def test_last_survivor_of_two_declares_alone() -> None:
    w = World(2)
    a, killed = w.silos
    await w.round(advance=0.0)
    w.answers[killed] = ProbeResult.REFUSED
    await w.round(advance=0.25, beating=(a,))
    assert w.status(killed) is SiloStatus.DEAD


async def test_vote_is_void_once_the_heartbeat_moves() -> None:
    w = World(3)
    a, b, flaky = w.silos
    await w.round(advance=0.0)
    w.answers[flaky] = ProbeResult.REFUSED
    w.clock.jump(0.25)
    await w.detectors[a].check_once()
    await w.detectors[a].wait_probes()
    # It was alive after all: it heartbeats before the second vote.
    w.answers[flaky] = ProbeResult.OK
    w.clock.jump(1.0)
    await w.beat(flaky)
    await w.detectors[b].check_once()
    await w.detectors[b].wait_probes()
    outcome = await w.table.vote_dead(str(flaky), str(b), w.table.heartbeats[str(flaky)], 2)
    assert outcome.result == "voted" and outcome.votes == 1  # a's old vote no longer counts
    assert w.status(flaky) is SiloStatus.ACTIVE


async def test_silo_that_reads_itself_dead_stops() -> None:
    w = World(2)
    a, _ = w.silos
    await w.table.set_status(str(a), SiloStatus.DEAD)
    await w.detectors[a].check_once()
    assert w.self_dead == [a]


async def test_heartbeat_thread_fences_when_its_monitors_fall_silent_and_its_beat_is_old() -> None:
    import asyncio

    mono = VirtualClock(start=1000.0)
    hb = HeartbeatThread(
        redis_url="redis://unused", keys=Keys("t"), address="x", settings=SETTINGS,
        load=SiloLoad, on_dead=lambda: None, loop=asyncio.get_running_loop(), monotonic=mono,
    )  # fmt: skip
    hb.watch_monitors(["m"])
    assert not hb.fenced()
    mono.jump(SETTINGS.dead_after_s / 2 - 0.1)
    assert not hb.fenced()
    mono.jump(0.2)  # its monitor silent, no beat as young confirmed
    assert hb.fenced()
    mono.jump(SETTINGS.dead_after_s)  # e.g. resumed after SIGSTOP: peers may have declared us dead
    hb.probed("m")  # a PING that waited in the socket does not lift it
    assert hb.fenced()
    hb.beat_confirmed(mono())
    assert not hb.fenced()


async def test_silo_no_peer_can_reach_is_voted_out_though_it_heartbeats() -> None:
    w = World(3)
    a, b, cut = w.silos
    w.cuts |= {frozenset((a, cut)), frozenset((b, cut))}  # it still reaches Redis: it heartbeats
    elapsed = 0.0
    while w.status(cut) is SiloStatus.ACTIVE:
        await w.round(beating=tuple(w.silos))
        elapsed += 0.5
        assert elapsed <= 2 * SETTINGS.dead_after_s + 1.0, "a silo nobody can reach was never voted out"
    assert elapsed >= 2 * SETTINGS.dead_after_s, "voted out before the longer bound"
    assert w.status(a) is w.status(b) is SiloStatus.ACTIVE
    await w.round(beating=(a, b))  # the dead silo leaves every detector's view
    assert w.detectors[a].statistics().unreachable == w.detectors[b].statistics().unreachable == ()


async def test_one_cut_link_between_two_of_three_silos_removes_neither() -> None:
    w = World(3)
    a, b, _ = w.silos
    w.cuts.add(frozenset((a, b)))
    for _ in range(40):  # 20 s
        await w.round(beating=tuple(w.silos))
    assert all(w.status(s) is SiloStatus.ACTIVE for s in w.silos)
    assert w.detectors[a].statistics().unreachable == (str(b),)


async def test_two_silos_cut_from_each_other_leave_exactly_one() -> None:
    w = World(2)
    w.cuts.add(frozenset(w.silos))
    for _ in range(40):
        await w.round(beating=tuple(w.silos))
    assert sorted(w.status(s).value for s in w.silos) == ["Active", "Dead"]


async def test_unreachable_probes_reset_by_one_that_gets_through() -> None:
    w = World(3)
    a, b, flaky = w.silos
    for i in range(40):  # 20 s, reachable again for one probe every 3 s
        cut = {frozenset((a, flaky)), frozenset((b, flaky))}
        w.cuts = set() if i % 6 == 5 else cut
        await w.round(beating=tuple(w.silos))
    assert w.status(flaky) is SiloStatus.ACTIVE


# --- the ring: each silo probes and votes on its `monitors` successors ------------------

RING = SETTINGS.model_copy(update={"monitors": 3})


def _monitors_of(w: World, target: SiloAddress) -> list[SiloAddress]:
    return [s for s, d in w.detectors.items() if str(target) in d.monitored() and w.status(s) is not SiloStatus.DEAD]


async def test_fewer_silos_than_monitors_watch_every_peer() -> None:
    w = World(3)  # monitors=10 by default
    await w.round(advance=0.0)
    for s, d in w.detectors.items():
        assert sorted(d.monitored()) == sorted(str(p) for p in w.silos if p != s)
        assert w.probed[s] == set(w.silos) - {s}


async def test_each_silo_probes_only_its_successors_and_is_watched_by_monitors_others() -> None:
    w = World(12, RING)
    for _ in range(4):
        await w.round(beating=tuple(w.silos))
    for s, d in w.detectors.items():
        assert len(d.monitored()) == 3 and str(s) not in d.monitored()
        assert {str(p) for p in w.probed[s]} == set(d.monitored()), "probes go to the successors only"
        assert len(_monitors_of(w, s)) == 3, "every silo is watched by `monitors` others"
    # The table was read whole once per detector (its first round), then only followed.
    assert w.table.full_reads == 12
    assert all(d.statistics().full_reads == 1 for d in w.detectors.values())


async def test_a_killed_silo_in_a_ring_is_declared_by_its_monitors_within_a_second() -> None:
    w = World(12, RING)
    await w.round(advance=0.0)
    killed = w.silos[5]
    watchers = _monitors_of(w, killed)
    w.answers[killed] = ProbeResult.REFUSED
    await w.round(advance=0.25, beating=tuple(s for s in w.silos if s != killed))
    assert w.status(killed) is SiloStatus.DEAD
    assert w.clock() - 1000.0 < 1.0
    voters = {s for s, d in w.detectors.items() if d.votes}
    assert voters and voters <= set(watchers), "only the killed silo's monitors voted"


async def test_a_partitioned_monitor_does_not_stop_the_others_declaring() -> None:
    w = World(12, RING)
    await w.round(advance=0.0)
    target = w.silos[7]
    cut_off = _monitors_of(w, target)[0]
    w.cuts |= {frozenset((cut_off, s)) for s in w.silos if s != cut_off}  # it reaches no peer
    w.answers[target] = ProbeResult.REFUSED
    live = tuple(s for s in w.silos if s != target)
    await w.round(advance=0.25, beating=live)
    await w.round(advance=0.25, beating=live)
    assert w.status(target) is SiloStatus.DEAD, "the other monitors declare the target"
    assert w.status(cut_off) is SiloStatus.ACTIVE, "a monitor cut off for half a second is not voted out"


async def test_when_a_target_dies_with_all_its_monitors_the_next_ones_on_the_ring_take_over() -> None:
    w = World(10, SETTINGS.model_copy(update={"monitors": 2}))
    await w.round(advance=0.0)
    target = w.silos[4]
    killed = {target, *_monitors_of(w, target)}
    assert len(killed) == 3
    for k in killed:
        w.answers[k] = ProbeResult.REFUSED
    live = tuple(s for s in w.silos if s not in killed)
    elapsed = 0.0
    while any(w.status(k) is not SiloStatus.DEAD for k in killed):
        await w.round(advance=0.25, beating=live)
        elapsed += 0.25
        assert elapsed <= 3.0, "nobody took over watching the target"
    assert all(w.status(s) is SiloStatus.ACTIVE for s in live)
    await w.round(advance=0.25, beating=live)
    for s in live:  # the ring closed over the dead: every survivor watched by two survivors again
        assert len(_monitors_of(w, s)) == 2
        assert not set(w.detectors[s].monitored()) & {str(k) for k in killed}


async def test_a_silent_host_in_a_ring_is_declared_after_dead_after_s() -> None:
    w = World(12, RING)
    hung = w.silos[3]
    w.answers[hung] = ProbeResult.TIMEOUT
    await w.round(advance=0.0)
    elapsed = 0.0
    live = tuple(s for s in w.silos if s != hung)
    while w.status(hung) is SiloStatus.ACTIVE:
        await w.round(beating=live)
        elapsed += 0.5
        assert elapsed <= SETTINGS.suspect_after_s + SETTINGS.dead_after_s, "silent host not declared in time"
    assert elapsed >= SETTINGS.dead_after_s
    assert all(w.status(s) is SiloStatus.ACTIVE for s in live)


async def test_an_idle_detector_reads_redis_every_idle_read_s_and_every_round_once_a_probe_fails() -> None:
    w = World(3)
    a, b, hung = w.silos
    await w.round(advance=0.0)  # every detector's first read
    for _ in range(20):  # 10 s: every probe answers, every heartbeat moves
        await w.round(beating=tuple(w.silos))
    stats = w.detectors[a].statistics()
    assert stats.rounds == 21 and stats.reads <= 1 + 10.0 / SETTINGS.idle_read_s + 1
    reads = stats.reads
    w.answers[hung] = ProbeResult.TIMEOUT
    for _ in range(4):
        await w.round(beating=(a, b))
    assert w.detectors[a].statistics().reads - reads >= 3  # in doubt: a read each round
    while w.status(hung) is SiloStatus.ACTIVE:  # and the hung silo is still declared
        await w.round(beating=(a, b))
    assert w.status(a) is w.status(b) is SiloStatus.ACTIVE


async def test_a_silo_first_seen_with_an_old_heartbeat_is_stale_from_when_it_was_seen_not_from_that_beat() -> None:
    w = World(3)
    late = w.silos[2]
    w.table.heartbeats[str(late)] = w.clock() - 20.0  # joined 20 s ago (a slow start), beating from now on
    await w.round(advance=0.0)  # every detector's first read finds that old beat
    for _ in range(4):
        await w.round(beating=tuple(w.silos))
    assert w.status(late) is SiloStatus.ACTIVE
    assert sum(d.votes for d in w.detectors.values()) == 0
