"""Failover with real silo processes: kill -9 under load, and a hung (SIGSTOPped) silo."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

from grains.call import Call
from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.client import ClusterClient
from silo.messaging.transport import Transport
from silo.settings import TransportSettings
from tests.conftest import FAST_MEMBERSHIP
from tests.silo.cluster.grains import Resident, Tracked

GRAINS = "tests.silo.cluster.grains"
# Keep the rebalancer (it re-activates keep-alive grains) but let it move nothing.
ENV = {"REDGRAIN_REBALANCER__MAX_MOVES_PER_PERIOD": "0", "REDGRAIN_REBALANCER__LEASE_TTL_S": "1.0"}
CALL_TIMEOUT_S = 5.0


async def _activations(client: ClusterClient, silo: SiloAddress) -> dict[str, str] | None:
    try:
        return await client.router.system_call(silo, "activations", (), 2.0)  # type: ignore[no-any-return]
    except errors.RedgrainError:
        return None


async def _wait_for(cond, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """Poll ``cond`` (another process changes the world: there is nothing to await)."""
    start = time.monotonic()
    while not await cond():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@dataclass
class Record:
    ok: list[tuple[float, str, str, str]] = field(default_factory=list)
    """(finished at, grain key, silo, activation id)"""
    failed: list[tuple[float, float, str, str]] = field(default_factory=list)
    """(started at, finished at, grain key, error class)"""
    slowest_s: float = 0.0


async def _load(client: ClusterClient, keys: list[str], rec: Record, stop: asyncio.Event, start: int) -> None:
    i = start
    while not stop.is_set():
        key = keys[i % len(keys)]
        i += 1
        t0 = time.monotonic()
        try:
            silo, act = await client.get_grain(Tracked, key).with_timeout(CALL_TIMEOUT_S).hit()
            rec.ok.append((time.monotonic(), key, silo, act))
        except errors.RedgrainError as exc:
            rec.failed.append((t0, time.monotonic(), key, type(exc).__name__))
        rec.slowest_s = max(rec.slowest_s, time.monotonic() - t0)


class DoubleActivationChecker:
    """Reads every silo's catalog, then the directory, over and over."""

    def __init__(self, client: ClusterClient, silos: list[SiloAddress]) -> None:
        self.client = client
        self.silos = silos
        self.rounds = 0
        self.problems: list[str] = []
        self.kill_at = float("inf")

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            cats = {s: await _activations(self.client, s) for s in self.silos}
            found: list[str] = []
            where: dict[str, list[SiloAddress]] = defaultdict(list)
            for s, cat in cats.items():
                for g in cat or {}:
                    where[g].append(s)
            found += [f"{g} active on {ss}" for g, ss in where.items() if len(ss) > 1]
            for s, cat in cats.items():
                for g, act in (cat or {}).items():
                    entry = await self.client.directory.lookup(GrainId.parse(g))
                    if entry is None or entry.silo != s or entry.activation_id != act:
                        found.append(f"{g} on {s} ({act}) but directory says {entry}")
            if started <= self.kill_at <= time.monotonic():
                continue  # reads on both sides of the kill are not one snapshot
            self.problems += found
            self.rounds += 1
            await asyncio.sleep(0.05)


async def test_kill_9_one_of_three_silos_under_load_fails_over_without_double_activation(
    silo_processes, client: ClusterClient
) -> None:
    procs = silo_processes(3, grains=GRAINS, env=ENV)
    keys = [f"k{i}" for i in range(30)]
    await client.refresh()
    first = {k: (await client.get_grain(Tracked, k).hit())[0] for k in keys}
    residents = {k: (await client.get_grain(Resident, k).hit())[0] for k in (f"r{i}" for i in range(9))}
    victim = max(procs, key=lambda p: sum(s == str(p.address) for s in first.values()))
    assert victim.address is not None
    victim_keys = [k for k, s in first.items() if s == str(victim.address)]
    victim_residents = [k for k, s in residents.items() if s == str(victim.address)]
    assert victim_keys

    rec, stop = Record(), asyncio.Event()
    checker = DoubleActivationChecker(client, [p.address for p in procs if p.address])
    tasks = [asyncio.ensure_future(_load(client, keys, rec, stop, w * 4)) for w in range(8)]
    tasks.append(asyncio.ensure_future(checker.run(stop)))
    await _wait_for(lambda: _true_after(len({k for _, k, _, _ in rec.ok}) == len(keys)), 10, "load on every key")

    t_kill = checker.kill_at = time.monotonic()
    victim.kill()

    async def declared_dead() -> bool:
        return client.view.is_dead(victim.address)  # type: ignore[arg-type]

    async def all_back() -> bool:
        back = {k for t, k, s, _ in rec.ok if t > t_kill and s != str(victim.address)}
        return set(victim_keys) <= back

    detection_s = await _wait_for(declared_dead, 10, "the killed silo to be declared dead")
    recovery_s = await _wait_for(all_back, 10, "the killed silo's grains to serve elsewhere")
    back_at = {
        k: min(t for t, kk, s, _ in rec.ok if kk == k and t > t_kill and s != str(victim.address))
        for k in victim_keys
    }
    first_back, all_back_s = min(back_at.values()) - t_kill, max(back_at.values()) - t_kill

    async def residents_back() -> bool:
        live = [await _activations(client, p.address) for p in procs if p is not victim and p.address]
        here = {g for cat in live for g in (cat or {})}
        return all(f"Resident/{k}" in here for k in victim_residents)

    keep_alive_s = await _wait_for(residents_back, 10, "keep-alive grains to be re-activated")
    rounds_then = checker.rounds
    # Keep load and checks going for a few consistent snapshots of the recovered cluster.
    await _wait_for(lambda: _true_after(checker.rounds >= rounds_then + 3), 20, "checks after recovery")
    stop.set()
    await asyncio.gather(*tasks)
    print(
        f"\nkill -9: declared dead after {detection_s:.3f}s (client view), first call served elsewhere "
        f"after {first_back:.3f}s, all {len(victim_keys)} grains after {all_back_s:.3f}s, "
        f"{len(victim_residents)} keep-alive grains re-activated unasked after "
        f"{detection_s + recovery_s + keep_alive_s:.3f}s; {len(rec.ok)} calls ok, {len(rec.failed)} failed "
        f"({sorted({f[3] for f in rec.failed})}), slowest call {rec.slowest_s:.3f}s, "
        f"{checker.rounds} consistency rounds"
    )
    assert not checker.problems, (str(victim.address), checker.problems[:5])
    assert checker.rounds >= 3
    # Only calls in flight on the killed silo may fail, with the documented error, promptly.
    for t0, t1, key, err in rec.failed:
        assert err == "SiloUnavailableError", (key, err)
        assert key in victim_keys
        assert t0 <= t_kill + detection_s + 0.5, "a call started after the death was declared failed"
    assert rec.slowest_s < CALL_TIMEOUT_S + 1.0, "a call outlived its deadline"
    # Caller's view: a grain's answers never come back to an activation it has left.
    seq: dict[str, list[str]] = defaultdict(list)
    for _, k, _, act in sorted(rec.ok):
        if not seq[k] or seq[k][-1] != act:
            assert act not in seq[k], f"{k} answered again from an activation it had left"
            seq[k].append(act)
    assert all(len(seq[k]) == 2 for k in victim_keys), {k: seq[k] for k in victim_keys}
    assert all(len(seq[k]) == 1 for k in keys if k not in victim_keys)


