"""Where training grains go: the silos that may host trainers and shards.

Trainers are pinned one per silo and shards spread over silos. Both use hash
placement, and the coordinator picks grain keys whose rendezvous hash lands
on the silo it wants (trying a numbered suffix until it does), so placement
stays a plain, stateless director and a re-activation after a silo loss goes
wherever the hash says among the survivors.
"""

from __future__ import annotations

from collections.abc import Sequence

from grains.base import Grain
from grains.ids import GrainId, SiloAddress
from silo.cluster.placement import HashPlacement
from silo.records.membership import MemberRow

_HASH = HashPlacement()
_MAX_SALT = 10_000


def hosting_silos(grain: Grain, type_name: str) -> list[MemberRow]:
    """Active silos hosting ``type_name``, as this grain's silo sees them."""
    return grain.cluster_members(type_name)


def trainer_silos(rows: Sequence[MemberRow], role: str) -> list[MemberRow]:
    """Silos with the trainer role if any has it, else all; GPU silos first."""
    chosen = [r for r in rows if role in r.roles] or list(rows)
    return sorted(chosen, key=lambda r: ("gpu" not in r.roles, r.address))


def key_on(type_name: str, base: str, target: SiloAddress, rows: Sequence[MemberRow]) -> str:
    """``base`` or ``base~n``: the first key that hash placement puts on ``target``."""
    if not any(r.silo == target for r in rows):
        return base
    for n in range(_MAX_SALT):
        key = base if n == 0 else f"{base}~{n}"
        if _HASH.place(GrainId(type_name, key), rows, None) == target:
            return key
    return base
