"""Calls through grain references that mypy (with grains.mypy_plugin) must refuse.

Each refused line ends in an ``E:`` comment with the error code in brackets and a part of the
message: tests/grains/test_typed_refs.py checks that mypy reports exactly these lines, each
with that code and a message containing that part.
"""

from __future__ import annotations

from grains import Grain, Ref
from silo.client import ClusterClient
from silo.testing.harness import InProcessSilo
from tests.grains.typing_cases.ref_grains import Counter, Decorated, NotAGrain, Tokens


async def from_a_client(client: ClusterClient) -> None:
    counter = client.get_grain(Counter, "c")
    counter.peek()  # E: [attr-defined] Reference to "Counter" has no attribute "peek" (not an async method
    await counter.nope()  # E: [attr-defined] Reference to "Counter" has no attribute "nope"
    print(counter.label)  # E: [attr-defined] has no attribute "label" (not an async method
    await counter.write_state()  # E: [attr-defined] has no attribute "write_state" (a Grain helper
    print(counter.state)  # E: [attr-defined] has no attribute "state" (a Grain helper
    await counter.on_activate()  # E: [attr-defined] has no attribute "on_activate" (a Grain helper or lifecycle hook
    await counter._recount()  # E: [attr-defined] has no attribute "_recount" (private
    await counter.add("three")  # E: [arg-type] Argument 1 to "add" of "Counter" has incompatible type "str"; expected "int"
    await counter.add()  # E: [call-arg] Missing positional argument "n" in call to "add" of "Counter"
    text: str = await counter.with_timeout(2).add(1)  # E: [assignment] (expression has type "int", variable has type "str")
    await counter.with_timeout("soon").add(1)  # E: [arg-type] Argument 1 to "with_timeout" of "GrainRef" has incompatible type "str"
    total: int = counter.add(1)  # E: [assignment] (expression has type "Coroutine[Any, Any, int]", variable has type "int")
    del text, total


async def streamed(client: ClusterClient) -> None:
    tokens = client.get_grain(Tokens, "t")
    await tokens.generate("a")  # E: [misc] Incompatible types in "await" (actual type "ResultStream[str]"
    tokens.generate(1)  # E: [arg-type] Argument 1 to "generate" of "Tokens" has incompatible type "int"; expected "str"


async def decorated(client: ClusterClient) -> None:
    ref = client.get_grain(Decorated, "d")
    await ref.hidden(1)  # E: [attr-defined] has no attribute "hidden" (not an async method: decorator "logged" makes it a plain function
    await ref.rewrapped(1)  # E: [attr-defined] has no attribute "rewrapped" (not an async method: decorator "logged" makes it a plain function
    await ref.words("a")  # E: [misc] Incompatible types in "await" (actual type "ResultStream[str]"


async def from_the_harness(harness: InProcessSilo) -> None:
    harness.get_grain(Counter, "c").peek()  # E: [attr-defined] Reference to "Counter" has no attribute "peek"


class Caller(Grain):
    async def go(self) -> None:
        await self.get_grain(Counter, self.key).write_state()  # E: [attr-defined] has no attribute "write_state"


async def refs_are_not_interchangeable(client: ClusterClient) -> None:
    typed: Ref[Counter] = client.get_grain("Counter", "c")  # E: [assignment] expression has type "GrainRef", variable has type "Ref[Counter]"
    client.get_grain(NotAGrain, "n")  # E: [type-var] Value of type variable "G" of "get_grain" of "ClusterClient" cannot be "NotAGrain"
    del typed
