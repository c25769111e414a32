"""Each placement strategy places as specified (directors are pure functions of the view)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from grains.ids import GrainId, SiloAddress
from grains.placement import Placement
from silo import errors
from silo.cluster.placement import Placer
from silo.records.membership import MemberRow, SiloLoad, SiloStatus


def row(port: int, *, roles: tuple[str, ...] = (), acts: int = 0, cpu: float = 0.0, gen: int = 1) -> MemberRow:
    return MemberRow(
        address=str(SiloAddress("10.0.0.1", port, gen)), host="10.0.0.1", port=port, generation=gen,
        status=SiloStatus.ACTIVE, roles=list(roles), load=SiloLoad(activations=acts, cpu_percent=cpu),
    )  # fmt: skip


GRAINS = [GrainId("T", str(i)) for i in range(2000)]


def test_hash_placement_is_stable_across_callers_and_moves_about_one_nth_on_join() -> None:
    silos = [row(p) for p in range(7000, 7004)]
    hashed = Placement("hash")
    a, b = Placer(random.Random(1)), Placer(random.Random(2))
    before = {g: a.place(g, hashed, silos, None) for g in GRAINS}
    # Another caller, another order of the view, a caller that is itself a silo: same answer.
    assert before == {g: b.place(g, hashed, list(reversed(silos)), silos[0].silo) for g in GRAINS}
    after = {g: a.place(g, hashed, [*silos, row(7004)], None) for g in GRAINS}
    moved = [g for g in GRAINS if before[g] != after[g]]
    assert all(after[g].port == 7004 for g in moved), "a join only moves grains to the new silo"
    assert 0.12 < len(moved) / len(GRAINS) < 0.28  # ~1/5
    # A restarted silo (new generation, same endpoint) gets the same grains back.
    restarted = [row(7000, gen=2), *silos[1:]]
    again = {g: a.place(g, hashed, restarted, None) for g in GRAINS}
    assert all((again[g].port, before[g].port) == (before[g].port, before[g].port) for g in GRAINS)


def test_silo_role_places_only_on_silos_with_the_role() -> None:
    silos = [row(7000), row(7001, roles=("gpu",)), row(7002, roles=("gpu", "big"))]
    placer = Placer(random.Random(3))
    chosen = Counter(placer.place(g, Placement("silo_role", "gpu"), silos, silos[0].silo).port for g in GRAINS[:400])
    assert set(chosen) == {7001, 7002}
    with pytest.raises(errors.SiloUnavailableError, match="role 'tpu'"):
        placer.place(GRAINS[0], Placement("silo_role", "tpu"), silos, None)


def test_prefer_local_places_on_the_calling_silo_and_randomly_from_a_client() -> None:
    silos = [row(p) for p in range(7000, 7003)]
    placer = Placer(random.Random(4))
    assert {placer.place(g, Placement("prefer_local"), silos, silos[1].silo) for g in GRAINS[:200]} == {silos[1].silo}
    from_client = Counter(placer.place(g, Placement("prefer_local"), silos, None).port for g in GRAINS[:600])
    assert set(from_client) == {7000, 7001, 7002}
    # A caller silo that does not host the type: someone who does.
    assert placer.place(GRAINS[0], Placement("prefer_local"), silos[:2], silos[2].silo) in {s.silo for s in silos[:2]}


def test_activation_count_prefers_the_less_loaded_of_two_choices() -> None:
    silos = [row(7000, acts=500), row(7001, acts=10), row(7002, acts=20)]
    placer = Placer(random.Random(5))
    chosen = Counter(placer.place(g, Placement("activation_count"), silos, None).port for g in GRAINS[:600])
    assert chosen[7000] == 0  # always the worse of any pair it is drawn in
    assert chosen[7001] > chosen[7002] > 0


def test_resource_optimized_avoids_a_busy_silo_and_spreads_over_equal_ones() -> None:
    busy = row(7000, acts=400, cpu=95.0)
    idle = [row(7001, acts=100, cpu=10.0), row(7002, acts=100, cpu=10.0)]
    placer = Placer(random.Random(6))
    chosen = Counter(placer.place(g, Placement("resource"), [busy, *idle], None).port for g in GRAINS[:600])
    assert chosen[7000] == 0
    assert min(chosen[7001], chosen[7002]) > 200


def test_random_spreads_roughly_evenly() -> None:
    silos = [row(p) for p in range(7000, 7004)]
    placer = Placer(random.Random(7))
    chosen = Counter(placer.place(g, Placement("random"), silos, None).port for g in GRAINS)
    assert all(380 < n < 620 for n in chosen.values()) and len(chosen) == 4


async def test_placement_markers_place_real_grains_as_declared(cluster, client) -> None:  # type: ignore[no-untyped-def]
    plain = await cluster(2, grains=("tests.silo.cluster.grains",))
    (gpu,) = await cluster(1, grains=("tests.silo.cluster.grains",), roles=("gpu",))
    await client.refresh()
    from tests.silo.cluster.grains import Hashed, Local, OnGpu

    assert {(await client.get_grain(OnGpu, i).hit())[0] for i in range(12)} == {str(gpu.address)}
    # Hash placement: what the director computes from the view is where it lands.
    rows = client.view.hosting("Hashed")
    for i in range(12):
        expected = Placer().place(GrainId("Hashed", str(i)), Placement("hash"), rows, None)
        assert (await client.get_grain(Hashed, i).hit())[0] == str(expected)
    # Prefer-local: a grain calling a new prefer-local grain gets it on its own silo.
    for i in range(6):
        here, _ = await client.get_grain(Local, f"a{i}").hit()
        there, _ = await client.get_grain(Local, f"a{i}").via(f"b{i}")
        assert there == here
    assert plain  # the two role-less silos took part
