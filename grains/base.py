"""The Grain base class: identity, lifecycle hooks, state handle, timers.

A grain is a plain class with ``async def`` methods. The runtime creates an
instance per activation, binds it to its activation, loads its state, then
calls :meth:`Grain.on_activate`. Users never construct grains themselves.

::

    class Counter(Grain):
        class State(BaseModel):
            value: int = 0

        async def add(self, n: int) -> int:
            self.state.value += n
            await self.write_state()
            return self.state.value
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel

from grains.ids import GrainId, SiloAddress

if TYPE_CHECKING:
    from silo.catalog.catalog import Activation, Timer

G = TypeVar("G")
R = TypeVar("R")


class DeactivationReason(str, enum.Enum):
    IDLE = "idle"
    REQUESTED = "requested"
    ERROR = "error"
    STATE_CONFLICT = "state_conflict"
    SHUTDOWN = "shutdown"
    REBALANCE = "rebalance"
    MIGRATION = "migration"
    DIRECTORY_LOST = "directory_lost"
    ACTIVATION_FAILED = "activation_failed"


class Grain:
    """Base class of every grain."""

    State: ClassVar[type[BaseModel] | None] = None
    """Declare a pydantic model named ``State`` to get a persisted ``self.state``."""

    _rg_activation: Activation

    # --- identity ----------------------------------------------------------
    @property
    def grain_id(self) -> GrainId:
        return self._rg_activation.grain_id

    @property
    def key(self) -> str:
        return self._rg_activation.grain_id.key

    @property
    def activation_id(self) -> str:
        return self._rg_activation.activation_id

    @property
    def silo(self) -> SiloAddress:
        """Address of the silo hosting this activation."""
        return self._rg_activation.silo

    @property
    def device(self) -> str:
        """Torch device this silo gives its grains ("cpu" or "cuda")."""
        return self._rg_activation.runtime.device

    # --- lifecycle hooks ---------------------------------------------------
    async def on_activate(self) -> None:
        """Called once, after state is loaded and before the first call."""

    async def on_deactivate(self, reason: DeactivationReason) -> None:
        """Called once when the activation goes away (not after a crash)."""

    def deactivate_on_idle(self) -> None:
        """Deactivate this activation once the current turn ends."""
        self._rg_activation.request_deactivation(DeactivationReason.REQUESTED)

    # --- calls -------------------------------------------------------------
    def get_grain(self, grain: type[G] | str, key: str | int | Any) -> G:
        """A reference to another grain (or this one); calls carry this call chain."""
        return self._rg_activation.runtime.get_grain(grain, key)  # type: ignore[return-value]

    def cluster_members(self, type_name: str | None = None) -> list[Any]:
        """Membership rows of the active silos (hosting ``type_name``, when given), as this silo sees them."""
        return self._rg_activation.runtime.cluster_members(type_name)

    async def run_in_thread(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        """Run CPU-heavy ``fn`` on the silo's bounded executor, keeping the loop free."""
        return await self._rg_activation.runtime.run_in_thread(fn, *args, **kwargs)

    def start_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, owned by this activation.

        The task does not hold the turn (other calls keep being served) and is
        cancelled when the activation deactivates, before ``on_deactivate``.
        Use it for long-running loops such as a training job's driver.
        """
        return self._rg_activation.start_task(coro, name=name)

    # --- timers ------------------------------------------------------------
    def register_timer(
        self,
        callback: Callable[[], Awaitable[None]],
        *,
        due_s: float,
        period_s: float | None = None,
        interleave: bool = False,
    ) -> Timer:
        """Run ``callback`` after ``due_s`` (then every ``period_s``) as a turn of this grain.

        Timers live in memory and die with the activation; use reminders for
        anything that must survive a silo.
        """
        return self._rg_activation.register_timer(
            callback, due_s=due_s, period_s=period_s, interleave=interleave
        )

    # --- state -------------------------------------------------------------
    @property
    def state(self) -> Any:
        """The grain's state (an instance of its ``State`` model)."""
        return self._rg_activation.state_handle().value

    @state.setter
    def state(self, value: Any) -> None:
        self._rg_activation.state_handle().value = value

    async def write_state(self) -> None:
        """Persist ``self.state``; raises StateConflictError if another activation owns it."""
        await self._rg_activation.state_handle().write()

    async def read_state(self) -> None:
        """Reload ``self.state`` from storage."""
        await self._rg_activation.state_handle().read()

    async def clear_state(self) -> None:
        """Delete the persisted state and reset ``self.state`` to the model's defaults."""
        await self._rg_activation.state_handle().clear()

    # --- reminders ---------------------------------------------------------
    async def register_reminder(self, name: str, period_s: float, due_s: float | None = None) -> None:
        """A durable reminder: ``receive_reminder(name)`` every ``period_s``, on any silo."""
        await self._rg_activation.runtime.reminders().register(self.grain_id, name, period_s, due_s)

    async def unregister_reminder(self, name: str) -> None:
        await self._rg_activation.runtime.reminders().unregister(self.grain_id, name)

    async def receive_reminder(self, name: str) -> None:
        """Override to act on reminders (runs as a turn; activates the grain if needed)."""

    # --- checkpoints -------------------------------------------------------
    async def save_snapshot(
        self,
        group: str,
        snapshot_id: int | str,
        members: Iterable[Any] | None = None,
        *,
        keep: int | None = None,
    ) -> bool:
        """Save ``self.state`` as this grain's part of snapshot ``(group, snapshot_id)``.

        ``members`` (grain ids, references or ``"Type/key"``; default: this grain
        alone) must be the same list in every member's save. The snapshot becomes
        visible once all members saved; True is returned to the save that completed
        it. ``keep``: complete snapshots of the group to retain (default from settings).
        """
        act = self._rg_activation
        cps: Any = act.runtime
        return bool(
            await cps.checkpoints().save(
                group,
                snapshot_id,
                self.grain_id,
                act.state_handle().encode(),
                members=[self.grain_id] if members is None else members,
                token=act.token,
                keep=keep,
            )
        )

    async def load_snapshot(
        self, group: str, snapshot_id: int | str | None = None, *, write: bool = True
    ) -> str:
        """Replace ``self.state`` with this grain's part of a complete snapshot (None: the latest).

        With ``write`` (default) the restored state is persisted at once. Returns the snapshot id.
        """
        act = self._rg_activation
        cps: Any = act.runtime
        stored, snap = await cps.checkpoints().load(group, snapshot_id, self.grain_id)
        handle = act.state_handle()
        handle.adopt(handle.decode(stored))
        if write:
            await handle.write()
        return str(snap)
