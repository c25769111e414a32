"""State written by one version of a grain loads in the next (silo/catalog/evolution.py): added
fields default, removed ones are ignored and logged, renames keep their values through an alias,
renamed nested classes load, and a value that no longer fits fails naming its field. At every
nesting level. Each test writes with one class, then loads with the next, on one store."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest
from pydantic import AliasChoices, BaseModel, Field

from grains import Grain, grain_type, version
from silo import errors
from silo.testing.directory import InMemoryGrainDirectory
from silo.testing.harness import InProcessSilo
from silo.testing.store import InMemoryStateStore


class AddressV1(BaseModel):
    street: str = ""
    zip: str = ""
    fax: str = ""  # removed in v2


class AddressV2(BaseModel):
    street: str = ""
    postcode: str = Field("", validation_alias="zip")  # renamed from zip (its own name loads too)
    country: str = "NL"  # added


# Written and read under the same wire name: only the fields changed, not the class's name.
AddressV1.__qualname__ = AddressV2.__qualname__ = "Address"


class Geo(BaseModel):
    lat: float = 0.0
    lon: float = 0.0
    source: str = "gps"  # removed in v2 (Location): one log line for every item of the list


class Location(BaseModel):  # Geo renamed: stored values say "Geo", the annotation says Location
    lat: float = 0.0
    lon: float = 0.0


class Tag(BaseModel):
    name: str = ""


@grain_type("Profile")
class ProfileV1(Grain):
    class State(BaseModel):
        name: str = ""
        visits: int = 0
        nickname: str = ""  # removed in v2
        address: AddressV1 = AddressV1()
        places: list[Geo] = []
        anything: Any = None

    async def put(self) -> None:
        self.state = self.State(
            name="ada", visits=3, nickname="countess",
            address=AddressV1(street="Main 1", zip="1234 AB", fax="555"),
            places=[Geo(lat=52.1, lon=4.3), Geo(lat=51.9, lon=4.5)],
            anything=Tag(name="vip"),
        )  # fmt: skip
        await self.write_state()

    async def tag(self) -> Tag:  # a registered type (annotations are), kept in an Any field
        return self.state.anything  # type: ignore[no-any-return]

    async def visit(self) -> int:
        """Changes the state in place: what v1 code does to a state v2 wrote."""
        self.state.visits += 1
        self.state.address.street = "Side 2"
        self.state.places[0].lat = 50.0
        await self.write_state()
        return self.state.visits  # type: ignore[no-any-return]


@version(2)
@grain_type("Profile")
class ProfileV2(Grain):
    class State(BaseModel):
        full_name: str = Field("", validation_alias=AliasChoices("full_name", "name"))  # renamed
        visits: int = 0
        joined: str = "unknown"  # added
        address: AddressV2 = AddressV2()
        places: list[Location] = []
        anything: Any = None

    async def get(self) -> dict[str, Any]:
        return self.state.model_dump()

    async def anything_type(self) -> str:
        return type(self.state.anything).__name__

    async def tag(self) -> Tag:
        return self.state.anything  # type: ignore[no-any-return]

    async def rename(self, name: str) -> None:
        self.state.full_name = name
        await self.write_state()

    async def join(self, when: str, country: str) -> None:
        self.state.joined = when
        self.state.address.country = country
        self.state.address.postcode = "9999 ZZ"  # renamed from zip: v1 writes its zip back beside it
        self.state.anything = Tag(name="gold")
        await self.write_state()


@grain_type("Profile")
class ProfileV3(Grain):
    """``visits`` became a list and the postcode an int: the stored values do not fit."""

    class State(BaseModel):
        full_name: str = ""
        visits: int = 0
        address: AddressStrict = Field(default_factory=lambda: AddressStrict())

    async def get(self) -> dict[str, Any]:
        return self.state.model_dump()


class AddressStrict(BaseModel):
    street: str = ""
    zip: int = 0


AddressStrict.__qualname__ = "Address"
ProfileV3.State.model_rebuild()


@grain_type("Profile")
class ProfileVisitsAsList(Grain):
    class State(BaseModel):
        visits: list[str] = []

    async def get(self) -> dict[str, Any]:
        return self.state.model_dump()


@grain_type("Profile")
class ProfileOpen(Grain):
    """Keeps fields it does not declare (``extra="allow"``): nothing is dropped, nothing logged."""

    class State(BaseModel):
        model_config: ClassVar[Any] = {"extra": "allow"}
        visits: int = 0

    async def extras(self) -> dict[str, Any]:
        return dict(self.state.__pydantic_extra__ or {})


@grain_type("Profile")
class ProfileStrict(Grain):
    """Says ``extra="ignore"`` itself: fields it does not declare are dropped, and logged."""

    class State(BaseModel):
        model_config: ClassVar[Any] = {"extra": "ignore"}
        visits: int = 0

    async def visit(self) -> None:
        self.state.visits += 1
        await self.write_state()


class World:
    """One directory and store outliving the silos: each version's silo in turn."""

    def __init__(self) -> None:
        self.directory = InMemoryGrainDirectory()
        self.store = InMemoryStateStore(owner=self.directory.token_of)

    async def run(self, cls: type[Grain], method: str, key: str, *args: Any) -> Any:
        async with InProcessSilo([cls], directory=self.directory, store=self.store) as silo:
            return await getattr(silo.get_grain(cls, key), method)(*args)


