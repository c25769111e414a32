"""RequestContext entries travel with every call at every distance (docs/concepts.md, "Request
context"): client to grain, grain to grain on the same silo and on another, one-way calls, a
task a turn starts, and in the in-process harness; a callee's change stays its own, a turn never
sees entries its call did not carry, and a peer's malformed context refuses the call."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from grains import RequestContext
from grains.call import Call
from grains.ids import GrainId
from grains.request_context import MAX_ENTRIES
from silo import errors
from silo.testing import InProcessCluster, InProcessSilo
from silo.tracing import CONTEXT_KEY
from tests.context_grains import ContextReader, ContextSubscriber

GRAINS = ("tests.context_grains",)
SENT = {"tenant": "acme", "request": 7, "debug": True}


@pytest.fixture(autouse=True)
def _clean() -> Any:
    RequestContext.clear()
    yield
    RequestContext.clear()


async def _everything_carries_it(get: Any, place: Any) -> None:
    """``get(cls, key)`` makes a reference where the test runs; ``place(ref, where)`` puts a grain
    on silo ``where`` (0 or 1; a harness of one silo has only 0)."""
    a, same, other = get(ContextReader, "a"), get(ContextReader, "same"), get(ContextReader, "other")
    await place(a, 0)
    await place(same, 0)
    await place(other, 1)
    assert await a.read() == {}  # nothing set: nothing sent
    for k, v in SENT.items():
        RequestContext.set(k, v)
    assert await a.read() == SENT
    assert await a.relay("same") == SENT  # on through a grain, to one on its silo
    assert await a.relay("other") == SENT  # and to one on another silo
    assert await a.from_task("other") == SENT  # a task a turn starts inherits the turn's
    await a.relay_one_way("other", "one-way")
    await a.relay_one_way("same", "one-way")
    for ref in (other, same):
        while not await ref.noted():
            await asyncio.sleep(0.01)
        assert await ref.noted() == [("one-way", SENT)]
    # The callee's change is its own: not the caller's, not the next call's.
    assert await a.change_and_read() == {**SENT, "callee": "changed"}
    assert RequestContext.items() == SENT and await a.read() == SENT
    RequestContext.clear()
    assert await a.read() == {} and await a.relay("other") == {}  # no leftovers in a mailbox task


async def test_request_context_travels_at_every_distance_from_a_client(cluster, client) -> None:
    silos = await cluster(2, grains=GRAINS)

    async def place(ref: Any, where: int) -> None:
        await client.router.activate(ref.grain_id, silos[where].address)

    await _everything_carries_it(client.get_grain, place)


async def test_the_in_process_harness_carries_request_context_the_same_way() -> None:
    async with InProcessCluster([ContextReader], silos=2) as two:
        first = two.silos[0]

        async def place(ref: Any, where: int) -> None:
            await first.router.activate(ref.grain_id, two.silos[where].address)  # type: ignore[union-attr]

        await _everything_carries_it(first.get_grain, place)
    async with InProcessSilo([ContextReader]) as one:
        RequestContext.set("tenant", "acme")
        assert await one.get_grain(ContextReader, "a").relay("b") == {"tenant": "acme"}


def test_entries_are_bounded_scalars_refused_where_they_are_set() -> None:
    with pytest.raises(ValueError, match="strings, numbers, booleans or None"):
        RequestContext.set("payload", {"nested": 1})  # type: ignore[arg-type]
    for i in range(MAX_ENTRIES):
        RequestContext.set(f"k{i}", i)
    with pytest.raises(ValueError, match=f"at most {MAX_ENTRIES} entries"):
        RequestContext.set("one-more", 1)
    assert len(RequestContext.items()) == MAX_ENTRIES  # the refused set changed nothing
    RequestContext.clear()
    with pytest.raises(ValueError, match="bytes as JSON"):
        RequestContext.set("big", "x" * 5000)
    RequestContext.set("gone", 1)
    RequestContext.remove("gone")
    assert RequestContext.get("gone", "default") == "default"


TOO_MANY = "{" + ",".join(f'"k{i}": 1' for i in range(MAX_ENTRIES + 1)) + "}"


@pytest.mark.parametrize("sent", ["[1, 2]", "not json", '{"k": {"deep": 1}}', TOO_MANY, '{"big": "' + "x" * 5000 + '"}'])
async def test_a_peers_malformed_request_context_refuses_the_call_with_a_codec_error(sent: str) -> None:
    async with InProcessSilo([ContextReader]) as silo:
        assert silo.dispatcher is not None
        call = Call(GrainId("ContextReader", "a"), "read", (), None, 5.0, (), 0)
        deadline = asyncio.get_running_loop().time() + 5.0
        with pytest.raises(errors.CodecError, match="request context"):
            await silo.dispatcher.dispatch(call, deadline, None, {CONTEXT_KEY: sent})
        assert await silo.dispatcher.dispatch(call, deadline, None, {CONTEXT_KEY: '{"ok": 1}'}) == {"ok": 1}


async def test_a_stream_item_carries_its_publishers_request_context_to_the_subscriber(cluster, client) -> None:
    await cluster(1, grains=GRAINS)
    stream = client.stream("context", "k")
    RequestContext.set("tenant", "acme")
    await stream.publish(1)
    RequestContext.clear()
    await stream.publish(2)  # published with none: delivered with none
    sub = client.get_grain(ContextSubscriber, "k")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while len(await sub.items_seen()) < 2:
        assert loop.time() < deadline
        await asyncio.sleep(0.05)
    assert await sub.items_seen() == [(1, {"tenant": "acme"}), (2, {})]
