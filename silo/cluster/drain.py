"""Draining a silo: leaving the cluster without losing a call.

A drain is asked for by SIGTERM (``silo/process.py``), by the ``drain``
command in the silo's control inbox (the dashboard, ``redgrain drain``) or
by the ``$silo.drain`` system call. The last two come through
:class:`DrainRequests`, which runs the silo's graceful stop in a task of its
own: whoever asked (the inbox loop, a remote caller) must not wait on the
silo it runs on to stop, and the stop must not be cancelled with it.

A graceful stop is :class:`Departure`, in two halves around the silo's
stop stages:

1. :meth:`Departure.hand_off`, first: stop claiming reminder ticks (a
   survivor claims them), ShuttingDown in the table (callers stop placing
   new activations here), the dispatcher creates no activation any more,
   ``@keep_alive`` activations move to another silo at once (a training
   group must not wait for its next call to come back), every other
   activation deactivates (its queued calls re-route).
2. :meth:`Departure.leave`, once the cluster services are stopped (so no
   heartbeat runs into our own Dead row): Dead in the table, our directory
   entries purged, then, for a graceful stop, :meth:`Departure.quiesce`:
   callers that have not seen us Dead yet still send; closing the
   connections under them would fail calls that a moment later go elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from grains.base import DeactivationReason
from grains.ids import SiloAddress
from silo import errors
from silo.cluster.events import ClusterEvents
from silo.cluster.membership import MembershipTable
from silo.records.membership import SiloStatus

if TYPE_CHECKING:
    from silo.catalog.catalog import Catalog
    from silo.cluster.directory import GrainDirectory
    from silo.cluster.migrator import Migrator
    from silo.cluster.reminders import ReminderService
    from silo.messaging.dispatcher import Dispatcher

log = logging.getLogger("redgrain.drain")


class DrainRequests:
    """Drains asked from outside the process: each starts the silo's graceful stop, once."""

    def __init__(self, stop: Callable[[], Awaitable[None]]) -> None:
        self._stop = stop
        self._task: asyncio.Task[None] | None = None
        self.requested = 0

    def request(self, by: str) -> None:
        log.info("drain requested by %s", by)
        self.requested += 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="drain")

    async def _run(self) -> None:
        await self._stop()

    def command(self, cmd: dict[str, Any]) -> None:
        """The control inbox's ``drain`` command (the process then exits as after SIGTERM)."""
        self.request(str(cmd.get("by", "?")))

    async def system_drain(self) -> str:
        """The ``$silo.drain`` system call."""
        self.request("system call")
        return "draining"

    async def close(self) -> None:
        """Stop stage: end a drain task that waits for a stop someone else is running.

        A drain task that is itself running the stop is where this is called
        from, and ends on its own when the stop returns.
        """
        task = self._task
        if task is None or task is asyncio.current_task() or task.done():
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class Departure:
    """The two halves of a graceful leave (see the module docstring)."""

    def __init__(
        self,
        *,
        me: SiloAddress,
        table: MembershipTable,
        directory: GrainDirectory,
        dispatcher: Dispatcher,
        catalog: Catalog,
        migrator: Migrator,
        reminders: ReminderService,
        events: ClusterEvents,
    ) -> None:
        self._me = me
        self._addr = str(me)
        self._table = table
        self._directory = directory
        self._dispatcher = dispatcher
        self._catalog = catalog
        self._migrator = migrator
        self._reminders = reminders
        self._events = events

    async def hand_off(self) -> None:
        """Before the stop stages: move or deactivate every activation, create none."""
        await self._reminders.stop()
        try:
            await self._table.set_status(self._addr, SiloStatus.SHUTTING_DOWN)
        except errors.RedgrainError as exc:
            log.warning("could not mark %s ShuttingDown: %s", self._addr, exc)
        self._dispatcher.draining = True
        self._events.emit("drain", {"silo": self._addr, "activations": len(self._catalog)})
        await self._migrator.hand_off_keep_alive()
        await self._catalog.deactivate_all(DeactivationReason.SHUTDOWN)

    async def leave(self, *, graceful: bool) -> None:
        """After the cluster services stopped: Dead, directory purged; graceful: quiesce."""
        try:
            await self._table.set_status(self._addr, SiloStatus.DEAD)
            await self._directory.purge_silo(self._me)
        except errors.RedgrainError as exc:
            log.warning("could not mark %s Dead: %s", self._addr, exc)
        if graceful:
            await self.quiesce()
        self._events.emit("leave", {"graceful": graceful})

    async def quiesce(self, quiet_s: float = 0.2, limit_s: float = 1.0) -> None:
        """Wait until callers stop sending (they have seen us Dead) before closing connections."""
        loop = asyncio.get_running_loop()
        end = loop.time() + limit_s
        seen = self._dispatcher.statistics().requests
        quiet_since = loop.time()
        while loop.time() < end and loop.time() - quiet_since < quiet_s:
            await asyncio.sleep(0.05)
            now = self._dispatcher.statistics().requests
            if now != seen:
                seen, quiet_since = now, loop.time()