@pytest.fixture
async def world() -> World:
    w = World()
    for key in ("a", "b"):
        await w.run(ProfileV1, "put", key)
    return w


async def test_added_fields_take_their_defaults_at_every_level(world: World) -> None:
    state = await world.run(ProfileV2, "get", "a")
    assert state["joined"] == "unknown" and state["address"]["country"] == "NL"
    assert state["visits"] == 3 and state["address"]["street"] == "Main 1"


async def test_renamed_fields_keep_their_values_through_an_alias_at_every_level(world: World) -> None:
    state = await world.run(ProfileV2, "get", "a")
    assert state["full_name"] == "ada" and state["address"]["postcode"] == "1234 AB"
    # Written again by v2 (under the new names), read again: the values stay.
    await world.run(ProfileV2, "rename", "a", "ada lovelace")
    state = await world.run(ProfileV2, "get", "a")
    assert state["full_name"] == "ada lovelace" and state["address"]["postcode"] == "1234 AB"


async def test_a_renamed_nested_class_loads_and_an_any_field_keeps_its_registered_type(world: World) -> None:
    state = await world.run(ProfileV2, "get", "a")
    assert state["places"] == [{"lat": 52.1, "lon": 4.3}, {"lat": 51.9, "lon": 4.5}]
    # No annotation says what an Any holds: it is built by the name it was written under.
    assert state["anything"] == {"name": "vip"}
    assert await world.run(ProfileV2, "anything_type", "a") == "Tag"


async def test_removed_fields_are_kept_at_every_level_and_logged_once_per_type(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="redgrain.state")
    async with InProcessSilo([ProfileV2], directory=world.directory, store=world.store) as silo:
        assert (await silo.get_grain(ProfileV2, "a").get())["visits"] == 3
        assert (await silo.get_grain(ProfileV2, "b").get())["visits"] == 3  # a second grain: no new lines
        await silo.get_grain(ProfileV2, "a").rename("ada lovelace")  # written by v2, which lacks them
    kept = [r.getMessage() for r in caplog.records if "is not in" in r.getMessage()]
    assert len(kept) == 3, kept
    for path in ("'nickname'", "'address.fax'", "'places[].source'"):
        assert any(path in m for m in kept), (path, kept)
    assert all("Profile" in m and "kept" in m for m in kept)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # Nothing dropped: v1 reads back what it wrote, after v2 wrote the state.
    async with InProcessSilo([ProfileOpen], directory=world.directory, store=world.store) as silo:
        extras = await silo.get_grain(ProfileOpen, "a").extras()
    assert extras["nickname"] == "countess" and extras["full_name"] == "ada lovelace"
    assert extras["address"]["fax"] == "555" and [p["source"] for p in extras["places"]] == ["gps", "gps"]


async def test_an_older_version_writes_back_the_fields_of_a_newer_one_unchanged_at_every_level(
    world: World,
) -> None:
    # v2 sets fields v1 lacks (top level, nested, a registered type in an Any field); a v1 silo
    # then serves a write of that grain (a rolling upgrade, or a rollback): they survive it.
    await world.run(ProfileV2, "join", "a", "2024-05-01", "BE")
    assert await world.run(ProfileV1, "visit", "a") == 4
    state = await world.run(ProfileV2, "get", "a")
    assert state["joined"] == "2024-05-01" and state["address"]["country"] == "BE"
    assert state["address"]["postcode"] == "9999 ZZ"  # its own name wins over v1's zip
    assert state["visits"] == 4 and state["address"]["street"] == "Side 2"  # v1's own change too
    assert state["places"][0]["lat"] == 50.0 and state["anything"] == {"name": "gold"}
    assert await world.run(ProfileV2, "anything_type", "a") == "Tag"
    # v1 code that replaces the whole state keeps the top level's unknown fields; a nested model
    # it replaced starts without them (they went with the object that held them).
    await world.run(ProfileV1, "put", "a")
    state = await world.run(ProfileV2, "get", "a")
    assert state["joined"] == "2024-05-01" and state["address"]["country"] == "NL"


async def test_a_model_that_says_extra_ignore_drops_unknown_fields_and_logs_them(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="redgrain.state")
    await world.run(ProfileStrict, "visit", "a")
    dropped = [r.getMessage() for r in caplog.records if "is dropped at the next write" in r.getMessage()]
    assert any("'nickname'" in m for m in dropped), dropped
    extras = await world.run(ProfileOpen, "extras", "a")
    assert "nickname" not in extras and "name" not in extras and extras == {}


async def test_a_model_that_allows_extra_fields_keeps_them_and_logs_nothing(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="redgrain.state")
    extras = await world.run(ProfileOpen, "extras", "a")
    assert extras["name"] == "ada" and extras["nickname"] == "countess"
    assert not [r for r in caplog.records if "is not in" in r.getMessage()]


async def test_a_value_that_no_longer_fits_fails_naming_its_field_at_every_level(world: World) -> None:
    with pytest.raises(errors.StorageError) as info:
        await world.run(ProfileV3, "get", "a")
    text = str(info.value)
    assert "Profile/a" in text and "'address.zip'" in text and "1234 AB" in text
    with pytest.raises(errors.StorageError) as info:
        await world.run(ProfileVisitsAsList, "get", "a")
    assert "'visits'" in str(info.value) and "ProfileVisitsAsList.State" in str(info.value)
