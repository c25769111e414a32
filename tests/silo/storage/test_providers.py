"""Storage providers chosen by name: settings define them, ``@storage`` and named states pick
them, each silo builds its own; the SQLite provider across silo processes."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from grains.base import DeactivationReason
from grains.ids import GrainId
from silo import errors
from silo.settings import SiloSettings, StorageSettings
from silo.testing.store import InMemoryStateStore
from tests.extension_grains import Account
from tests.silo.storage.provider_grains import Archive

MEM = StorageSettings(providers={"mem": "silo.testing.store:memory_provider"})  # type: ignore[dict-item]


async def test_a_grain_class_and_a_named_state_each_use_the_provider_they_name(cluster, client) -> None:
    (silo,) = await cluster(1, grains=("tests.silo.storage.provider_grains",), storage=MEM)
    archive = client.get_grain(Archive, "x")
    assert await archive.add("a") == 1
    assert await archive.add("b") == 2
    gid = GrainId("Archive", "x")
    mem = silo.storage.get("mem")
    assert isinstance(mem, InMemoryStateStore)
    # self.state and the "notes" state went to "mem"; "meta" names "redis".
    assert mem.etag_of(gid) is not None and mem.etag_of(gid, "notes") is not None
    assert mem.etag_of(gid, "meta") is None
    assert await silo.redis.exists(silo.keys.state_head(str(gid))) == 0
    assert await silo.redis.exists(silo.keys.named_state_head(str(gid), "meta")) == 1
    # Reactivated: each state loads from its own provider.
    act = silo.catalog.get(gid)
    assert act is not None
    await silo.catalog.deactivate(act, DeactivationReason.REQUESTED)
    assert await archive.items() == ["a", "b"]
    assert await archive.add("c") == 3


async def test_a_silo_whose_grain_names_an_undefined_provider_does_not_start(cluster) -> None:
    with pytest.raises(errors.ConfigError, match=r"Archive uses @storage\('mem'\).*it has redis"):
        await cluster(1, grains=("tests.silo.storage.provider_grains",))


async def test_a_provider_factory_that_cannot_be_imported_fails_the_start_naming_it(cluster) -> None:
    bad = StorageSettings(providers={"mem": "no_such_module:factory"})  # type: ignore[dict-item]
    with pytest.raises(errors.ConfigError, match="storage provider 'mem' 'no_such_module:factory': cannot import"):
        await cluster(1, grains=("tests.silo.storage.provider_grains",), storage=bad)


def test_provider_settings_are_checked_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="reserved"):
        StorageSettings(providers={"redis": "pkg.mod:f"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="default_provider 'files'"):
        StorageSettings(default_provider="files")
    with pytest.raises(ValueError, match="factory"):
        StorageSettings(providers={"files": "not a path"})  # type: ignore[dict-item]
    spec = {"files": {"factory": "silo.storage.sqlite:provider", "options": {"path": "/tmp/x.db"}}}
    monkeypatch.setenv("REDGRAIN_STORAGE__PROVIDERS", json.dumps(spec))
    monkeypatch.setenv("REDGRAIN_STORAGE__DEFAULT_PROVIDER", "files")
    storage = SiloSettings().storage
    assert storage.default_provider == "files"
    assert storage.providers["files"].factory == "silo.storage.sqlite:provider"
    assert storage.providers["files"].options == {"path": "/tmp/x.db"}


async def test_sqlite_as_the_default_provider_keeps_state_across_silo_processes(
    silo_processes, client, tmp_path: Path
) -> None:
    db = tmp_path / "states.db"
    spec = {"files": {"factory": "silo.storage.sqlite:provider", "options": {"path": str(db)}}}
    env = {"REDGRAIN_STORAGE__PROVIDERS": json.dumps(spec), "REDGRAIN_STORAGE__DEFAULT_PROVIDER": "files"}
    (first,) = silo_processes(1, grains="tests.extension_grains", env=env)
    acct = client.get_grain(Account, "s")
    assert await acct.deposit(7) == 7
    assert await acct.rename("sql") == 1
    silo_processes(1, grains="tests.extension_grains", env=env)
    first.kill()
    async with asyncio.timeout(10):
        while not client.view.is_dead(first.address):
            await asyncio.sleep(0.05)  # another process: its death is learnt, not awaited
    # Re-activated on the other silo from the file the killed one wrote (no state in Redis).
    assert await acct.with_timeout(10).view() == {"balance": 7, "name": "sql", "visits": 1, "theme": "light"}
    rows = sqlite3.connect(db).execute("SELECT grain, state FROM grain_state WHERE grain LIKE 'Account/%' ORDER BY state").fetchall()
    assert rows == [("Account/s", ""), ("Account/s", "profile")]
    keys = [k async for k in client.redis.scan_iter(match=f"rg:{{{client.settings.cluster}}}:*state*")]
    assert keys == []
