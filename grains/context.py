"""What a grain asks of the runtime that hosts it: the ``GrainContext`` protocol.

The programming model knows no runtime module. A :class:`~grains.base.Grain`
reaches its silo only through the context the runtime binds to it when it
activates the grain (``silo/catalog/context.py`` implements it; a test may
bind its own). Everything on this protocol is public and typed, so workloads
(training, serving) build on the same facilities any user grain has.

``Grain`` forwards the programming model: identity, calls, observers, threads,
background tasks, timers, streams, state and reminders. The rest is reached
through facilities that take a grain and use its context
(``grains.base.grain_context``), so the class a user subclasses does not hold
them: checkpoints of grain groups (``grains.checkpoints.snapshots``) and a
workload's shared store and progress record (``grains.workload.workload``).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from grains.ids import GrainId, SiloAddress
from grains.observer import ObserverRef
from grains.streams import Stream

R = TypeVar("R")
M = TypeVar("M", bound=BaseModel)


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
    INCOMPATIBLE_VERSION = "incompatible_version"
    """A call needed a method this activation's ``@version`` lacks: it is re-placed on a silo
    hosting a version that has it (a rolling upgrade)."""


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class PersistentState(Protocol[M]):
    """One named state of a grain (``Grain.named_state``), fenced like ``self.state``."""

    @property
    def name(self) -> str: ...

    @property
    def value(self) -> M:
        """The state (an instance of its model); a state not loaded yet raises StorageError."""
        ...

    @value.setter
    def value(self, value: M) -> None: ...

    @property
    def state(self) -> M:
        """The same as ``value`` (Orleans' ``IPersistentState<T>.State``)."""
        ...

    @state.setter
    def state(self, value: M) -> None: ...

    @property
    def etag(self) -> str | None:
        """The etag of what was last read or written; None: nothing stored."""
        ...

    @property
    def loaded(self) -> bool:
        """Read from storage at least once (at activation, or by ``read``)."""
        ...

    async def write(self) -> None:
        """Persist ``value``; StateConflictError if another activation owns the grain."""
        ...

    async def read(self) -> None:
        """Reload ``value`` from storage."""
        ...

    async def clear(self) -> None:
        """Delete the stored value and reset ``value`` to the model's defaults."""
        ...


class SnapshotInfo(Protocol):
    """What the manifest of one snapshot of a grain group says."""

    @property
    def group(self) -> str: ...

    @property
    def snapshot_id(self) -> str: ...

    @property
    def members(self) -> list[str]:
        """Grain ids (``Type/key``) that make up the snapshot."""
        ...

    @property
    def complete(self) -> bool:
        """Every member has saved its part: the snapshot may be restored."""
        ...


class GrainContext(Protocol):
    """The runtime side of one activation, as its grain sees it."""

    @property
    def grain_id(self) -> GrainId: ...

    @property
    def activation_id(self) -> str: ...

    @property
    def silo(self) -> SiloAddress: ...

    @property
    def device(self) -> str: ...

    # --- calls, threads, tasks, timers ------------------------------------------
    def get_grain(self, grain: Any, key: Any) -> Any: ...

    def cluster_members(self, type_name: str | None = None) -> list[Any]: ...

    async def refresh_cluster_members(self) -> None: ...

    async def run_in_thread(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R: ...

    def start_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]: ...

    def register_timer(
        self,
        callback: Callable[[], Awaitable[None]],
        *,
        due_s: float,
        period_s: float | None,
        interleave: bool,
    ) -> TimerHandle: ...

    def request_deactivation(self, reason: DeactivationReason) -> None: ...

    def observer(self, handler: object) -> ObserverRef:
        """A reference to ``handler`` that other grains and clients can call, for as long as
        this activation lives (grains/observer.py)."""
        ...
    # --- streams ------------------------------------------------------------------------
    def stream(self, namespace: str, key: Any) -> Stream: ...

    # --- state ------------------------------------------------------------------------
    def get_state(self) -> Any: ...

    def set_state(self, value: Any) -> None: ...

    async def write_state(self) -> None: ...

    async def read_state(self) -> None: ...

    async def clear_state(self) -> None: ...

    def named_state(self, name: str, model: type[M], storage: str | None) -> PersistentState[M]: ...

    # --- reminders --------------------------------------------------------------------
    async def register_reminder(self, name: str, period_s: float, due_s: float | None) -> None: ...

    async def unregister_reminder(self, name: str) -> None: ...

    # --- checkpoints of grain groups (grains/checkpoints.py) -----------------------------
    async def save_snapshot(
        self, group: str, snapshot_id: int | str, members: Iterable[Any] | None, *, keep: int | None, epoch: int | None = None
    ) -> bool: ...

    async def load_snapshot(self, group: str, snapshot_id: int | str | None, *, write: bool) -> str: ...

    async def read_snapshot_member(self, group: str, snapshot_id: int | str, member: str) -> Any: ...

    async def snapshot_info(self, group: str, snapshot_id: int | str) -> SnapshotInfo | None: ...

    async def latest_snapshot(self, group: str) -> SnapshotInfo | None: ...

    async def list_snapshots(self, group: str, *, pending: bool) -> Sequence[SnapshotInfo]: ...

    async def delete_snapshot(self, group: str, snapshot_id: int | str) -> bool: ...

    async def checkpoint_groups(self) -> list[str]: ...

    # --- a shared store for workloads that need one (grains/workload.py) ----------------
    def redis_client(self) -> Any | None: ...

    def rendezvous_prefix(self, name: str, generation: int) -> str: ...

    # --- progress (grains/workload.py) ------------------------------------------------------
    async def publish_progress(
        self, job: str, record: str, point: Mapping[str, str] | Sequence[Mapping[str, str]] | None, *, restart: bool = False
    ) -> bool: ...

    async def forget_progress(self, job: str) -> None: ...
