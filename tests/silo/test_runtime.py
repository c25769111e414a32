"""The runtime core over real Redis and TCP: activation, turns, errors, timers, placement.

Turn order, reentrancy, @interleave, deadlocks, re-routing and idle collection on
virtual time are tested on the in-memory twins in ``tests/silo/catalog/``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from silo import errors
from silo.client import ClusterClient
from tests.sample_grains import (
    Counter,
    Echo,
    Fragile,
    NamedGrain,
    PingPong,
    ReentrantPingPong,
    Relay,
    Sequencer,
    Ticker,
    Worker,
)


async def test_first_call_activates_the_grain_on_demand(cluster, client: ClusterClient) -> None:
    (silo,) = await cluster(1)
    assert len(silo.catalog) == 0
    assert await client.get_grain(Echo, "a").echo({"x": [1, 2]}) == {"x": [1, 2]}
    assert [a.grain_id.key for a in silo.catalog.activations()] == ["a"]


async def test_thousand_concurrent_calls_run_one_at_a_time_in_order(cluster, client: ClusterClient) -> None:
    await cluster(1)
    seq = client.get_grain(Sequencer, "s")
    await seq.history()  # activate first so arrival order is send order
    results = await asyncio.gather(*(seq.step(i) for i in range(1000)))
    assert results == list(range(1000))
    assert await seq.history() == list(range(1000))
    assert await seq.concurrency() == 1


async def test_two_silos_two_clients_same_keys_one_activation_each(
    cluster, redis_url: str, cluster_name: str
) -> None:
    silos = await cluster(2)
    clients = [await ClusterClient.connect(redis_url, cluster=cluster_name) for _ in range(2)]
    try:
        calls = [c.get_grain(Counter, f"k{i}").add(1) for i in range(100) for c in clients for _ in range(3)]
        await asyncio.gather(*calls)
        per_key: dict[str, int] = {}
        for silo in silos:
            for act in silo.catalog.activations():
                per_key[act.grain_id.key] = per_key.get(act.grain_id.key, 0) + 1
        assert sorted(per_key) == sorted(f"k{i}" for i in range(100))
        assert set(per_key.values()) == {1}
        totals = await asyncio.gather(*(clients[0].get_grain(Counter, f"k{i}").get() for i in range(100)))
        assert totals == [6] * 100
    finally:
        for c in clients:
            await c.close()


async def test_grain_calls_grain_on_another_silo(cluster, client: ClusterClient) -> None:
    a, b = await cluster(2)
    # Find a relay key placed on one silo and an echo key placed on the other.
    found = None
    for i in range(40):
        out = await client.get_grain(Relay, f"r{i}").relay(f"e{i}", i)
        if out["here"] != out["there"]:
            found = out
            break
    assert found is not None, "placement never spread two grains over two silos"
    assert found["value"] == found["value"]
    assert {found["here"], found["there"]} == {str(a.address), str(b.address)}


async def test_deadline_passed_raises_grain_timeout(cluster, client: ClusterClient) -> None:
    await cluster(1)
    echo = client.get_grain(Echo, "slow")
    with pytest.raises(errors.GrainTimeoutError) as info:
        await echo.with_timeout(0.2).sleep(5)
    assert "Echo/slow" in str(info.value)
    # The callee was told to cancel: the next call is served at once, not after 5 s.
    assert await echo.with_timeout(2).echo("next") == "next"


async def test_a_failed_call_in_a_task_asked_to_cancel_raises_cancelled_not_the_error(cluster, client: ClusterClient) -> None:
    """A cancellation swallowed under a call (redis-py can, on 3.11) must not surface as an
    ordinary error a caller's loop absorbs: the task was asked to end (seen: Ctrl-C to the demo
    during a status poll left it polling forever)."""
    await cluster(1)
    echo = client.get_grain(Echo, "c")

    async def swallowed_then_call() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass  # what a command underneath did; the request still counts (task.cancelling())
        await echo.fail("boom")

    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(swallowed_then_call())
    with pytest.raises(errors.RemoteGrainError, match="boom"):  # no cancel asked: the error as it is
        await echo.fail("boom")


async def test_grain_exception_arrives_as_remote_error_with_traceback(cluster, client: ClusterClient) -> None:
    await cluster(1)
    with pytest.raises(errors.RemoteGrainError) as info:
        await client.get_grain(Echo, "e").fail("boom")
    err = info.value
    assert err.type_name == "ValueError"
    assert err.message == "boom"
    assert "sample_grains.py" in err.traceback_text and "raise ValueError" in err.traceback_text
    # The activation survives an ordinary exception.
    assert await client.get_grain(Echo, "e").echo(1) == 1


async def test_64mb_tensor_round_trips_bit_exact(cluster, client: ClusterClient) -> None:
    await cluster(1)
    t = torch.randn(16 * 1024 * 1024, dtype=torch.float32)
    back = await client.get_grain(Echo, "t").echo(t)
    assert back.dtype == torch.float32 and back.shape == t.shape
    assert torch.equal(back.view(torch.int32), t.view(torch.int32))


async def test_non_reentrant_call_cycle_fails_with_deadlock_error(cluster, client: ClusterClient) -> None:
    await cluster(2)
    with pytest.raises(errors.DeadlockError) as info:
        await client.get_grain(PingPong, "a").ping("b", 3)
    assert "PingPong/a -> PingPong/b -> PingPong/a" in str(info.value)
    assert await client.get_grain(ReentrantPingPong, "a").ping("b", 3) == 3


async def test_exception_type_marked_deactivates_the_activation(cluster, client: ClusterClient) -> None:
    await cluster(1)
    frag = client.get_grain(Fragile, "f")
    first = await frag.ident()
    assert await frag.ident() == first
    with pytest.raises(errors.RemoteGrainError) as info:
        await frag.oom()
    assert info.value.type_name == "MemoryError"
    assert await frag.ident() != first


async def test_stateless_worker_spreads_concurrent_calls_over_a_local_pool(
    cluster, client: ClusterClient
) -> None:
    (silo,) = await cluster(1)
    ids = await asyncio.gather(*(client.get_grain(Worker, 0).work(0.1) for _ in range(8)))
    assert 1 < len(set(ids)) <= 4
    assert silo.directory.statistics().registrations == 0


async def test_timer_ticks_as_turns_of_the_activation(cluster, client: ClusterClient) -> None:
    await cluster(1)
    ticker = client.get_grain(Ticker, "t")
    await ticker.start(0.02)
    assert await ticker.wait_ticks() >= 3


async def test_unknown_method_is_an_attribute_error_at_the_call_site(cluster, client: ClusterClient) -> None:
    await cluster(1)
    echo = client.get_grain(Echo, "e")
    with pytest.raises(AttributeError):
        echo.no_such_method  # noqa: B018
    # A by-name reference cannot know every method before it calls (a version published
    # later may add one): a name it lacks fails when called, naming the type and the method.
    by_name = client.get_grain("Echo", "e")
    assert await by_name.echo(3) == 3
    with pytest.raises(errors.UnknownMethodError, match="'Echo'.*'nope'"):
        await by_name.nope()
    with pytest.raises(AttributeError):
        by_name._nope  # noqa: B018


async def test_unknown_grain_type_is_a_clear_error(cluster, client: ClusterClient) -> None:
    await cluster(1)
    ref = client.get_grain("NoSuchGrain", "x")  # a reference is valid forever: the call says
    with pytest.raises(errors.UnknownGrainError, match="'NoSuchGrain'"):
        await ref.anything()


async def test_grain_type_decorator_renames_the_wire_type(cluster, client: ClusterClient) -> None:
    await cluster(1)
    assert await client.get_grain(NamedGrain, "n").name() == "Renamed"
    assert await client.get_grain("Renamed", "n").name() == "Renamed"


async def test_counter_state_survives_deactivation(cluster, client: ClusterClient) -> None:
    (silo,) = await cluster(1)
    c = client.get_grain(Counter, "c")
    assert await c.add(2) == 2
    assert await c.add(3) == 5
    act = silo.catalog.get(c.grain_id)
    assert act is not None
    await silo.catalog.deactivate(act, __import__("grains").DeactivationReason.REQUESTED)
    assert await c.get() == 5
