"""The edges of a call mean the same at every distance (docs/concepts.md, "The same call at every
distance"): the callee on the caller's silo, on another silo, called from a client, and in the
in-process harness (alone, and two silos over the transport twin).

- An error is caught by its own type (and still as RemoteGrainError), with the remote traceback.
- A caller's cancellation cancels the callee's running turn and drops its queued call.
- A one-way call, or a call from a background task (``start_task``), carries no waiting chain:
  the callee calling back is no deadlock.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from silo import errors
from silo.messaging.router import Router
from silo.testing import InProcessCluster, InProcessSilo
from tests.edge_grains import (
    CancelProbe,
    ErrorProbe,
    Pinger,
    Ponger,
    QuotaError,
    Raiser,
    Sleeper,
    SlowStart,
    cancel_nap_and_queued,
    cancel_while_activating,
    caught,
)

GRAINS = ("tests.edge_grains",)
EDGE_CLASSES = [Raiser, ErrorProbe, Sleeper, CancelProbe, Pinger, Ponger, SlowStart]

# What each kind of error looks like to the caller's except clauses, wherever the callee is.
EXPECTED: dict[str, dict[str, Any]] = {
    "value": {"value": True, "key": False, "quota": False, "args": ["bad value"], "used": None},
    "key": {"value": False, "key": True, "quota": False, "args": ["missing"], "used": None},
    "quota": {"value": False, "key": False, "quota": True, "args": ["quota used up: 7"], "used": 7},
    # json.JSONDecodeError is named nowhere here: it is caught as the builtin it derives from.
    "json": {"value": True, "key": False, "quota": False, "used": None},
}


async def _place(two: InProcessCluster, caller: Any, callee: Any) -> None:
    """``caller`` on the first in-process silo, ``callee`` on the second."""
    a, b = two.silos
    assert isinstance(a.router, Router)
    await a.router.activate(caller.grain_id, a.address)
    await a.router.activate(callee.grain_id, b.address)


def _check_caught(seen: dict[str, Any], kind: str) -> None:
    want = {**EXPECTED[kind], "remote": True, "traceback": True}
    assert {k: seen[k] for k in want} == want, (kind, seen)


async def _errors_from_a_probe(probe: Any, raiser_key: str) -> None:
    for kind in EXPECTED:
        _check_caught(await probe.probe(raiser_key, kind), kind)


async def _errors_from_here(raiser: Any) -> None:
    for kind in EXPECTED:
        with pytest.raises(Exception) as info:
            await raiser.fail(kind)
        _check_caught(caught(info.value), kind)
    with pytest.raises(ValueError, match="bad value") as value_error:
        await raiser.fail("value")
    assert isinstance(value_error.value, errors.RemoteGrainError) and value_error.value.type_name == "ValueError"
    with pytest.raises(QuotaError):
        await raiser.fail("quota")
    # A type no except clause here could name is still a RemoteGrainError naming it.
    with pytest.raises(errors.RemoteGrainError, match="RuntimeError: other") as other:
        await raiser.fail("other")
    assert isinstance(other.value, RuntimeError)


# --- errors ------------------------------------------------------------------------------------


async def test_a_callees_error_is_caught_by_its_type_on_the_same_silo(cluster, client) -> None:
    (silo,) = await cluster(1, grains=GRAINS)
    await _errors_from_a_probe(client.get_grain(ErrorProbe, "p"), "r")
    assert silo.router.statistics().local_calls >= len(EXPECTED)


async def test_a_callees_error_is_caught_by_its_type_from_another_silo(cluster, client) -> None:
    a, b = await cluster(2, grains=GRAINS)
    probe, raiser = client.get_grain(ErrorProbe, "p"), client.get_grain(Raiser, "r")
    await client.router.activate(probe.grain_id, a.address)
    await client.router.activate(raiser.grain_id, b.address)
    await _errors_from_a_probe(probe, "r")
    assert a.router.statistics().local_calls == 0


async def test_a_callees_error_is_caught_by_its_type_from_a_client(cluster, client) -> None:
    await cluster(1, grains=GRAINS)
    await _errors_from_here(client.get_grain(Raiser, "r"))


async def test_the_in_process_harness_raises_the_same_errors() -> None:
    async with InProcessSilo(EDGE_CLASSES) as silo:
        await _errors_from_here(silo.get_grain(Raiser, "r"))
        await _errors_from_a_probe(silo.get_grain(ErrorProbe, "p"), "r")
    async with InProcessCluster(EDGE_CLASSES, silos=2) as two:
        a = two.silos[0]
        probe = a.get_grain(ErrorProbe, "p")
        await _place(two, probe, a.get_grain(Raiser, "r"))
        await _errors_from_a_probe(probe, "r")
        await _errors_from_here(a.get_grain(Raiser, "r"))


# --- cancellation --------------------------------------------------------------------------------

CANCELLED = {"last": "cancelled", "marks": []}


async def test_a_callers_cancellation_reaches_the_callee_on_the_same_silo(cluster, client) -> None:
    (silo,) = await cluster(1, grains=GRAINS)
    assert await client.get_grain(CancelProbe, "c").run("s") == CANCELLED
    assert silo.router.statistics().local_calls >= 2


async def test_a_callers_cancellation_reaches_the_callee_on_another_silo(cluster, client) -> None:
    a, b = await cluster(2, grains=GRAINS)
    probe, sleeper = client.get_grain(CancelProbe, "c"), client.get_grain(Sleeper, "s")
    await client.router.activate(probe.grain_id, a.address)
    await client.router.activate(sleeper.grain_id, b.address)
    assert await probe.run("s") == CANCELLED


@pytest.mark.parametrize("how", ["cancel", "timeout", "taskgroup"])
async def test_a_clients_cancellation_reaches_the_callee(cluster, client, how: str) -> None:
    await cluster(1, grains=GRAINS)
    assert await cancel_nap_and_queued(client.get_grain(Sleeper, "s"), how) == CANCELLED


async def test_the_in_process_harness_cancels_the_same_way() -> None:
    async with InProcessSilo(EDGE_CLASSES) as silo:
        for how in ("cancel", "timeout", "taskgroup"):
            assert await cancel_nap_and_queued(silo.get_grain(Sleeper, how), how) == CANCELLED, how
        assert await silo.get_grain(CancelProbe, "c").run("t") == CANCELLED
    async with InProcessCluster(EDGE_CLASSES, silos=2) as two:
        a, b = two.silos
        probe = a.get_grain(CancelProbe, "c")
        await _place(two, probe, a.get_grain(Sleeper, "s"))
        assert await probe.run("s") == CANCELLED
        assert await cancel_nap_and_queued(b.get_grain(Sleeper, "u")) == CANCELLED


async def test_a_call_cancelled_while_its_grain_activates_never_runs(cluster, client) -> None:
    """From a client and from another silo. (On the same silo the caller's own task waits for
    the activation, so a cancelled call is never queued; that needs no CANCEL.)"""
    (a,) = await cluster(1, grains=GRAINS)
    (b,) = await cluster(1, grains=GRAINS, roles=("slow",))  # where SlowStart is placed
    barrier, probe = client.get_grain(Sleeper, "barrier"), client.get_grain(CancelProbe, "p")
    await client.router.activate(barrier.grain_id, b.address)
    await client.router.activate(probe.grain_id, a.address)
    assert await cancel_while_activating(client.get_grain(SlowStart, "from-client"), barrier) == []
    assert await probe.run_activating("from-a", "barrier") == []


async def test_the_in_process_harness_drops_a_call_cancelled_while_its_grain_activates() -> None:
    async with InProcessCluster(EDGE_CLASSES, silos=1) as two:
        a = two.silos[0]
        await two.add_silo(roles=["slow"])  # where SlowStart is placed
        probe = a.get_grain(CancelProbe, "p")
        await _place(two, probe, a.get_grain(Sleeper, "barrier"))
        assert await probe.run_activating("from-a", "barrier") == []


async def test_a_grain_shields_work_from_its_callers_cancellation() -> None:
    async with InProcessSilo(EDGE_CLASSES) as silo:
        sleeper = silo.get_grain(Sleeper, "s")
        call = asyncio.ensure_future(sleeper.shielded())
        await sleeper.started()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # The turn was cancelled, the shielded work it started was not.
        assert await asyncio.wait_for(sleeper.wait_work(), 5) is True
        assert (await sleeper.report())["last"] == "cancelled"


# --- no deadlock where nothing waits ----------------------------------------------------------------


async def _called_back(pinger: Any, ponger: Any, how: str) -> str:
    await (pinger.notify(ponger.key) if how == "one-way" else pinger.spawn(ponger.key))
    outcome: str = await ponger.wait_outcome()
    return outcome


@pytest.mark.parametrize("how", ["one-way", "start_task"])
async def test_a_call_back_into_an_idle_grain_is_no_deadlock_on_the_same_silo(cluster, client, how: str) -> None:
    await cluster(1, grains=GRAINS)
    assert await _called_back(client.get_grain(Pinger, "a"), client.get_grain(Ponger, "b"), how) == "pong"


@pytest.mark.parametrize("how", ["one-way", "start_task"])
async def test_a_call_back_into_an_idle_grain_is_no_deadlock_across_silos(cluster, client, how: str) -> None:
    a, b = await cluster(2, grains=GRAINS)
    pinger, ponger = client.get_grain(Pinger, "a"), client.get_grain(Ponger, "b")
    await client.router.activate(pinger.grain_id, a.address)
    await client.router.activate(ponger.grain_id, b.address)
    assert await _called_back(pinger, ponger, how) == "pong"


@pytest.mark.parametrize("how", ["one-way", "start_task"])
async def test_the_in_process_harness_sees_no_deadlock_either(how: str) -> None:
    async with InProcessSilo(EDGE_CLASSES) as silo:
        assert await _called_back(silo.get_grain(Pinger, "a"), silo.get_grain(Ponger, "b"), how) == "pong"
    async with InProcessCluster(EDGE_CLASSES, silos=2) as two:
        a = two.silos[0]
        pinger, ponger = a.get_grain(Pinger, "a"), a.get_grain(Ponger, "b")
        await _place(two, pinger, ponger)
        assert await _called_back(pinger, ponger, how) == "pong"

