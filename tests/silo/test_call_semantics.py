"""A call's deadline holds at every distance: a grain on the caller's own silo is no exception."""

from __future__ import annotations

import asyncio

import pytest

from silo import errors
from silo.testing import InProcessSilo
from tests.sample_grains import NapCaller, Napper


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
