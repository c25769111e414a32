"""``@version(n)``: method lists per (type, version), refreshed when a method is unknown, and a call
served only by an activation whose version has the method (silo/cluster/versions.py has the rule).

Silos here run in the test process over a real Redis; tests/silo/test_rolling_upgrade.py runs the
whole upgrade on silo processes under load."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from grains import version
from grains.call import Call
from grains.ids import GrainId
from grains.placement import Placement, grain_options
from silo import errors
from silo.client import ClusterClient
from silo.cluster.versions import compatible
from silo.keys import Keys, manifest_field
from silo.messaging.manifests import Manifests, TypeInfo
from silo.records.membership import MemberRow
from silo.testing.harness import InProcessCluster
from tests.silo.ledger_v1 import LedgerV1
from tests.silo.ledger_v2 import LedgerV2

V1 = ("tests.silo.ledger_v1",)
V2 = ("tests.silo.ledger_v2",)


def test_version_defaults_to_one_and_rejects_what_is_not_a_positive_int() -> None:
    assert grain_options(LedgerV1).version == 1 and grain_options(LedgerV2).version == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="grain version"):
            version(bad)  # type: ignore[arg-type]


def _row(port: int, v: int) -> MemberRow:
    return MemberRow(address=f"h:{port}", host="h", port=port, generation=1, grain_types=["T"], grain_versions={"T": v})


def test_the_rule_picks_the_silos_of_the_newest_version_that_has_the_method() -> None:
    rows = [_row(1, 1), _row(2, 2), _row(3, 2), _row(4, 3)]
    versions = {1: frozenset({"a", "old"}), 2: frozenset({"a", "new"}), 3: frozenset({"a"})}
    assert [r.port for r in compatible(rows, "T", versions, "a")] == [4]
    assert [r.port for r in compatible(rows, "T", versions, "new")] == [2, 3]
    assert [r.port for r in compatible(rows, "T", versions, "old")] == [1]
    assert compatible(rows, "T", versions, "gone") == []
    assert [r.port for r in compatible(rows, "T", versions, None)] == [4]
    # A row of a version whose manifest was not read yet never takes a named method.
    assert [r.port for r in compatible(rows, "T", {1: versions[1]}, "a")] == [1]


async def test_each_version_publishes_its_own_method_list_and_its_silos_say_which_they_host(cluster) -> None:
    (a,) = await cluster(1, grains=V1)
    (b,) = await cluster(1, grains=V2)
    raw = await a.redis.hgetall(a.keys.grain_manifests)
    fields = {k.decode() for k in raw}
    assert {manifest_field("Ledger", 1), manifest_field("Ledger", 2)} <= fields
    await a.view.refresh()
    assert a.view.row(a.address).version_of("Ledger") == 1  # type: ignore[arg-type, union-attr]
    assert a.view.row(b.address).version_of("Ledger") == 2  # type: ignore[arg-type, union-attr]


async def test_a_client_connected_before_v2_calls_its_new_method_and_the_grain_moves_to_v2(
    cluster, redis_url: str, cluster_name: str
) -> None:
    (a,) = await cluster(1, grains=V1)
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as client:
        assert await client.get_grain(LedgerV1, "k").add(5) == (5, 1)
        assert "summary" not in client.manifests.get_nowait("Ledger").methods  # type: ignore[union-attr]
        (b,) = await cluster(1, grains=V2)
        # The activation is on the v1 silo, whose version lacks the method: deactivated there,
        # placed again on the v2 silo, with the state v1 wrote.
        assert await client.get_grain(LedgerV2, "k").summary() == {"total": 5, "entries": 1, "label": "unlabelled", "version": 2}
        assert GrainId("Ledger", "k") not in {act.grain_id for act in a.catalog.activations()}
        assert GrainId("Ledger", "k") in {act.grain_id for act in b.catalog.activations()}
        assert a.dispatcher.statistics().version_mismatches == 1
        # Old code keeps calling the methods both versions have: served by v2 now.
        assert await client.get_grain(LedgerV1, "k").add(1) == (6, 2)
        # A reference by name knows the new method once the manifests were read again.
        assert (await client.get_grain("Ledger", "k").summary())["total"] == 6


async def test_a_one_way_call_of_a_new_method_turned_away_by_a_v1_silo_is_sent_on_by_that_silo(
    cluster, client: ClusterClient
) -> None:
    (a,) = await cluster(1, grains=V1)
    assert await client.get_grain(LedgerV1, "o").add(2) == (2, 1)
    await cluster(1, grains=V2)
    # Sent to the v1 silo, where the grain lives; the caller has moved on when it is turned away.
    assert await client.get_grain(LedgerV2, "o").relabel("gold") is None
    async with asyncio.timeout(5):
        while (await client.get_grain(LedgerV2, "o").summary())["label"] != "gold":
            await asyncio.sleep(0.01)
    # Turned away there (then the summary calls too, until the client's cache forgot the v1 silo).
    assert a.dispatcher.statistics().version_mismatches >= 1
    assert a.dispatcher.statistics().one_way_failed == 0


async def test_new_activations_go_to_the_newest_version_and_the_old_silo_makes_none(cluster, client: ClusterClient) -> None:
    (a,) = await cluster(1, grains=V1)
    assert await client.get_grain(LedgerV1, "old").add(1) == (1, 1)
    await cluster(1, grains=V2)
    await client.refresh()
    for i in range(10):
        assert (await client.get_grain(LedgerV1, f"new{i}").add(1))[1] == 2
    assert await client.get_grain(LedgerV1, "old").add(1) == (2, 1)  # existing activations stay
    # A call that reaches the old silo for a grain it does not host (a stale cache) is turned away
    # there, unrun, and placed on the new version.
    call = Call(GrainId("Ledger", "stale"), "add", (1,), None, 5.0)
    with pytest.raises(errors.VersionMismatchError) as info:
        await a.dispatcher.dispatch(call, _deadline(5.0))
    assert info.value.version == 1 and info.value.wanted == 2
    assert await a.router.invoke(call) == (1, 2)


def _deadline(s: float) -> float:
    return asyncio.get_running_loop().time() + s


async def test_a_method_no_version_has_fails_after_one_refresh_naming_type_method_and_versions(
    cluster, client: ClusterClient
) -> None:
    await cluster(1, grains=V1)
    await cluster(1, grains=V2)
    await client.refresh()
    before = client.manifests.refreshes
    call = Call(GrainId("Ledger", "x"), "nope", (), None, 5.0)
    for _ in range(3):
        with pytest.raises(errors.UnknownMethodError) as info:
            await client.router.invoke(call)
        assert "'Ledger'" in str(info.value) and "'nope'" in str(info.value) and "versions known: 1, 2" in str(info.value)
    assert client.manifests.refreshes == before + 1  # one read per unknown method per period


async def test_after_a_rollback_a_method_only_the_gone_version_had_fails_clearly(cluster, client: ClusterClient) -> None:
    await cluster(1, grains=V1)
    (b,) = await cluster(1, grains=V2)
    await client.refresh()
    assert (await client.get_grain(LedgerV2, "r").summary())["version"] == 2
    await b.stop()
    await client.refresh()
    with pytest.raises(errors.SiloUnavailableError, match="no active silo hosts a version of Ledger with method 'summary'"):
        await client.get_grain(LedgerV2, "r").with_timeout(5).summary()
    assert await client.get_grain(LedgerV1, "r").add(1) == (1, 1)  # the rest of the type still works



async def test_the_in_process_cluster_serves_versions_the_same_way() -> None:
    async with InProcessCluster([LedgerV1], silos=1) as world:
        (old,) = world.silos
        assert await old.get_grain(LedgerV1, "h").add(3) == (3, 1)
        new = await world.add_silo([LedgerV2])
        # From the old silo, which knew only v1 when it started: the grain moves to v2.
        assert (await old.get_grain(LedgerV2, "h").summary())["total"] == 3
        assert new.activation(new.get_grain(LedgerV2, "h")) is not None
        assert old.activation(old.get_grain(LedgerV1, "h")) is None


class _GatedManifests(Manifests):
    """Manifests whose Redis read waits for the test, with a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(cast(Any, None), Keys("t"), refresh_period_s=1.0, clock=lambda: self.now)
        self.published: dict[str, dict[int, TypeInfo]] = {"T": {1: _info(1, "a")}}
        self.gate = asyncio.Event()

    async def _fetch(self) -> dict[str, dict[int, TypeInfo]]:
        await self.gate.wait()
        return {n: dict(v) for n, v in self.published.items()}


