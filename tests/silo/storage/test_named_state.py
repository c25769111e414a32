"""Named states (``Grain.named_state``): several persisted states per grain, each with its own
key, loaded with ``self.state`` before ``on_activate``, fenced like it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from grains.base import DeactivationReason
from grains.call import Call
from grains.ids import GrainId
from silo import errors
from silo.silo import Silo
from silo.testing import InProcessSilo
from tests.extension_grains import Account

GRAINS = {"grains": ("tests.extension_grains",)}


async def _stored(silo: Silo, grain: GrainId, state: str = "") -> dict[str, Any] | None:
    stored = await silo.store.read(grain, state=state)
    return None if stored is None else silo.codec.decode(stored.meta, stored.buffers)


async def _reactivate(silo: Silo, grain: GrainId) -> None:
    act = silo.catalog.get(grain)
    assert act is not None
    await silo.catalog.deactivate(act, DeactivationReason.REQUESTED)


async def test_named_states_are_stored_apart_and_load_again_with_the_default_state(cluster, client) -> None:
    (silo,) = await cluster(1, **GRAINS)
    acct = client.get_grain(Account, "a")
    assert await acct.deposit(10) == 10
    assert await acct.rename("ada") == 1
    await acct.set_theme("dark")
    gid = GrainId("Account", "a")
    # One key per (grain, state name), built in silo/keys.py; the default state keeps its own.
    assert await _stored(silo, gid) == {"balance": 10}
    assert await _stored(silo, gid, "profile") == {"name": "ada", "visits": 1}
    assert await _stored(silo, gid, "prefs") == {"theme": "dark"}
    assert await silo.redis.exists(silo.keys.named_state_head(str(gid), "profile")) == 1
    await _reactivate(silo, gid)
    assert silo.catalog.get(gid) is None
    # A new activation: every state declared in __init__ is loaded before the first call.
    assert await acct.view() == {"balance": 10, "name": "ada", "visits": 1, "theme": "dark"}
    assert await acct.rename("ada l.") == 2


async def test_clearing_one_named_state_leaves_the_others(cluster, client) -> None:
    (silo,) = await cluster(1, **GRAINS)
    acct = client.get_grain(Account, "c")
    await acct.deposit(3)
    await acct.rename("bob")
    await acct.set_theme("blue")
    await acct.forget_profile()
    gid = GrainId("Account", "c")
    assert await _stored(silo, gid, "profile") is None
    assert await acct.view() == {"balance": 3, "name": "", "visits": 0, "theme": "blue"}
    await _reactivate(silo, gid)
    assert await acct.view() == {"balance": 3, "name": "", "visits": 0, "theme": "blue"}


async def test_a_named_state_write_from_a_zombie_is_refused_and_deactivates_it(cluster) -> None:
    (silo,) = await cluster(1, **GRAINS)
    gid = GrainId("Account", "z")
    assert await silo.get_grain(Account, "z").rename("first") == 1
    act = silo.catalog.get(gid)
    assert act is not None
    # Another activation takes the grain over (a fresh fencing token in its directory entry).
    token = await silo.redis.incr(silo.keys.fencing_counter())
    await silo.redis.hset(
        silo.keys.directory_entry(str(gid)), mapping={"silo": str(silo.address), "act": "usurper", "token": token}
    )
    with pytest.raises(errors.StateConflictError, match="fencing token") as info:
        await silo.dispatcher.dispatch(Call(gid, "rename", ("zombie",)), asyncio.get_running_loop().time() + 5)
    assert "profile" in str(info.value)
    await asyncio.wait_for(act.deactivated.wait(), 5)
    assert await _stored(silo, gid, "profile") == {"name": "first", "visits": 1}


async def test_a_named_state_asked_for_after_activation_must_be_read_first() -> None:
    async with InProcessSilo([Account]) as silo:
        acct = silo.get_grain(Account, "late")
        seen = await acct.late_state()
        assert seen[0].startswith("StorageError") and "not loaded" in seen[0] and "__init__" in seen[0]
        assert seen[1] == "light"
        assert silo.store.etag_of(GrainId("Account", "late"), "late") is not None
        # The same name for another model is a mistake, said plainly.
        with pytest.raises(errors.ConfigError, match="'profile' was asked for as ProfileState, now as Prefs"):
            await acct.same_name_other_model()


def test_a_state_name_outside_the_allowed_characters_is_refused() -> None:
    with pytest.raises(ValueError, match="state name"):
        Account.named_state(Account.__new__(Account), "bad name", Account.State)
