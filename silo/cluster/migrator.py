"""The source side of a move: hand an activation to another silo without losing a call.

A move (ordered by the rebalancer's leader with a ``move`` system call, or a
draining silo's keep-alive hand-off): calls for the grain wait while it
moves; the activation is deactivated (``REBALANCE``: its turn finishes,
``on_deactivate`` runs, write-behind state is flushed, the directory entry is
removed), then the target is told to activate it (it registers in the
directory with check-and-set), and the waiting calls are forwarded there.
Nothing runs twice and nothing is dropped.

The waiting is the dispatcher's: :attr:`Migrator.moving` maps a grain being
moved to a future of where it went, and the dispatcher is built with that
same dict, so a call that arrives mid-move awaits it and follows the grain.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from grains.base import DeactivationReason
from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.catalog.activation_state import ActivationState
from silo.cluster.events import ClusterEvents
from silo.cluster.versions import compatible
from silo.cluster.view import MembershipView

if TYPE_CHECKING:
    from silo.catalog.activation import Activation
    from silo.catalog.catalog import Catalog
    from silo.cluster.placement import Placer
    from silo.messaging.router import Manifests, Router

log = logging.getLogger("redgrain.rebalancer")

Moving = dict[GrainId, asyncio.Future[SiloAddress | None]]
"""Grains being moved away -> where they went (None: the move failed, they stay here)."""


def _nobody_unreachable() -> set[str]:
    return set()


class Migrator:
    """Moves activations of this silo to others: balance orders and the drain's keep-alive hand-off."""

    def __init__(
        self,
        *,
        me: SiloAddress,
        catalog: Catalog,
        router: Router,
        view: MembershipView,
        manifests: Manifests,
        placer: Placer,
        events: ClusterEvents,
        unreachable: Callable[[], set[str]] = _nobody_unreachable,
    ) -> None:
        self._me = me
        self._catalog = catalog
        self._router = router
        self._view = view
        self._manifests = manifests
        self._placer = placer
        self._events = events
        self._unreachable = unreachable
        self._batch: asyncio.Task[int] | None = None
        self.moving: Moving = {}
        """Shared with the dispatcher (its ``moving``): calls for these grains wait, then follow."""
        self.moved = 0
        self.failures = 0

    def movable(self, *, for_drain: bool = False) -> list[Activation]:
        """Activations that may move, idle and least recently used first."""
        acts = [
            a
            for a in self._catalog.activations()
            if a.status is ActivationState.ACTIVE
            and not a.options.stateless_worker
            and (for_drain or not (a.options.immovable or a.options.keep_alive))
        ]
        return sorted(acts, key=lambda a: (a.busy, a.last_used))

    async def move(self, act: Activation, target: SiloAddress) -> bool:
        """Deactivate here, activate on ``target``; calls that arrive meanwhile follow it."""
        grain = act.grain_id
        moving: asyncio.Future[SiloAddress | None] = asyncio.get_running_loop().create_future()
        self.moving[grain] = moving
        where: SiloAddress | None = None
        try:
            await self._catalog.deactivate(act, DeactivationReason.REBALANCE)
            try:
                where = SiloAddress.parse(await self._router.activate(grain, target))
            except errors.RedgrainError as exc:
                log.warning("move of %s to %s failed: %s", grain, target, exc)
        finally:
            moving.set_result(where)
            self.moving.pop(grain, None)
        if where is None:
            self.failures += 1
            return False
        self.moved += 1
        return True

    async def system_move(self, count: int, targets: list[str]) -> int:
        """The ``$silo.move`` system call of the rebalancer's leader: how many will go."""
        # The leader may not know we cannot reach a target (a partition): a move there
        # would hold the grain's calls until the activation request times out.
        unreachable = self._unreachable()
        return self.move_out_nowait(int(count), [str(t) for t in targets if str(t) not in unreachable])

    def move_out_nowait(self, count: int, targets: list[str]) -> int:
        """Start moving up to ``count`` activations to ``targets`` (round robin); how many will go."""
        if self._batch is not None and not self._batch.done():
            return 0  # one batch at a time: the leader asks again next period
        acts = self.movable()[: max(0, count)]
        silos = [SiloAddress.parse(t) for t in targets if t != str(self._me)]
        if not acts or not silos:
            return 0
        self._batch = asyncio.get_running_loop().create_task(self._move_all(acts, silos))
        return len(acts)

    async def _move_all(self, acts: list[Activation], silos: list[SiloAddress]) -> int:
        moved = 0
        for i, act in enumerate(acts):
            if act.status is not ActivationState.ACTIVE:
                continue
            # Never to an older version of the type (silo/cluster/versions.py): it would refuse it.
            fit = [s for s in silos if self._hosts_version(s, act.grain_id.type_name, act.options.version)]
            if fit:
                moved += await self.move(act, fit[i % len(fit)])
        self._events.emit(
            "rebalance", {"from": str(self._me), "moved": moved, "to": [str(s) for s in silos]}
        )
        return moved

    def _hosts_version(self, silo: SiloAddress, type_name: str, version: int) -> bool:
        row = self._view.row(silo)
        return row is not None and row.version_of(type_name) >= version

    def _target_for(self, grain: GrainId) -> SiloAddress | None:
        info = self._manifests.get_nowait(grain.type_name)
        if info is None:
            return None
        others = [r for r in self._view.hosting(grain.type_name) if r.silo != self._me]
        candidates = compatible(others, grain.type_name, info.versions, None)  # the newest version
        try:
            return self._placer.place(grain, info.placement, candidates, None)
        except errors.SiloUnavailableError:
            return None

    async def hand_off_keep_alive(self) -> int:
        """Draining: move every @keep_alive activation to another silo now, not on next call."""
        acts = [a for a in self.movable(for_drain=True) if a.options.keep_alive]
        moved = 0
        for act in acts:
            target = self._target_for(act.grain_id)
            if target is not None and act.status is ActivationState.ACTIVE:
                moved += await self.move(act, target)
        return moved

    async def stop(self) -> None:
        if self._batch is not None:
            self._batch.cancel()
            await asyncio.gather(self._batch, return_exceptions=True)
            self._batch = None