def _info(v: int, *methods: str) -> TypeInfo:
    return TypeInfo("T", frozenset(methods), Placement(), version=v)


async def test_misses_of_one_method_share_one_read_and_another_read_waits_a_period() -> None:
    m = _GatedManifests()
    m.gate.set()
    await m.refresh()
    m.gate.clear()
    m.published["T"][2] = _info(2, "a", "b")  # version 2 is published after our first read
    both = asyncio.gather(m.with_method("T", "b"), m.with_method("T", "b"))
    await asyncio.sleep(0)
    m.gate.set()
    first, second = await both
    assert first.versions_with("b") == second.versions_with("b") == [2]
    assert m.refreshes == 2  # the startup read and one shared by both misses
    m.gate.set()
    for _ in range(3):  # a method nobody has: one read, then refused at once for the period
        with pytest.raises(errors.UnknownMethodError, match=r"versions known: 1, 2"):
            await m.with_method("T", "zzz")
    assert m.refreshes == 3
    m.now += 1.0
    with pytest.raises(errors.UnknownMethodError):
        await m.with_method("T", "zzz")
    assert m.refreshes == 4  # a period later: read again


async def test_a_v1_silo_serving_a_write_keeps_the_field_v2_set(cluster, client: ClusterClient) -> None:
    await cluster(1, grains=V1)
    (b,) = await cluster(1, grains=V2)
    await client.refresh()
    ledger = client.get_grain(LedgerV2, "kept")
    await ledger.relabel("gold")  # one-way: read back to know it ran
    async with asyncio.timeout(5):
        while (await ledger.summary())["label"] != "gold":
            await asyncio.sleep(0.01)
    await b.stop()  # a rollback: v1 serves the grain now, and writes it
    await client.refresh()
    assert await client.get_grain(LedgerV1, "kept").add(1) == (1, 1)
    await cluster(1, grains=V2)
    await client.refresh()
    assert await ledger.summary() == {"total": 1, "entries": 1, "label": "gold", "version": 2}


