"""Grain state on the in-memory store: written, read back by a new activation, and a write
refused by the etag or fencing check deactivates the activation that made it."""

from __future__ import annotations

import pytest

from grains.ids import SiloAddress
from silo import errors
from silo.testing.clock import VirtualClock
from silo.testing.harness import InProcessSilo
from tests.silo.catalog.grains import Counter


async def test_state_is_written_and_a_new_activation_reads_it(silo: InProcessSilo) -> None:
    counter = silo.get_grain(Counter, "c")
    assert await counter.add(2) == 2
    assert await counter.add(3) == 5
    etag = silo.store.etag_of(counter.grain_id)
    assert etag is not None
    await silo.deactivate(counter)
    assert silo.activation(counter) is None
    assert await counter.get() == 5
    assert silo.store.etag_of(counter.grain_id) == etag  # reading wrote nothing
    assert silo.store.statistics().writes == 2


async def test_write_over_a_changed_etag_raises_state_conflict_and_deactivates(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    counter = silo.get_grain(Counter, "e")
    assert await counter.add(1) == 1
    first = silo.activation(counter)
    assert first is not None
    # Someone else writes the state behind the activation's back (unfenced, any etag).
    await silo.store.write(counter.grain_id, silo.codec.encode({"value": 100}), "*", 0)
    with pytest.raises(errors.StateConflictError) as info:
        await counter.add(1)
    assert "etag" in str(info.value)
    await first.deactivated.wait()
    assert silo.activation(counter) is None
    # The next call activates anew and starts from what is stored.
    assert await counter.add(1) == 101
    assert silo.store.statistics().conflicts == 1


async def test_write_by_an_activation_that_lost_its_directory_entry_is_fenced(
    silo: InProcessSilo, clock: VirtualClock
) -> None:
    counter = silo.get_grain(Counter, "z")
    assert await counter.add(1) == 1
    zombie = silo.activation(counter)
    assert zombie is not None
    # Another silo took the grain over (this one was presumed dead): its entry has a newer token.
    other = SiloAddress("127.0.0.1", 22222, 1)
    assert await silo.directory.unregister(counter.grain_id, silo.address, zombie.activation_id)
    entry = await silo.directory.register(counter.grain_id, other, "elsewhere")
    assert entry.token > zombie.token
    with pytest.raises(errors.StateConflictError) as info:
        await counter.add(1)
    assert "fencing" in str(info.value)
    await zombie.deactivated.wait()
    stored = await silo.store.read(counter.grain_id)
    assert stored is not None and silo.codec.decode(stored.meta, stored.buffers) == {"value": 1}
