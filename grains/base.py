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
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from pydantic import BaseModel

from grains.context import DeactivationReason, GrainContext, PersistentState, TimerHandle
from grains.ids import GrainId, SiloAddress
from grains.observer import ObserverRef

if TYPE_CHECKING:
    from grains.ref import GrainRef, Ref
from grains.streams import Stream, StreamGap

__all__ = ["DeactivationReason", "Grain", "grain_context"]

G = TypeVar("G", bound="Grain")
R = TypeVar("R")
M = TypeVar("M", bound=BaseModel)

_STATE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Grain:
    """Base class of every grain."""

    State: ClassVar[type[BaseModel] | None] = None
    """Declare a pydantic model named ``State`` to get a persisted ``self.state``."""

    _rg_context: GrainContext
    """Bound by the runtime when it activates the grain (grains/context.py)."""

    # --- identity ----------------------------------------------------------
    @property
    def grain_id(self) -> GrainId:
        return self._rg_context.grain_id

    @property
    def key(self) -> str:
        return self._rg_context.grain_id.key

    @property
    def activation_id(self) -> str:
        return self._rg_context.activation_id

    @property
    def silo(self) -> SiloAddress:
        """Address of the silo hosting this activation."""
        return self._rg_context.silo

    @property
    def device(self) -> str:
        """Torch device this silo gives its grains ("cpu" or "cuda")."""
        return self._rg_context.device

    # --- lifecycle hooks ---------------------------------------------------
    async def on_activate(self) -> None:
        """Called once, after state is loaded and before the first call."""

    async def on_deactivate(self, reason: DeactivationReason) -> None:
        """Called once when the activation goes away (not after a crash)."""

    def deactivate_on_idle(self) -> None:
        """Deactivate this activation once the current turn ends."""
        self._rg_context.request_deactivation(DeactivationReason.REQUESTED)

    # --- calls -------------------------------------------------------------
    @overload
    def get_grain(self, grain: type[G], key: str | int | Any) -> Ref[G]: ...
    @overload
    def get_grain(self, grain: str, key: str | int | Any) -> GrainRef: ...
    def get_grain(self, grain: type[Grain] | str, key: str | int | Any) -> GrainRef:
        """A reference to another grain (or this one); calls carry this call chain.

        Typed as ``Ref[G]`` for a class (its public async methods, with the mypy plugin),
        as a plain ``GrainRef`` for a type name."""
        return self._rg_context.get_grain(grain, key)

    def cluster_members(self, type_name: str | None = None) -> list[Any]:
        """Membership rows of the active silos (hosting ``type_name``, when given), as this silo sees them."""
        return self._rg_context.cluster_members(type_name)

    async def refresh_cluster_members(self) -> None:
        """Re-read membership now, so :meth:`cluster_members` answers with every silo that has
        joined or left so far (not as of this silo's last periodic refresh). For a placement that
        must see the whole cluster, such as a job's first start."""
        await self._rg_context.refresh_cluster_members()

    async def run_in_thread(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        """Run CPU-heavy ``fn`` on the silo's bounded executor, keeping the loop free."""
        return await self._rg_context.run_in_thread(fn, *args, **kwargs)

    def start_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, owned by this activation.

        The task does not hold the turn (other calls keep being served) and is
        cancelled when the activation deactivates, before ``on_deactivate``.
        Use it for long-running loops such as a training job's driver.
        """
        return self._rg_context.start_task(coro, name=name)

    def observer(self, handler: object) -> ObserverRef:
        """A reference to ``handler`` (a plain object: its public async methods are the observer's
        interface) that this grain can hand to other grains, which call it like a grain.

        Its calls run on this silo beside this grain's turns (as ``@interleave`` methods do);
        it lives as long as this activation: after a deactivation its calls raise
        ObserverGoneError (see ``grains.ObserverSet``).
        """
        return self._rg_context.observer(handler)
    # --- streams -----------------------------------------------------------
    def stream(self, namespace: str, key: str | int | Any) -> Stream:
        """A handle on stream ``(namespace, key)``: ``await s.publish(item)``,
        ``async for ev in s.subscribe(...)`` (grains/streams.py)."""
        return self._rg_context.stream(namespace, key)

    async def on_stream_item(self, item: Any, token: str) -> None:
        """Override in a ``@subscribes`` class: one item of the stream keyed like this grain,
        as a turn, in order; acknowledged once it returns (at least once: see ``token``)."""
        raise NotImplementedError(f"{type(self).__qualname__} receives stream items but has no on_stream_item")

    async def on_stream_gap(self, gap: StreamGap) -> None:
        """Called (as a turn, in order, before the item after it) when retention trimmed items of
        this grain's stream before they were delivered: ``gap.lost`` items between ``gap.after``
        and ``gap.before``. The silo has logged and counted them already; override to act on it
        (re-read a source, mark a view stale). Raising counts as a failed attempt, as for items."""

    # --- timers ------------------------------------------------------------
    def register_timer(
        self,
        callback: Callable[[], Awaitable[None]],
        *,
        due_s: float,
        period_s: float | None = None,
        interleave: bool = False,
    ) -> TimerHandle:
        """Run ``callback`` after ``due_s`` (then every ``period_s``) as a turn of this grain.

        Timers live in memory and die with the activation; use reminders for
        anything that must survive a silo. A tick does not count as use: a grain
        that only its timers keep busy is still collected when idle (as in Orleans).
        """
        return self._rg_context.register_timer(
            callback, due_s=due_s, period_s=period_s, interleave=interleave
        )

    # --- state -------------------------------------------------------------
    @property
    def state(self) -> Any:
        """The grain's state (an instance of its ``State`` model)."""
        return self._rg_context.get_state()

    @state.setter
    def state(self, value: Any) -> None:
        self._rg_context.set_state(value)

    async def write_state(self) -> None:
        """Persist ``self.state``; raises StateConflictError if another activation owns it."""
        await self._rg_context.write_state()

    async def read_state(self) -> None:
        """Reload ``self.state`` from storage."""
        await self._rg_context.read_state()

    async def clear_state(self) -> None:
        """Delete the persisted state and reset ``self.state`` to the model's defaults."""
        await self._rg_context.clear_state()

    def named_state(self, name: str, model: type[M], *, storage: str | None = None) -> PersistentState[M]:
        """A further persisted state of this grain, apart from ``self.state`` (Orleans' named
        ``IPersistentState<T>``): ``handle.value``, ``await handle.write()`` / ``read()`` /
        ``clear()``, fenced like the default state.

        Call it in ``__init__``: the state then loads with ``self.state``, before
        ``on_activate``. A handle first asked for later starts unloaded; ``await handle.read()``
        loads it. The same name gives the same handle for the whole activation. ``storage``
        names the storage provider (default: the class's ``@storage``, else the silo's default).
        Checkpoints (``grains.checkpoints.snapshots``) hold ``self.state`` only.
        """
        if not _STATE_NAME.match(name):
            raise ValueError(f"a state name must match [A-Za-z0-9_.-]{{1,64}}: {name!r}")
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"named_state wants a pydantic model class, not {model!r}")
        return self._rg_context.named_state(name, model, storage)

    # --- reminders ---------------------------------------------------------
    async def register_reminder(self, name: str, period_s: float, due_s: float | None = None) -> None:
        """A durable reminder: ``receive_reminder(name)`` every ``period_s``, on any silo."""
        await self._rg_context.register_reminder(name, period_s, due_s)

    async def unregister_reminder(self, name: str) -> None:
        await self._rg_context.unregister_reminder(name)

    async def receive_reminder(self, name: str) -> None:
        """Override to act on reminders (runs as a turn; activates the grain if needed)."""


def grain_context(grain: Grain) -> GrainContext:
    """The runtime side of ``grain``'s activation, for a facility that acts for it.

    What a silo offers beyond the programming model (checkpoints of grain groups:
    ``grains.checkpoints.snapshots``; a workload's shared store and progress record:
    ``grains.workload.workload``) is reached through the grain that uses it, not held by
    the class a user subclasses. A grain not activated by a runtime has no context
    (AttributeError, as for ``self.state``).
    """
    return grain._rg_context