V3 = ("tests.silo.ledger_v3",)


async def test_callers_of_a_removed_and_a_new_method_alternating_never_bounce_the_grain(
    cluster, client: ClusterClient
) -> None:
    # v3 removed `total` and added `audit`. Old callers (total) and new ones (audit) alternate:
    # the grain moves forward to v3 once and stays; the old callers are told why, unrun.
    silos = [*await cluster(1, grains=V2), *await cluster(1, grains=V3)]
    await client.refresh()
    old, new = client.get_grain(LedgerV2, "b"), client.get_grain("Ledger", "b")
    results: list[Any] = []
    for i in range(20):
        try:
            results.append(await (old.total() if i % 2 == 0 else new.audit()))
        except errors.UnknownMethodError as exc:
            results.append(exc)
    activated = sum(s.catalog.statistics().activated_total for s in silos)
    assert activated == 2, activated  # once on v2 (the first call, total), once on v3 (audit)
    assert results[:2] == [0, 0] and results[3::2] == [0] * 9
    removed = results[2::2]
    assert all(isinstance(e, errors.MethodRemovedError) for e in removed), removed
    text = str(removed[0])
    assert "Ledger/b" in text and "version 3" in text and "'total'" in text and "versions with it: 2" in text
    assert removed[0].versions == [2] and removed[0].version == 3


async def test_a_by_name_reference_learns_a_type_and_a_version_published_after_it_was_made(
    cluster, redis_url: str, cluster_name: str
) -> None:
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as client:
        ledger = client.get_grain("Ledger", "late")  # no silo hosts the type yet: still a reference
        with pytest.raises(errors.UnknownGrainError, match="'Ledger'"):
            await ledger.total()
        with pytest.raises(AttributeError):
            ledger._private  # noqa: B018
        await cluster(1, grains=V1)
        # The same reference, the next call: the manifests are read again and the type is there.
        assert await ledger.add(2) == (2, 1)
        assert await ledger.total() == 2
        with pytest.raises(errors.UnknownMethodError, match="'nope'"):
            await ledger.nope()
        await cluster(1, grains=V2)
        # A method of a version published after the reference was made: found when called.
        assert (await ledger.with_timeout(5).summary())["total"] == 2
        assert await ledger.relabel("gold") is None  # one-way in v2: the reference learns that too
        async with asyncio.timeout(5):
            while (await ledger.summary())["label"] != "gold":
                await asyncio.sleep(0.01)


async def test_redgrain_call_by_name_reaches_a_method_and_names_an_unknown_one(
    cluster, redis_url: str, cluster_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from grains.cli import main as cli

    await cluster(1, grains=V2)
    base = ["call", "--redis", redis_url, "--cluster", cluster_name, "Ledger", "cli"]
    assert await asyncio.to_thread(cli.main, [*base, "add", "4"]) == 0
    assert await asyncio.to_thread(cli.main, [*base, "summary"]) == 0
    assert '"total": 4' in capsys.readouterr().out
    assert await asyncio.to_thread(cli.main, [*base, "nope"]) != 0
    assert "'nope'" in capsys.readouterr().err
