"""A reference turns each method call into one Call value: the fields the wire carries."""

from __future__ import annotations

from typing import Any

from grains import Grain, GrainId
from grains.call import CALL_CHAIN, UNREAD, Call, started
from grains.ref import ref_class_for


class Adder(Grain):
    async def add(self, a: int, b: int = 0) -> int:
        return a + b


class Recorder:
    """A Caller that keeps the calls it is handed and answers with them (their chain read as a
    caller reads it, when the call starts)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    async def invoke(self, call: Call) -> Any:
        self.calls.append(call)
        return started(call)


async def test_a_reference_call_becomes_one_call_with_the_callers_fields() -> None:
    caller = Recorder()
    ref = ref_class_for(Adder)(caller, GrainId("Adder", "k"))
    got = await ref.add(1, 2)
    assert got == Call(GrainId("Adder", "k"), "add", (1, 2), None, None, (), 0)
    assert got.kwargs is None and got.timeout_s is None and got.hops == 0


async def test_keywords_timeout_and_the_call_chain_travel_in_the_call() -> None:
    caller = Recorder()
    ref = ref_class_for(Adder)(caller, GrainId("Adder", "k")).with_timeout(2.5)
    token = CALL_CHAIN.set(("Outer/1", "Middle/2"))
    try:
        call = await ref.add(1, b=5)
    finally:
        CALL_CHAIN.reset(token)
    assert call.kwargs == {"b": 5}
    assert call.timeout_s == 2.5
    assert call.chain == ("Outer/1", "Middle/2")
    # Outside any turn the chain is empty again.
    assert (await ref.add(1)).chain == ()


async def test_the_chain_is_the_one_of_the_task_a_call_starts_in_not_where_it_was_made() -> None:
    # self.start_task(ref.m()) makes the call inside a turn and runs it in a task outside it.
    caller = Recorder()
    ref = ref_class_for(Adder)(caller, GrainId("Adder", "k"))
    token = CALL_CHAIN.set(("Outer/1",))
    try:
        made_inside = ref.add(1)
    finally:
        CALL_CHAIN.reset(token)
    assert (await made_inside).chain == ()
    assert caller.calls[0].chain is UNREAD  # the reference left it to the caller


def test_a_forwarded_call_is_one_hop_further_with_the_time_it_has_left() -> None:
    call = Call(GrainId("Adder", "k"), "add", (1,), {"b": 2}, None, ("Outer/1",), 0)
    once = call.forwarded(1.5)
    assert once == Call(GrainId("Adder", "k"), "add", (1,), {"b": 2}, 1.5, ("Outer/1",), 1)
    assert once.forwarded(0.5).hops == 2
    assert call.hops == 0  # a value: forwarding makes a new one
