"""``@one_way``: the caller's await returns once the call is sent; the method's effect lands,
its errors are logged and counted on the callee's silo, never raised to the caller."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from silo.testing import InProcessSilo
from tests.sample_grains import Inbox, InboxSender


async def _eventually(check: Any, timeout_s: float = 5.0) -> None:
    """Until ``check()`` holds: a one-way failure is counted after the caller moved on."""
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.01)


async def _returns_while_the_method_runs(inbox: Any) -> None:
    # The method waits for a release nobody has sent yet: a plain call would hang here.
    assert await inbox.with_timeout(2).put_when_released("x") is None
    await inbox.release()  # @interleave: runs beside the one-way turn it releases
    assert await inbox.contents() == ["x"]  # queued behind that turn: its effect has landed


async def test_a_one_way_call_from_a_client_returns_while_its_method_still_runs(cluster, client) -> None:
    (silo,) = await cluster(1)
    inbox = client.get_grain(Inbox, "c")
    await _returns_while_the_method_runs(inbox)
    assert await inbox.explode("boom") is None  # raised on the silo, not here
    await _eventually(lambda: silo.dispatcher.statistics().one_way_failed == 1)
    assert silo.dispatcher.statistics().one_way == 2  # put_when_released, explode
    # Known only by name (a ref built from the published manifest), it is one-way too.
    by_name = client.get_grain("Inbox", "c")
    assert await by_name.put("y") is None and await inbox.contents() == ["x", "y"]


async def test_one_way_calls_on_the_same_silo_keep_their_order_and_copy_their_arguments(cluster, client) -> None:
    (silo,) = await cluster(1)
    await client.get_grain(InboxSender, "s").send_all("local", ["a", "b", "c"])
    # Sent one after another to one activation: run in that order, each with its own copy.
    # The client is another caller: its call may overtake posted calls still being delivered
    # (the first one activates the grain), so it asks until all three have landed.
    inbox = client.get_grain(Inbox, "local")
    seen: list[str] = []

    async def landed() -> None:
        while len(seen) < 3:
            seen[:] = await inbox.contents()

    await asyncio.wait_for(landed(), 5.0)
    assert seen == ["a", "b", "c"]
    assert silo.router.statistics().local_calls >= 3


async def test_the_in_process_harness_sends_one_way_too(caplog: pytest.LogCaptureFixture) -> None:
    async with InProcessSilo([Inbox, InboxSender]) as silo:
        inbox = silo.get_grain(Inbox, "h")
        await _returns_while_the_method_runs(inbox)
        assert await inbox.explode("bad input") is None
        await _eventually(lambda: silo.dispatcher.statistics().one_way_failed == 1)
        assert "bad input" in caplog.text and "Inbox/h.explode" in caplog.text
