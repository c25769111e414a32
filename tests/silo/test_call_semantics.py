"""A call behaves the same at every distance: a grain on the caller's own silo is no exception.

Its deadline holds, and it shares nothing with its caller: arguments and
result are copied through the codec's rules (an unencodable value fails the
same way), except values marked ``@immutable``.
"""

from __future__ import annotations

import asyncio

import pytest

from silo import errors
from silo.testing import InProcessSilo
from tests.sample_grains import LocalProbe, NapCaller, Napper


async def _timed_out_and_cancelled(caller: object, napper: object) -> None:
    got = await caller.call_nap("n", 0.2, 30.0)  # type: ignore[attr-defined]
    assert got.startswith("timeout: ") and "Napper/n" in got, got
    # The callee's turn was cancelled at the deadline, as a remote caller's CANCEL does: it is
    # free at once (a turn still sleeping would hold this call for 30 s), and says so.
    assert await napper.with_timeout(5).last_nap() == "cancelled"  # type: ignore[attr-defined]


async def test_a_same_silo_call_honours_its_deadline_and_cancels_the_callee(cluster, client) -> None:
    (silo,) = await cluster(1)
    caller, napper = client.get_grain(NapCaller, "c"), client.get_grain(Napper, "n")
    await _timed_out_and_cancelled(caller, napper)
    assert silo.router.statistics().local_calls >= 1  # the nap went silo-local, not over a socket
    # Within its deadline the same call finishes as before.
    assert await caller.call_nap("n", 5.0, 0.01) == "finished"


async def test_the_in_process_harness_has_the_same_deadline() -> None:
    async with InProcessSilo([NapCaller, Napper]) as silo:
        await _timed_out_and_cancelled(silo.get_grain(NapCaller, "c"), silo.get_grain(Napper, "n"))
        with pytest.raises(errors.GrainTimeoutError):
            await silo.get_grain(Napper, "n").with_timeout(0.1).nap(30.0)
        assert await asyncio.wait_for(silo.get_grain(Napper, "n").last_nap(), 5) == "cancelled"


async def _shares_nothing(probe: object) -> None:
    seen = await probe.mutation_seen("a")  # type: ignore[attr-defined]
    # The callee appended to its own copy: the caller's list is as it was.
    assert seen == {"mine": ["caller"], "got": ["caller", "callee"], "same": False}, seen
    got = await probe.unregistered_result("o")  # type: ignore[attr-defined]
    assert got.startswith("CodecError: ") and "Unencodable" in got, got
    assert not await probe.identity("k", "tensor")  # type: ignore[attr-defined]
    assert not await probe.identity("k", "dict")  # type: ignore[attr-defined]
    # @immutable values are passed by reference (there and back).
    assert await probe.identity("k", "marked tensor")  # type: ignore[attr-defined]
    assert await probe.identity("k", "frozen")  # type: ignore[attr-defined]


async def test_a_same_silo_call_shares_nothing_with_its_caller(cluster, client) -> None:
    (silo,) = await cluster(1)
    before = silo.router.statistics().local_calls
    await _shares_nothing(client.get_grain(LocalProbe, "p"))
    assert silo.router.statistics().local_calls >= before + 6


async def test_the_in_process_harness_shares_nothing_either() -> None:
    from tests.sample_grains import Appender, Frozen, Keeper, Odd

    async with InProcessSilo([LocalProbe, Appender, Odd, Keeper]) as silo:
        await _shares_nothing(silo.get_grain(LocalProbe, "p"))
        # The test's own calls into the harness are local calls too.
        mine = ["test"]
        assert await silo.get_grain(Appender, "t").append_to(mine) == ["test", "callee"] and mine == ["test"]
        frozen = Frozen(value=1)
        assert await silo.get_grain(Keeper, "t").keep_frozen(frozen) is frozen


async def test_across_silos_the_same_calls_behave_the_same(cluster, client) -> None:
    """The reference: the probe on one silo, its callees on the other (marked values are
    encoded there, so identity holds only beside the caller)."""
    silos = await cluster(2)
    for i in range(10):
        probe = client.get_grain(LocalProbe, f"x{i}")
        seen = await probe.mutation_seen(f"x{i}")
        got = await probe.unregistered_result(f"x{i}")
        assert seen["mine"] == ["caller"] and seen["got"] == ["caller", "callee"], seen
        assert got.startswith("CodecError: ") and "Unencodable" in got, got
    # Some of those calls crossed silos (two silos, ten keys of each type, random placement).
    assert sum(s.router.statistics().calls - s.router.statistics().local_calls for s in silos) > 0
