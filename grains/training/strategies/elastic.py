"""Which silos a job's trainers may use right now: the coordinator's one look at membership.

Both training modes ask the same questions each tick: which trainer silos are
alive (a member on a silo that left must go), and which have no trainer of
this job yet (with ``trainers = "auto"``, or below the requested count, a silo
that joined gets one). The answers come from the silo's membership view
(``Grain.cluster_members``), the runtime's failure detection; a silo whose
trainer did not answer a call is also left out for a while (*quarantined*), so
a dying silo that is not yet declared dead is not picked again at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from grains.base import Grain
from grains.training.strategies import cluster
from silo.records.membership import MemberRow

QUARANTINE_S = 10.0


@dataclass(frozen=True, slots=True)
class SiloLook:
    """One look at membership for one job."""

    eligible: list[MemberRow]
    """Trainer silos (the role's, else every silo hosting the type), GPU first, quarantined left out."""
    hosting: list[MemberRow]
    """Every active silo hosting the trainer type (the rows hash placement chooses among)."""

    @property
    def alive(self) -> set[str]:
        return {r.address for r in self.hosting}

    def without_trainer(self, placed: Sequence[str]) -> list[MemberRow]:
        """Eligible silos that host none of the ``placed`` trainers (silo addresses)."""
        taken = set(placed)
        return [r for r in self.eligible if r.address not in taken]

    def excluding(self, silos: Sequence[str]) -> SiloLook:
        """This look without ``silos`` as trainer silos (a job shed them: out of memory there)."""
        if not silos:
            return self
        out = set(silos)
        return SiloLook(eligible=[r for r in self.eligible if r.address not in out], hosting=self.hosting)

    def all_gpu(self, silos: Sequence[str]) -> bool:
        roles = {r.address: r.roles for r in self.hosting}
        return bool(silos) and all("gpu" in roles.get(s, ()) for s in silos)


class TrainerSilos:
    """Membership as the coordinator of one job sees it (in memory; rebuilt on re-activation)."""

    def __init__(
        self, type_name: str, role: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.type_name = type_name
        self.role = role
        self._clock = clock
        self._quarantine: dict[str, float] = {}

    def look(self, grain: Grain) -> SiloLook:
        now = self._clock()
        self._quarantine = {s: t for s, t in self._quarantine.items() if t > now}
        hosting = cluster.hosting_silos(grain, self.type_name)
        eligible = [
            r
            for r in cluster.trainer_silos(hosting, self.role)
            if r.address not in self._quarantine
        ]
        return SiloLook(eligible=eligible, hosting=hosting)

    def quarantine(self, silo: str, seconds: float = QUARANTINE_S) -> None:
        """Do not place trainers on ``silo`` for a while (its trainer did not answer)."""
        self._quarantine[silo] = self._clock() + seconds
