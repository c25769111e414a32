"""Directory races against the real Redis directory, on one Redis and on the
3-master Redis Cluster (where register cannot read membership in its script):
concurrent registers and unregisters of a few grains from several simulated
silos, some declared dead mid-run, always end consistent."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.cluster.directory import RedisGrainDirectory
from silo.cluster.membership import RedisMembershipTable
from silo.keys import Keys
from silo.records.membership import MemberRow, SiloStatus
from silo.redis_util import connect_redis

N_SILOS = 4
GRAINS = [GrainId("Race", str(i)) for i in range(4)]
_names = itertools.count()

op = st.tuples(st.integers(0, N_SILOS - 1), st.integers(0, len(GRAINS) - 1), st.booleans())
scenario = st.tuples(
    st.lists(op, min_size=10, max_size=80),
    # (after how many completed ops, which silo dies); silo 0 always survives
    st.lists(st.tuples(st.integers(0, 60), st.integers(1, N_SILOS - 1)), max_size=2),
)


@dataclass
class SimSilo:
    address: SiloAddress
    directory: RedisGrainDirectory
    owned: dict[GrainId, str] = field(default_factory=dict)
    dead: bool = False


class Violation(AssertionError):
    pass


async def _run(url: str, ops: list[tuple[int, int, bool]], kills: list[tuple[int, int]]) -> None:
    redis = connect_redis(url)
    keys = Keys(f"race{next(_names)}")
    table = RedisMembershipTable(redis, keys)
    silos = []
    for i in range(N_SILOS):
        addr = SiloAddress("127.0.0.1", 9000 + i, 1)
        row = MemberRow(address=str(addr), host=addr.host, port=addr.port, generation=1)
        await table.join(row)
        await table.set_status(str(addr), SiloStatus.ACTIVE)
        silos.append(SimSilo(addr, RedisGrainDirectory(redis, keys)))
    wins: dict[GrainId, list[int]] = {g: [] for g in GRAINS}
    done = 0
    progressed = asyncio.Event()

    def check_disjoint() -> None:
        seen: dict[GrainId, SiloAddress] = {}
        for s in silos:
            if s.dead:
                continue
            for g in s.owned:
                if g in seen:
                    raise Violation(f"{g} owned by {seen[g]} and {s.address} at once")
                seen[g] = s.address

    async def play(s: SimSilo, mine: list[tuple[int, bool]]) -> None:
        nonlocal done
        for gi, register in mine:
            g = GRAINS[gi]
            if s.dead:
                break
            if register and g not in s.owned:
                act = uuid.uuid4().hex
                try:
                    entry = await s.directory.register(g, s.address, act)
                except errors.MembershipError:
                    assert s.dead, "a live silo was refused"
                    break
                if entry.activation_id == act:
                    s.owned[g] = act
                    wins[g].append(entry.token)
            elif not register and g in s.owned:
                act = s.owned.pop(g)  # forget first: the grain is free the moment Redis says so
                await s.directory.unregister(g, s.address, act)
            done += 1
            check_disjoint()
            progressed.set()
            await asyncio.sleep(0)

    async def killer() -> None:
        for after, victim in sorted(kills):
            while done < after and any(not t.done() for t in players):
                progressed.clear()
                await progressed.wait()
            s = silos[victim]
            if s.dead:
                continue
            # Dead from the moment it is being declared: from then on it is a
            # zombie whose claims no longer count (fencing tokens guard its writes).
            s.dead = True
            await table.set_status(str(s.address), SiloStatus.DEAD)
            await silos[0].directory.purge_silo(s.address)

    per_silo: list[list[tuple[int, bool]]] = [[] for _ in silos]
    for si, gi, register in ops:
        per_silo[si].append((gi, register))
    players = [asyncio.ensure_future(play(s, mine)) for s, mine in zip(silos, per_silo, strict=True)]
    kill_task = asyncio.ensure_future(killer())
    try:
        await asyncio.gather(*players)
        progressed.set()
        await kill_task
        # --- the end state -------------------------------------------------
        live = {s.address: s for s in silos if not s.dead}
        for g in GRAINS:
            entry = await silos[0].directory.lookup(g)
            owners = [s.address for s in live.values() if g in s.owned]
            assert len(owners) <= 1
            if entry is None:
                assert not owners, f"{g}: {owners} think they own it but it has no entry"
                continue
            if entry.silo in live:
                assert live[entry.silo].owned.get(g) == entry.activation_id, f"{g}: entry is not its owner's"
            else:
                # Dead silos were purged, and the directory refuses their registrations.
                raise Violation(f"{g}: entry names dead silo {entry.silo}")
            assert wins[g], f"{g}: an entry nobody won"
            assert entry.token == max(wins[g]), f"{g}: latest entry has not the highest token"
            assert len(set(wins[g])) == len(wins[g])
        # Index sets match entries exactly.
        for s in silos:
            index = {m.decode() for m in await redis.smembers(keys.directory_index(str(s.address)))}
            named = {str(g) for g in GRAINS if (await redis.hget(keys.directory_entry(str(g)), "silo") or b"").decode() == str(s.address)}
            assert index == named, f"index of {s.address}: {index} != entries {named}"
    finally:
        for t in [*players, kill_task]:
            t.cancel()
        await redis.aclose()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario)
def test_concurrent_registers_and_unregisters_with_deaths_end_consistent(backend_url: str, case) -> None:  # type: ignore[no-untyped-def]
    ops, kills = case
    asyncio.run(_run(backend_url, ops, kills))
