"""Calls through grain references that mypy (with grains.mypy_plugin) must accept."""

from __future__ import annotations

from typing import Any, TypeVar, assert_type

from grains import Grain, GrainId, GrainRef, Ref
from grains.result_stream import ResultStream
from silo.client import ClusterClient
from silo.silo import Silo
from silo.testing.harness import InProcessSilo
from tests.grains.typing_cases.ref_grains import Box, Counter, Decorated, LoudCounter, Tokens

C = TypeVar("C", bound=Counter)


async def from_a_client(client: ClusterClient) -> None:
    counter = client.get_grain(Counter, "c")
    assert_type(counter, Ref[Counter])
    assert_type(await counter.add(1), int)
    assert_type(await counter.with_timeout(2).add(3, note="x"), int)
    assert_type(counter.with_timeout(0.5), Ref[Counter])
    assert_type(await counter.touch("me"), None)
    assert_type(await counter.total(), int)
    assert_type(counter.grain_id, GrainId)
    assert_type(counter.key, str)


async def streamed(client: ClusterClient, harness: InProcessSilo) -> None:
    tokens = client.get_grain(Tokens, "t")
    assert_type(tokens.generate("a b"), ResultStream[str])
    async for word in tokens.with_timeout(2).generate("a b", limit=1):
        assert_type(word, str)
    await harness.get_grain(Tokens, "t").generate("a").aclose()


async def decorated(client: ClusterClient) -> None:
    ref = client.get_grain(Decorated, "d")
    assert_type(await ref.timed_add(1), int)  # an async def wrapper
    assert_type(await ref.tagged_touch("me"), None)  # a factory handing back the @one_way method
    assert_type(ref.words("a b"), ResultStream[str])  # an async generator wrapper
    async for word in ref.with_timeout(2).words("a b"):
        assert_type(word, str)


async def from_a_silo_and_the_harness(silo: Silo, harness: InProcessSilo) -> None:
    assert_type(await silo.get_grain(Counter, "c").add(1), int)
    assert_type(await harness.get_grain(Counter, "c").with_timeout(2).add(1), int)
    assert_type(harness.instance(harness.get_grain(Counter, "c")), Counter)


class Caller(Grain):
    async def go(self) -> int:
        return await self.get_grain(Counter, self.key).add(1)


async def add_one(ref: Ref[C]) -> int:
    """Generic code sees what the bound declares."""
    return await ref.add(1)


async def subclasses_and_generics(client: ClusterClient) -> None:
    loud = client.get_grain(LoudCounter, "l")
    assert_type(await loud.shout(), str)
    assert_type(await loud.add(2), int)  # inherited
    base: Ref[Counter] = loud  # a subclass's reference is its base's
    await add_one(base)
    await add_one(loud)
    box = client.get_grain(Box[int], "b")
    assert_type(await box.get(3), int)


async def by_name(client: ClusterClient) -> None:
    ref = client.get_grain("Counter", "c")  # the type is known only at run time
    assert_type(ref, GrainRef)
    anything: Any = await ref.with_timeout(2).add(1)
    del anything
