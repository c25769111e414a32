"""Placement directors: pick the silo for a new activation, one small class per strategy.

Placement runs at the caller (a silo or a client) from its membership view,
so a call goes straight to the chosen silo, which then claims the grain in
the directory. Directors are pure functions of the view and the grain id,
which makes each one easy to test.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Protocol

from grains.ids import GrainId, SiloAddress
from grains.placement import Placement
from silo import errors
from silo.records.membership import MemberRow


class PlacementDirector(Protocol):
    def place(
        self, grain: GrainId, candidates: Sequence[MemberRow], local: SiloAddress | None
    ) -> SiloAddress: ...


class RandomPlacement:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def place(self, grain: GrainId, candidates: Sequence[MemberRow], local: SiloAddress | None) -> SiloAddress:
        return self._rng.choice(list(candidates)).silo


class PreferLocalPlacement:
    """The calling silo when it can host the type; random otherwise (clients)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._random = RandomPlacement(rng)

    def place(self, grain: GrainId, candidates: Sequence[MemberRow], local: SiloAddress | None) -> SiloAddress:
        if local is not None and any(c.silo == local for c in candidates):
            return local
        return self._random.place(grain, candidates, local)


class HashPlacement:
    """Rendezvous hashing: stable for a given set of silos; a change moves only ~1/n of grains."""

    def place(self, grain: GrainId, candidates: Sequence[MemberRow], local: SiloAddress | None) -> SiloAddress:
        key = str(grain).encode()

        def score(row: MemberRow) -> bytes:
            # Endpoint, not generation: a restarted silo on the same address gets its grains back.
            return hashlib.blake2b(key + b"|" + f"{row.host}:{row.port}".encode(), digest_size=8).digest()

        return max(candidates, key=score).silo


class ActivationCountPlacement:
    """Power of two choices on published activation counts."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def place(self, grain: GrainId, candidates: Sequence[MemberRow], local: SiloAddress | None) -> SiloAddress:
        rows = list(candidates)
        if len(rows) == 1:
            return rows[0].silo
        a, b = self._rng.sample(rows, 2)
        return (a if a.load.activations <= b.load.activations else b).silo


class ResourceOptimizedPlacement:
    """Least loaded by a weighted score of CPU, memory and activation count (the default).

    Two random candidates are scored rather than all of them, so a burst of
    placements between two load reports does not pile onto one silo.
    """

    def __init__(self, rng: random.Random | None = None, *, local_bonus: float = 0.05) -> None:
        self._rng = rng or random.Random()
        self._local_bonus = local_bonus

    def score(self, row: MemberRow, max_acts: int, local: SiloAddress | None) -> float:
        s = 0.4 * row.load.cpu_percent / 100 + 0.2 * row.load.memory_percent / 100
        s += 0.4 * (row.load.activations / max_acts if max_acts else 0.0)
        if row.silo == local:
            s -= self._local_bonus
        return s

    def place(self, grain: GrainId, candidates: Sequence[MemberRow], local: SiloAddress | None) -> SiloAddress:
        rows = list(candidates)
        if len(rows) > 2:
            rows = self._rng.sample(rows, 2)
        max_acts = max((r.load.activations for r in rows), default=0)
        return min(rows, key=lambda r: self.score(r, max_acts, local)).silo


class SiloRolePlacement:
    """Only silos with the role (candidates are already filtered); random among them."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._random = RandomPlacement(rng)

    def place(self, grain: GrainId, candidates: Sequence[MemberRow], local: SiloAddress | None) -> SiloAddress:
        return self._random.place(grain, candidates, local)


class Placer:
    """Chooses the director for a grain class's placement marker and applies it."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._directors: dict[str, PlacementDirector] = {
            "random": RandomPlacement(rng),
            "prefer_local": PreferLocalPlacement(rng),
            "hash": HashPlacement(),
            "activation_count": ActivationCountPlacement(rng),
            "resource": ResourceOptimizedPlacement(rng),
            "silo_role": SiloRolePlacement(rng),
            # Stateless workers run where they are called from when possible.
            "stateless_worker": PreferLocalPlacement(rng),
        }

    def place(
        self,
        grain: GrainId,
        placement: Placement,
        candidates: Sequence[MemberRow],
        local: SiloAddress | None,
    ) -> SiloAddress:
        if placement.strategy == "silo_role" and placement.role:
            candidates = [c for c in candidates if placement.role in c.roles]
        if not candidates:
            detail = f" with role {placement.role!r}" if placement.strategy == "silo_role" else ""
            raise errors.SiloUnavailableError(
                "", f"no active silo{detail} hosts grain type {grain.type_name!r}"
            )
        return self._directors[placement.strategy].place(grain, candidates, local)
