"""Membership rows: who is in the cluster, with what status, roles, versions and load.

Rows live in ``keys.members`` (one JSON row per silo, written by the
membership table's Lua scripts, ``silo/cluster/membership.py``); a silo's
heartbeat and load sit in hashes of their own (``keys.members_heartbeats``,
``keys.members_loads``) so a heartbeat never rewrites the row, and
:func:`merge_row` puts them back together for a reader.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, Field, field_validator

from grains.ids import SiloAddress


class SiloStatus(str, enum.Enum):
    JOINING = "Joining"
    ACTIVE = "Active"
    SHUTTING_DOWN = "ShuttingDown"
    DEAD = "Dead"


LIVE = (SiloStatus.JOINING, SiloStatus.ACTIVE, SiloStatus.SHUTTING_DOWN)


class SiloLoad(BaseModel):
    """Load a silo publishes with each heartbeat, for resource-optimized placement."""

    cpu_percent: float = 0.0
    memory_percent: float = 0.0
    activations: int = 0
    memory_available_bytes: int = 0
    """Host memory available to new allocations (psutil's ``available``); 0: not reported."""


class MemberRow(BaseModel):
    address: str
    host: str
    port: int
    generation: int
    status: SiloStatus = SiloStatus.JOINING
    roles: list[str] = Field(default_factory=list)
    grain_types: list[str] = Field(default_factory=list)
    grain_versions: dict[str, int] = Field(default_factory=dict)
    """Grain type -> the ``@version`` this silo hosts (a type missing here: version 1)."""
    started: float = 0.0
    heartbeat: float = 0.0
    pid: int = 0
    hostname: str = ""
    load: SiloLoad = Field(default_factory=SiloLoad)

    @field_validator("roles", "grain_types", mode="before")
    @classmethod
    def _empty_lua_table(cls, v: Any) -> Any:
        # Lua's cjson cannot tell an empty array from an empty object: {} means [].
        return [] if v == {} else v

    @field_validator("grain_versions", mode="before")
    @classmethod
    def _empty_lua_object(cls, v: Any) -> Any:
        return {} if v == [] else v  # the other way round: cjson may write {} as []

    @property
    def silo(self) -> SiloAddress:
        return SiloAddress(self.host, self.port, self.generation)

    def version_of(self, type_name: str) -> int:
        """The version of ``type_name`` this silo hosts (1 for a class without ``@version``)."""
        return self.grain_versions.get(type_name, 1)


def merge_row(row: MemberRow, heartbeat: Any, load: Any) -> MemberRow:
    """A row with its heartbeat and load (kept in hashes of their own, ``Keys.members_heartbeats``
    and ``Keys.members_loads``, so a heartbeat never rewrites the row) filled in."""
    update: dict[str, Any] = {}
    if heartbeat is not None:
        update["heartbeat"] = float(heartbeat)
    if load is not None:
        try:
            update["load"] = SiloLoad.model_validate_json(load)
        except ValueError:
            pass
    return row.model_copy(update=update) if update else row

