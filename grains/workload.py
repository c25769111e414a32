"""What a long-running workload asks of its silo beyond the programming model: ``workload(self)``.

A training job or a served model is driven by grains, but needs two things a
grain otherwise never does: a store shared with code that is not a grain
(torch.distributed's rendezvous, the serving front's replica records), and a
progress record that the dashboard and ``redgrain`` read back for the job::

    from grains.workload import workload

    cancel = await workload(self).publish_progress(job, record, point)
    prefix = workload(self).rendezvous_prefix(job, generation)

They are not members of ``Grain`` (the class a user subclasses holds the
programming model only); a grain reaches them through its own activation's
context, so two silos in one process each serve their own grains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from grains.base import Grain, grain_context
from grains.context import GrainContext

__all__ = ["Workload", "workload"]


class Workload:
    """A workload's shared store and progress record, as one grain reaches them."""

    __slots__ = ("_context",)

    def __init__(self, context: GrainContext) -> None:
        self._context = context

    # --- a shared store ------------------------------------------------------
    def redis_client(self) -> Any | None:
        """The silo's asyncio Redis client, for a workload that needs a shared store beyond
        grain state (torch.distributed's rendezvous); None where the runtime has no Redis.

        Keys written through it must come from :meth:`rendezvous_prefix` (the cluster's
        key space is built in one place, ``silo/keys.py``).
        """
        return self._context.redis_client()

    def rendezvous_prefix(self, name: str, generation: int) -> str:
        """The cluster's key prefix for rendezvous ``name`` at ``generation`` (one group each)."""
        return self._context.rendezvous_prefix(name, generation)

    # --- progress ------------------------------------------------------------
    async def publish_progress(
        self,
        job: str,
        record: BaseModel,
        point: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        restart_history: bool = False,
    ) -> bool:
        """Publish the latest progress of a long-running ``job`` the grain drives.

        ``record`` (any pydantic model: the workload's own schema) is what the
        dashboard and ``redgrain`` read back for the job; ``point`` (flat values), or a list
        of them, is appended to the job's capped history, for curves. One round trip.
        ``restart_history``: the history holds these points alone (the job's own lost points).
        Returns True when someone asked to cancel the job (``silo.records.control.request_cancel``).
        """
        many = [point] if isinstance(point, Mapping) else list(point or ())
        fields = [{k: repr(v) if isinstance(v, float) else str(v) for k, v in p.items() if v is not None} for p in many]
        return await self._context.publish_progress(job, record.model_dump_json(), fields, restart=restart_history)

    async def forget_progress(self, job: str) -> None:
        """Delete everything :meth:`publish_progress` wrote for ``job`` (record, history, its
        place in the job list) and its rendezvous keys: the job is gone from the dashboard."""
        await self._context.forget_progress(job)


def workload(grain: Grain) -> Workload:
    """The shared store and progress record, for ``grain`` (an activated grain: usually ``self``)."""
    return Workload(grain_context(grain))
