"""A silo the membership table no longer names live turns new activations away, retryably."""

from __future__ import annotations

import pytest

from grains.ids import SiloAddress
from silo import errors
from silo.testing.clock import VirtualClock
from silo.testing.directory import InMemoryGrainDirectory
from silo.testing.harness import InProcessSilo
from tests.silo.catalog.conftest import ALL_GRAINS
from tests.silo.catalog.grains import Counter


async def test_a_silo_voted_out_but_not_yet_told_answers_not_serving_and_keeps_no_activation(
    clock: VirtualClock,
) -> None:
    live = {"now": True}

    def is_alive(_: SiloAddress) -> bool:
        return live["now"]

    silo = InProcessSilo(ALL_GRAINS, clock=clock, directory=InMemoryGrainDirectory(is_alive))
    try:
        assert await silo.get_grain(Counter, "before").add(1) == 1
        live["now"] = False  # peers voted it out; its heartbeat has not heard yet
        with pytest.raises(errors.SiloNotServingError) as info:
            await silo.get_grain(Counter, "after").add(1)
        # Never delivered, so a router may send it elsewhere: the refusal names the cause.
        assert "not live" in str(info.value)
        assert silo.activation(silo.get_grain(Counter, "after")) is None
    finally:
        await silo.stop()
