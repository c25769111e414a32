"""The runtime side of ``grains.context.GrainContext``: one per activation.

A grain talks to its silo only through this object (bound as
``grain._rg_context`` when the catalog creates the activation), so the
programming model imports nothing of the runtime and workloads use only the
public grain API (``Grain`` and the facilities that act for a grain:
``grains.checkpoints``, ``grains.workload``). It forwards to the activation
(turns, tasks, timers, state) and to the silo's runtime services (calls,
threads, reminders, checkpoints, the Redis the silo publishes through).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from grains.context import DeactivationReason, TimerHandle
from grains.ids import GrainId, SiloAddress
from grains.observer import ObserverRef
from grains.streams import Stream
from silo import errors
from silo.records.progress import forget_progress, publish_progress

if TYPE_CHECKING:
    from silo.storage.checkpoint import SnapshotInfo

R = TypeVar("R")


class ActivationContext:
    """Implements ``GrainContext`` for one activation (see grains/context.py)."""

    __slots__ = ("_act", "_runtime")

    def __init__(self, activation: Any) -> None:
        self._act = activation
        self._runtime = activation.runtime

    @property
    def grain_id(self) -> GrainId:
        return self._act.grain_id  # type: ignore[no-any-return]

    @property
    def activation_id(self) -> str:
        return self._act.activation_id  # type: ignore[no-any-return]

    @property
    def silo(self) -> SiloAddress:
        return self._act.silo  # type: ignore[no-any-return]

    @property
    def device(self) -> str:
        return self._runtime.device  # type: ignore[no-any-return]

    # --- calls, threads, tasks, timers ------------------------------------------
    def get_grain(self, grain: Any, key: Any) -> Any:
        return self._runtime.get_grain(grain, key, self._act)

    def cluster_members(self, type_name: str | None = None) -> list[Any]:
        return self._runtime.cluster_members(type_name)  # type: ignore[no-any-return]

    async def refresh_cluster_members(self) -> None:
        await self._runtime.refresh_cluster_members()

    async def run_in_thread(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        return await self._runtime.run_in_thread(fn, *args, **kwargs)  # type: ignore[no-any-return]

    def start_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        return self._act.start_task(coro, name=name)  # type: ignore[no-any-return]

    def register_timer(
        self,
        callback: Callable[[], Awaitable[None]],
        *,
        due_s: float,
        period_s: float | None,
        interleave: bool,
    ) -> TimerHandle:
        return self._act.register_timer(  # type: ignore[no-any-return]
            callback, due_s=due_s, period_s=period_s, interleave=interleave
        )

    def observer(self, handler: object) -> ObserverRef:
        return self._runtime.observer(self._act, handler)  # type: ignore[no-any-return]

    def request_deactivation(self, reason: DeactivationReason) -> None:
        self._act.request_deactivation(reason)

    # --- streams ------------------------------------------------------------------------
    def stream(self, namespace: str, key: Any) -> Stream:
        return self._runtime.stream(namespace, key)  # type: ignore[no-any-return]

    # --- state ------------------------------------------------------------------------
    def get_state(self) -> Any:
        return self._act.state_handle().value

    def set_state(self, value: Any) -> None:
        self._act.state_handle().value = value

    async def write_state(self) -> None:
        await self._act.state_handle().write()

    async def read_state(self) -> None:
        await self._act.state_handle().read()

    async def clear_state(self) -> None:
        await self._act.state_handle().clear()

    def named_state(self, name: str, model: type[Any], storage: str | None) -> Any:
        return self._act.named_state(name, model, storage)

    # --- reminders --------------------------------------------------------------------
    async def register_reminder(self, name: str, period_s: float, due_s: float | None) -> None:
        await self._runtime.reminders().register(self.grain_id, name, period_s, due_s)

    async def unregister_reminder(self, name: str) -> None:
        await self._runtime.reminders().unregister(self.grain_id, name)

    # --- checkpoints of grain groups -----------------------------------------------------
    async def save_snapshot(
        self, group: str, snapshot_id: int | str, members: Iterable[Any] | None, *, keep: int | None, epoch: int | None = None
    ) -> bool:
        return bool(
            await self._runtime.checkpoints().save(
                group,
                snapshot_id,
                self.grain_id,
                self._act.state_handle().encode(),
                members=[self.grain_id] if members is None else members,
                token=self._act.token,
                keep=keep,
                epoch=epoch,
            )
        )

    async def load_snapshot(self, group: str, snapshot_id: int | str | None, *, write: bool) -> str:
        stored, snap = await self._runtime.checkpoints().load(group, snapshot_id, self.grain_id)
        handle = self._act.state_handle()
        handle.adopt(handle.decode(stored))
        if write:
            await handle.write()
        return str(snap)

    async def read_snapshot_member(self, group: str, snapshot_id: int | str, member: str) -> Any:
        try:
            member_id = GrainId.parse(member)
        except ValueError as exc:
            raise errors.ConfigError(f"snapshot member {member!r} is not a grain id: {exc}") from exc
        stored, _ = await self._runtime.checkpoints().load(group, snapshot_id, member_id)
        return self._act.state_handle().decode(stored)

    async def snapshot_info(self, group: str, snapshot_id: int | str) -> SnapshotInfo | None:
        return await self._runtime.checkpoints().info(group, snapshot_id)  # type: ignore[no-any-return]

    async def latest_snapshot(self, group: str) -> SnapshotInfo | None:
        return await self._runtime.checkpoints().latest_complete(group)  # type: ignore[no-any-return]

    async def list_snapshots(self, group: str, *, pending: bool) -> list[SnapshotInfo]:
        return await self._runtime.checkpoints().list(group, pending=pending)  # type: ignore[no-any-return]

    async def delete_snapshot(self, group: str, snapshot_id: int | str) -> bool:
        return bool(await self._runtime.checkpoints().delete(group, snapshot_id))

    async def checkpoint_groups(self) -> list[str]:
        return list(await self._runtime.checkpoints().groups())

    # --- a shared store for workloads that need one -------------------------------------
    def redis_client(self) -> Any | None:
        return getattr(self._runtime, "redis", None)

    def rendezvous_prefix(self, name: str, generation: int) -> str:
        keys = getattr(self._runtime, "keys", None)
        if keys is None:
            return f"rdzv:{name}:{generation}:"
        return keys.rendezvous(name, generation)  # type: ignore[no-any-return]

    # --- progress ---------------------------------------------------------------------------
    async def publish_progress(
        self, job: str, record: str, point: Mapping[str, str] | Sequence[Mapping[str, str]] | None, *, restart: bool = False
    ) -> bool:
        redis, keys = getattr(self._runtime, "redis", None), getattr(self._runtime, "keys", None)
        if redis is None or keys is None:  # a runtime without Redis (unit tests): nobody reads it
            return False
        return await publish_progress(redis, keys, job, record, point, restart=restart)

    async def forget_progress(self, job: str) -> None:
        redis, keys = getattr(self._runtime, "redis", None), getattr(self._runtime, "keys", None)
        if redis is not None and keys is not None:
            await forget_progress(redis, keys, job)