async def _true_after(value: bool) -> bool:
    return value


async def test_silo_paused_past_death_timeout_stops_itself_and_does_not_serve(
    silo_processes, client: ClusterClient
) -> None:
    procs = silo_processes(2, grains=GRAINS, env=ENV)  # the survivor declares alone
    await client.refresh()
    keys = [f"p{i}" for i in range(12)]
    placed = {k: (await client.get_grain(Tracked, k).hit())[0] for k in keys}
    victim = next(p for p in procs if str(p.address) in placed.values())
    assert victim.address is not None
    key = next(k for k, s in placed.items() if s == str(victim.address))

    victim.pause()
    t_pause = time.monotonic()
    # The call fails over once the hung silo is declared dead (no stale answer, no hang).
    result: list[str] | None = None
    while result is None:
        assert time.monotonic() - t_pause < 15, "hung silo's grain never served elsewhere"
        try:
            result = await client.get_grain(Tracked, key).with_timeout(CALL_TIMEOUT_S).hit()
        except errors.SiloUnavailableError:
            pass  # a call that was in flight on the hung silo when it was declared dead
    failover_s = time.monotonic() - t_pause
    assert result[0] != str(victim.address)
    assert client.view.is_dead(victim.address)
    assert failover_s >= FAST_MEMBERSHIP.dead_after_s * 0.9  # hung, not refused: the timeout path

    # Open a connection while it is still stopped, then resume it: the very first
    # request it reads must be refused (fenced), or the connection dropped.
    raw = Transport(TransportSettings(connect_timeout_s=5.0), client.codec)
    try:
        connecting = asyncio.ensure_future(raw.connect(victim.address.endpoint))
        await asyncio.sleep(0.05)
        victim.resume()
        answer: object = None
        try:
            conn = await connecting
            answer = await client.router.send(conn, Call(GrainId("Tracked", key), "hit", (), None, 3.0))
        except errors.RedgrainError as exc:
            answer = exc
        assert isinstance(answer, errors.SiloUnavailableError), f"resumed zombie answered: {answer!r}"
    finally:
        await raw.close()
    code = await asyncio.to_thread(victim.wait, 15)
    assert code == 3, victim.output()[-2000:]
    assert "declared dead" in victim.output()
    print(f"\nSIGSTOP: grain served elsewhere {failover_s:.3f}s after the pause; resumed silo exited {code}")


async def test_the_first_call_after_a_silo_is_killed_is_never_sent_to_it_and_is_retried(
    silo_processes, client: ClusterClient
) -> None:
    procs = silo_processes(2, grains=GRAINS, env=ENV)
    await client.refresh()
    where, _ = await client.get_grain(Tracked, "f").hit()
    victim = next(p for p in procs if str(p.address) == where)
    victim.kill()  # returns once the process is gone; our loop has not run since, so the
    # client still holds its connection to the dead silo and writes the next call to it.
    retries = client.router.statistics().retries
    # That write fails (the peer is gone): the call never left this process, so it is retried
    # (docs/concepts.md, Failure semantics: not delivered) and the survivor serves it.
    served_by, _ = await client.get_grain(Tracked, "f").with_timeout(CALL_TIMEOUT_S).hit()
    assert served_by != where
    assert client.router.statistics().retries > retries
