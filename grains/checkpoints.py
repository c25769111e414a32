"""Checkpoints of grain groups, a facility a grain uses: ``snapshots(self)``.

A snapshot is ``(group, snapshot_id)`` with a fixed list of member grains; each
member saves its own ``self.state`` into it, and it becomes complete (and
restorable) once every member has saved (docs/state.md, "Checkpoints")::

    from grains.checkpoints import snapshots

    class Shard(Grain):
        async def checkpoint(self, step: int, members: list[str]) -> bool:
            return await snapshots(self).save("job-7", step, members, keep=3)

        async def restore(self) -> str:
            return await snapshots(self).load("job-7")  # the latest complete

Checkpoints are not part of ``Grain`` (the class a user subclasses holds the
programming model only): most grains never snapshot a group, and those that do
reach the silo's checkpoint store through their own activation, so two silos in
one process keep theirs apart. Outside a grain (a client, the CLI, the
dashboard), ``silo.storage.checkpoint.Checkpoints`` reads and restores the same
snapshots under the same method names.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Sequence
from typing import Any

from grains.base import Grain, grain_context
from grains.context import GrainContext, SnapshotInfo

__all__ = ["SnapshotInfo", "Snapshots", "snapshots"]


class Snapshots:
    """The checkpoints of grain groups, as one grain sees them (its state is what it saves)."""

    __slots__ = ("_context",)

    def __init__(self, context: GrainContext) -> None:
        self._context = context

    async def save(
        self,
        group: str,
        snapshot_id: int | str,
        members: Iterable[Any] | None = None,
        *,
        keep: int | None = None,
        epoch: int | None = None,
    ) -> bool:
        """Save the grain's ``self.state`` as its part of snapshot ``(group, snapshot_id)``.

        ``members`` (grain ids, references or ``"Type/key"``; default: this grain
        alone) must be the same list in every member's save. The snapshot becomes
        visible once all members saved; True is returned to the save that completed
        it. ``keep``: complete snapshots of the group to retain (default from settings).
        ``epoch``: who owns the snapshot (a training job's generation); a newer epoch's
        save takes over what an older one left at the same id, an older one's is refused.
        The state is encoded before the first await, so the grain may change it at once.
        """
        return await self._context.save_snapshot(group, snapshot_id, members, keep=keep, epoch=epoch)

    async def load(self, group: str, snapshot_id: int | str | None = None, *, write: bool = True) -> str:
        """Replace the grain's ``self.state`` with its part of a complete snapshot (None: the
        latest). With ``write`` (default) the restored state is persisted at once. Returns the
        snapshot id; a missing or incomplete snapshot raises StorageError."""
        return await self._context.load_snapshot(group, snapshot_id, write=write)

    async def read_member(self, group: str, snapshot_id: int | str, member: str) -> Any:
        """Another member's part of snapshot ``(group, snapshot_id)``, decoded as this grain's
        ``State``: for groups whose members share one state model (a training job's shards
        read each other's parts when the shard layout changes)."""
        return await self._context.read_snapshot_member(group, snapshot_id, member)

    async def info(self, group: str, snapshot_id: int | str) -> SnapshotInfo | None:
        """What the manifest of snapshot ``(group, snapshot_id)`` says; None if there is none."""
        return await self._context.snapshot_info(group, snapshot_id)

    async def latest_complete(self, group: str) -> SnapshotInfo | None:
        """The newest complete snapshot of ``group`` (None: none yet)."""
        return await self._context.latest_snapshot(group)

    async def list(self, group: str, *, pending: bool = False) -> Sequence[SnapshotInfo]:
        """The group's complete snapshots, oldest first (``pending``: those still being saved)."""
        return await self._context.list_snapshots(group, pending=pending)

    async def delete(self, group: str, snapshot_id: int | str) -> bool:
        """Delete one snapshot of ``group``, complete or not; True if it existed."""
        return await self._context.delete_snapshot(group, snapshot_id)

    async def groups(self) -> builtins.list[str]:
        """Every checkpoint group with a snapshot (complete or pending) in the cluster, sorted."""
        return await self._context.checkpoint_groups()


def snapshots(grain: Grain) -> Snapshots:
    """The checkpoints of grain groups, for ``grain`` (an activated grain: usually ``self``)."""
    return Snapshots(grain_context(grain))
