"""Delivery at the edges, on the twins: calls to a grain still activating, a full mailbox, and
deadlines, from the grain's own silo and from another one (real routers, dispatchers and
connections over the transport twin, virtual time: nothing sleeps).

``SlowStart`` lives only on the silo with the role ``home`` and takes four seconds of the
clock to activate, so every call below reaches it while it activates.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from silo import errors
from silo.settings import CatalogSettings
from silo.testing.clock import VirtualClock
from silo.testing.harness import InProcessCluster, InProcessSilo
from tests.silo.messaging.grains import SlowStart

DISTANCES = pytest.mark.parametrize("distance", ["same silo", "other silo"])


@pytest.fixture
async def clock() -> AsyncIterator[VirtualClock]:
    with VirtualClock() as c:
        yield c


@asynccontextmanager
async def callers(
    clock: VirtualClock, distance: str, settings: CatalogSettings | None = None
) -> AsyncIterator[tuple[InProcessCluster, InProcessSilo, InProcessSilo]]:
    """The cluster, the ``home`` silo (where SlowStart lives) and the caller's silo."""
    async with InProcessCluster([SlowStart], silos=0, clock=clock, settings=settings, call_timeout_s=30.0) as cluster:
        home = await cluster.add_silo(roles=["home"])
        away = await cluster.add_silo()
        yield cluster, home, home if distance == "same silo" else away


@DISTANCES
async def test_calls_to_a_grain_still_activating_run_in_the_order_they_were_sent(
    distance: str, clock: VirtualClock
) -> None:
    async with callers(clock, distance) as (cluster, home, caller):
        ref = caller.get_grain(SlowStart, "s")
        answers = []
        # Steady sends, one every 50 ms for 5 s: the first starts the activation, the next
        # seventy-nine come while on_activate runs, the rest after it.
        for n in range(100):
            if n % 4 == 3:
                answers.append(asyncio.ensure_future(ref.add(n)))  # two-way, answered below
            else:
                await ref.put(n)  # one-way: returns once sent
            await clock.advance(0.05)
        assert [await a for a in answers] == list(range(3, 100, 4))
        assert await ref.log() == list(range(100))
        assert cluster.silo_of(ref) is home


@DISTANCES
async def test_one_way_and_two_way_calls_from_one_sender_run_in_send_order(distance: str, clock: VirtualClock) -> None:
    async with callers(clock, distance) as (_, _home, caller):
        ref = caller.get_grain(SlowStart, "one-sender")

        async def send() -> None:
            # One task, each call sent when the one before returned: a one-way call returns once
            # queued (or sent), so the two-way call after it must not overtake it.
            for n in range(20):
                if n % 2:
                    assert await ref.add(n) == n
                else:
                    await ref.put(n)

        sender = asyncio.ensure_future(send())
        await clock.advance(SlowStart.ACTIVATE_S + 1.0)
        await sender
        assert await ref.log() == list(range(20))


@DISTANCES
async def test_a_call_times_out_at_its_deadline_while_its_callee_activates(distance: str, clock: VirtualClock) -> None:
    async with callers(clock, distance) as (_, home, caller):
        ref = caller.get_grain(SlowStart, "t")
        call = asyncio.ensure_future(ref.with_timeout(1.0).add(1))
        await clock.advance(0.9)
        assert not call.done()
        await clock.advance(0.1)  # the deadline: not the end of on_activate, three seconds on
        assert call.done()
        with pytest.raises(errors.GrainTimeoutError):
            await call
        await clock.advance(SlowStart.ACTIVATE_S)
        assert await ref.log() == []  # withdrawn from the mailbox at its deadline: it never ran
        assert home.catalog.statistics().queued_calls == 0


@DISTANCES
async def test_one_way_calls_past_a_full_mailbox_all_run_in_order_and_a_shed_two_way_call_is_sent_again(
    distance: str, clock: VirtualClock
) -> None:
    async with callers(clock, distance, CatalogSettings(max_queue=5)) as (_, home, caller):
        ref = caller.get_grain(SlowStart, "f")
        for n in range(10):
            await ref.put(n)  # all while it activates: five fill the mailbox, five wait behind it
        await clock.settle()
        # A two-way call finds the mailbox full: shed unrun, its caller's router sends it again
        # (backing off) until there is room, within its deadline.
        answer = asyncio.ensure_future(ref.add(99))
        await clock.advance(SlowStart.ACTIVATE_S + 1.0)
        assert await answer == 99
        assert await ref.log() == [*range(10), 99]
        assert home.dispatcher.statistics().one_way_failed == 0
        assert caller.router.statistics().retries >= 1  # type: ignore[union-attr]


@DISTANCES
async def test_one_way_calls_past_twice_the_mailbox_limit_are_shed_logged_and_counted(
    distance: str, clock: VirtualClock, caplog: pytest.LogCaptureFixture
) -> None:
    # The bound on memory: max_queue in the mailbox and as many waiting behind it.
    async with callers(clock, distance, CatalogSettings(max_queue=5)) as (_, home, caller):
        ref = caller.get_grain(SlowStart, "over")
        for n in range(13):
            await ref.put(n)
        await clock.advance(SlowStart.ACTIVATE_S + 1.0)
        assert await ref.log() == list(range(10))
        assert home.dispatcher.statistics().one_way_failed == 3
        assert caplog.text.count("LoadShedError: mailbox of SlowStart/over") == 3


@DISTANCES
async def test_one_way_calls_waiting_past_a_full_mailbox_fail_at_their_deadline_counted(
    distance: str, clock: VirtualClock
) -> None:
    async with callers(clock, distance, CatalogSettings(max_queue=5)) as (_, home, caller):
        ref = caller.get_grain(SlowStart, "d")
        for n in range(10):
            await ref.with_timeout(2.0).put(n)  # their deadline comes before on_activate ends
        await clock.advance(SlowStart.ACTIVATE_S + 1.0)
        assert await ref.log() == []
        assert home.dispatcher.statistics().one_way_failed == 10  # each logged on the callee's silo


@DISTANCES
async def test_an_interleaving_call_to_a_grain_still_activating_waits_for_on_activate(
    distance: str, clock: VirtualClock
) -> None:
    async with callers(clock, distance) as (_, _home, caller):
        ref = caller.get_grain(SlowStart, "i")
        await ref.put(0)  # starts the activation
        await clock.advance(1.0)
        peek = asyncio.ensure_future(ref.is_activated())  # @interleave: may run beside a turn, not before on_activate
        await clock.advance(SlowStart.ACTIVATE_S - 1.5)
        assert not peek.done()
        await clock.advance(1.0)
        assert await peek is True
