"""Activations on this silo: create, schedule turns, collect when idle, deactivate.

Each activation has a mailbox. Calls run one at a time in arrival order
(a *turn*), unless the class is ``@reentrant``, the method ``@interleave``, or
consecutive calls are all ``@read_only``. When an activation goes away every
call still queued is handed back for re-routing, so none is dropped and none
hangs (pykka's actor teardown, Orleans' Catalog).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import traceback
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from grains.base import DeactivationReason, Grain
from grains.ids import GrainId, SiloAddress
from grains.placement import GrainOptions
from silo import errors
from silo.catalog.context import ActivationContext
from silo.settings import CatalogSettings

if TYPE_CHECKING:
    from silo.catalog.grain_types import GrainTypes
    from silo.catalog.state import StateHandle
    from silo.cluster.directory import GrainDirectory

log = logging.getLogger("redgrain.catalog")

CALL_CHAIN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("redgrain_call_chain", default=())
"""Grain ids of the call chain the current task runs in (for deadlock detection)."""


class Runtime(Protocol):
    """Silo services an activation (and its grain) may use."""

    device: str

    def get_grain(self, grain: Any, key: Any) -> Any: ...

    async def run_in_thread(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...

    def reminders(self) -> Any: ...

    def checkpoints(self) -> Any: ...

    def cluster_members(self, type_name: str | None = None) -> list[Any]: ...

    def state_handle(self, activation: Activation) -> StateHandle: ...


class Reroute(Exception):
    """Internal: the call never started here; send it wherever the grain lives now."""


class Reply:
    """A one-shot answer slot that hands the outcome straight to ``callback``.

    An asyncio Future runs its done-callbacks on a later loop iteration; a call
    that came over the network needs no awaiting coroutine, only its answer
    sent, so this saves a scheduling hop per call. It offers the part of the
    Future API the catalog uses (done, set_result, set_exception, cancelled).
    """

    __slots__ = ("_callback", "_done")

    def __init__(self, callback: Callable[[Any, BaseException | None], None]) -> None:
        self._callback = callback
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, result: Any) -> None:
        if self._done:
            raise asyncio.InvalidStateError("reply already set")
        self._done = True
        self._callback(result, None)

    def set_exception(self, exc: BaseException) -> None:
        if self._done:
            raise asyncio.InvalidStateError("reply already set")
        self._done = True
        self._callback(None, exc)


@dataclass(slots=True, eq=False)
class Invocation:
    """One call waiting for, or running in, a turn."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] | None
    chain: tuple[str, ...]
    deadline: float
    future: asyncio.Future[Any] | Reply
    callback: Callable[[], Awaitable[Any]] | None = None
    interleave: bool = False
    read_only: bool = False
    task: asyncio.Task[Any] | None = None
    cancelled: bool = False
    activation: Activation | None = None


@dataclass(frozen=True, slots=True)
class CallContext:
    """What call filters see of an incoming call."""

    grain_id: GrainId
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] | None
    chain: tuple[str, ...]
    activation: Activation


CallNext = Callable[[CallContext], Awaitable[Any]]
CallFilter = Callable[[CallContext, CallNext], Awaitable[Any]]


class Timer:
    """An in-memory timer of one activation. ``cancel()`` stops it."""

    def __init__(
        self,
        activation: Activation,
        callback: Callable[[], Awaitable[None]],
        due_s: float,
        period_s: float | None,
        interleave: bool,
    ) -> None:
        self._activation = activation
        self._callback = callback
        self._period_s = period_s
        self._interleave = interleave
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            max(0.0, due_s), self._fire
        )
        self.ticks = 0

    def _fire(self) -> None:
        self._handle = None
        act = self._activation
        if act.status != "active":
            return
        self.ticks += 1
        done = act.enqueue_internal(self._callback, interleave=self._interleave)
        if self._period_s is not None:
            done.add_done_callback(self._rearm)

    def _rearm(self, _: asyncio.Future[Any]) -> None:
        if self._period_s is not None and self._activation.status == "active" and self in self._activation.timers:
            self._handle = asyncio.get_running_loop().call_later(self._period_s, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._period_s = None
        self._activation.timers.discard(self)


class Activation:
    """One live grain instance and its mailbox."""

    def __init__(
        self,
        grain_id: GrainId,
        cls: type[Grain],
        options: GrainOptions,
        silo: SiloAddress,
        runtime: Runtime,
        catalog: Catalog,
    ) -> None:
        self.grain_id = grain_id
        self.grain_key = str(grain_id)
        self.cls = cls
        self.options = options
        self.silo = silo
        self.runtime = runtime
        self.activation_id = uuid.uuid4().hex
        self.token = 0
        """Fencing token the directory handed this activation."""
        self.status = "activating"
        self.timers: set[Timer] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.instance: Grain = cls.__new__(cls)
        self.instance._rg_context = ActivationContext(self)
        self._catalog = catalog
        self._queue: deque[Invocation] = deque()
        self._running: set[Invocation] = set()
        self._pump: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._deactivate_reason: DeactivationReason | None = None
        self._state: StateHandle | None = None
        self.last_used = catalog.clock()
        self.calls = 0
        self.deactivated = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Activation {self.grain_key} {self.status}>"

    # --- state -------------------------------------------------------------
    def state_handle(self) -> StateHandle:
        if self._state is None:
            self._state = self.runtime.state_handle(self)
        return self._state

    # --- mailbox -----------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._running)

    def enqueue(self, inv: Invocation) -> None:
        if self.status not in ("active", "activating"):
            inv.future.set_exception(Reroute())
            return
        if len(self._queue) >= self._catalog.settings.max_queue:
            inv.future.set_exception(
                errors.OverloadedError(f"mailbox of {self.grain_key}", self._catalog.settings.max_queue)
            )
            return
        self.last_used = self._catalog.clock()
        if self.grain_key in inv.chain and not (self.options.reentrant or inv.interleave):
            inv.future.set_exception(errors.DeadlockError(self.grain_key, list(inv.chain)))
            return
        self._idle.clear()
        if self.options.reentrant or inv.interleave:
            self._start(inv)
            return
        self._queue.append(inv)
        if self._pump is None and self.status == "active":
            self._pump = asyncio.get_running_loop().create_task(self._drain_mailbox())

    def enqueue_internal(
        self, callback: Callable[[], Awaitable[Any]], *, interleave: bool = False
    ) -> asyncio.Future[Any]:
        """Queue a timer or reminder callback as a turn of this activation."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        inv = Invocation(
            method=getattr(callback, "__name__", "timer"),
            args=(),
            kwargs=None,
            chain=(),
            deadline=float("inf"),
            future=fut,
            callback=callback,
            interleave=interleave,
        )
        self.enqueue(inv)
        fut.add_done_callback(_consume_exception)
        return fut

    def _start(self, inv: Invocation) -> None:
        self._running.add(inv)
        inv.task = asyncio.get_running_loop().create_task(self._turn(inv))

    async def _drain_mailbox(self) -> None:
        try:
            while self._queue and self.status in ("active", "deactivating"):
                inv = self._queue.popleft()
                if inv.read_only:
                    batch = [inv]
                    while self._queue and self._queue[0].read_only:
                        batch.append(self._queue.popleft())
                    for b in batch:
                        self._start(b)
                    await asyncio.gather(*(b.task for b in batch if b.task), return_exceptions=True)
                else:
                    self._running.add(inv)
                    await self._turn(inv)
        finally:
            self._pump = None
            self._check_idle()

    def _check_idle(self) -> None:
        if not self._queue and not self._running:
            self._idle.set()

    async def _turn(self, inv: Invocation) -> None:
        loop = asyncio.get_running_loop()
        try:
            if inv.cancelled or inv.future.done():
                return
            if loop.time() > inv.deadline:
                inv.future.set_exception(errors.GrainTimeoutError(self.grain_key, inv.method, 0.0))
                return
            inv.task = inv.task or asyncio.current_task()
            self.calls += 1
            chain_token = CALL_CHAIN.set((*inv.chain, self.grain_key))
            try:
                if inv.callback is not None:
                    result = await inv.callback()
                else:
                    ctx = CallContext(self.grain_id, inv.method, inv.args, inv.kwargs, inv.chain, self)
                    result = await self._catalog.pipeline(ctx)
            except asyncio.CancelledError:
                if not inv.cancelled:
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                if not inv.future.done():
                    inv.future.set_exception(errors.GrainTimeoutError(self.grain_key, inv.method, 0.0))
                return
            except BaseException as exc:
                if isinstance(exc, errors.StateConflictError):
                    self.request_deactivation(DeactivationReason.STATE_CONFLICT)
                elif self.options.deactivate_on and isinstance(exc, self.options.deactivate_on):
                    self.request_deactivation(DeactivationReason.ERROR)
                if not inv.future.done():
                    inv.future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            finally:
                CALL_CHAIN.reset(chain_token)
            if not inv.future.done():
                inv.future.set_result(result)
        finally:
            self._running.discard(inv)
            self.last_used = self._catalog.clock()
            if self._deactivate_reason is not None and not self._running:
                self._catalog.schedule_deactivation(self, self._deactivate_reason)
            self._check_idle()

    def cancel_call(self, inv: Invocation) -> None:
        """The caller gave up: drop the call if queued, cancel it if running."""
        inv.cancelled = True
        try:
            self._queue.remove(inv)
        except ValueError:
            pass
        if inv.task is not None and inv in self._running:
            inv.task.cancel()
        if not inv.future.done():
            inv.future.set_exception(errors.GrainTimeoutError(self.grain_key, inv.method, 0.0))

    def request_deactivation(self, reason: DeactivationReason) -> None:
        if self._deactivate_reason is None:
            self._deactivate_reason = reason
        if not self._running:
            self._catalog.schedule_deactivation(self, reason)

    def start_task(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        if self.status not in ("active", "activating"):
            coro.close()
            raise errors.GrainDeactivatedError(self.grain_key, "cannot start a task on an inactive activation")
        task = asyncio.get_running_loop().create_task(coro, name=name or f"{self.grain_key} task")
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: background task %s failed", self.grain_key, task.get_name(), exc_info=task.exception())

    async def cancel_tasks(self) -> None:
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def register_timer(
        self,
        callback: Callable[[], Awaitable[None]],
        *,
        due_s: float,
        period_s: float | None,
        interleave: bool,
    ) -> Timer:
        timer = Timer(self, callback, due_s, period_s, interleave)
        self.timers.add(timer)
        return timer

    # --- lifecycle, driven by the catalog ---------------------------------
    def begin_serving(self) -> None:
        self.status = "active"
        if self._queue and self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._drain_mailbox())

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def take_queued(self) -> list[Invocation]:
        queued = list(self._queue)
        self._queue.clear()
        return queued


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("timer callback failed: %r", fut.exception())


@dataclass(frozen=True, slots=True)
class CatalogStatistics:
    activations: int
    """Activations currently live on this silo."""
    by_type: dict[str, int]
    """Live activations per grain type."""
    activated_total: int
    """Activations created since start."""
    deactivated_total: int
    """Activations that went away since start."""
    queued_calls: int
    """Calls waiting in mailboxes right now."""
    failed_activations: int = 0
    """Activations whose on_activate or state load raised."""
    by_type_keys: dict[str, list[str]] = field(default_factory=dict)
    """A sample of live keys per type (at most 50 each), for the dashboard."""


class Catalog:
    """The activations of one silo."""

    def __init__(
        self,
        *,
        settings: CatalogSettings,
        silo: SiloAddress,
        types: GrainTypes,
        directory: GrainDirectory,
        runtime: Runtime,
        filters: list[CallFilter] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.silo = silo
        self.clock = clock
        self._types = types
        self._directory = directory
        self._runtime = runtime
        self._activations: dict[GrainId, Activation] = {}
        self._workers: dict[GrainId, list[Activation]] = {}
        self._activating: dict[GrainId, asyncio.Future[Activation | SiloAddress]] = {}
        self._deactivating: dict[Activation, asyncio.Task[None]] = {}
        self._collector: asyncio.Task[None] | None = None
        self._activated_total = 0
        self._deactivated_total = 0
        self._failed = 0
        self.closed = False
        self.on_reroute: Callable[[Activation, list[Invocation]], None] = lambda a, i: None
        self.pipeline: CallNext = _build_pipeline(filters or [], self._invoke_method)

    # --- lookups -----------------------------------------------------------
    def get(self, grain_id: GrainId) -> Activation | None:
        act = self._activations.get(grain_id)
        if act is not None and act.status in ("active", "activating"):
            return act
        return None

    def activations(self) -> list[Activation]:
        return [*self._activations.values(), *(a for ws in self._workers.values() for a in ws)]

    def __len__(self) -> int:
        return len(self._activations) + sum(len(w) for w in self._workers.values())

    # --- activation --------------------------------------------------------
    async def get_or_activate(self, grain_id: GrainId) -> Activation | SiloAddress:
        """The local activation, creating it if needed; or the silo that won the directory."""
        if self.closed:
            raise errors.SiloClosedError("silo")
        act = self.get(grain_id)
        if act is not None:
            return act
        leaving = self._activations.get(grain_id)
        if leaving is not None:
            await leaving.deactivated.wait()
        pending = self._activating.get(grain_id)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Activation | SiloAddress] = asyncio.get_running_loop().create_future()
        self._activating[grain_id] = fut
        try:
            result = await self._activate(grain_id)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        else:
            fut.set_result(result)
            return result
        finally:
            self._activating.pop(grain_id, None)

    def stateless_worker(self, grain_id: GrainId, options: GrainOptions) -> Activation | None:
        """Pick the least busy local worker, or None when a new one should be made."""
        pool = [a for a in self._workers.get(grain_id, []) if a.status == "active"]
        idle = [a for a in pool if not a.busy]
        if idle:
            return idle[0]
        if len(pool) >= options.stateless_worker:
            return min(pool, key=lambda a: a.queue_length)
        return None

    async def activate_worker(self, grain_id: GrainId) -> Activation:
        cls = self._types.resolve(grain_id.type_name)
        options = self._types.options(grain_id.type_name)
        act = Activation(grain_id, cls, options, self.silo, self._runtime, self)
        self._workers.setdefault(grain_id, []).append(act)
        await self._run_activation_hooks(act)
        return act

    async def _activate(self, grain_id: GrainId) -> Activation | SiloAddress:
        cls = self._types.resolve(grain_id.type_name)
        options = self._types.options(grain_id.type_name)
        act = Activation(grain_id, cls, options, self.silo, self._runtime, self)
        winner = await self._directory.register(grain_id, self.silo, act.activation_id)
        if winner.silo != self.silo or winner.activation_id != act.activation_id:
            # Another activation owns the grain; if it is one of ours the entry
            # is stale (we lost it) and we must not serve under it.
            if winner.silo == self.silo and grain_id not in self._activations:
                await self._directory.unregister(grain_id, winner.silo, winner.activation_id)
                return await self._activate(grain_id)
            return winner.silo
        act.token = winner.token
        self._activations[grain_id] = act
        try:
            await self._run_activation_hooks(act)
        except BaseException:
            self._activations.pop(grain_id, None)
            await self._directory.unregister(grain_id, self.silo, act.activation_id)
            raise
        return act

    async def _run_activation_hooks(self, act: Activation) -> None:
        try:
            # Bound before __init__ runs, so a grain's __init__ may read self.key.
            type(act.instance).__init__(act.instance)
            if act.cls.State is not None:
                await act.state_handle().load()
            await act.instance.on_activate()
        except BaseException:
            self._failed += 1
            act.status = "inactive"
            for inv in act.take_queued():
                inv.future.set_exception(Reroute())
            raise
        self._activated_total += 1
        act.begin_serving()

    # --- deactivation ------------------------------------------------------
    def schedule_deactivation(self, act: Activation, reason: DeactivationReason) -> None:
        if act in self._deactivating or act.status in ("deactivating", "inactive"):
            return
        task = asyncio.get_running_loop().create_task(self.deactivate(act, reason))
        self._deactivating[act] = task
        task.add_done_callback(lambda _: self._deactivating.pop(act, None))

    async def deactivate(self, act: Activation, reason: DeactivationReason) -> None:
        """Stop taking calls, finish the running turn, hand queued calls back, unregister."""
        if act.status in ("deactivating", "inactive"):
            return
        act.status = "deactivating"
        for timer in list(act.timers):
            timer.cancel()
        queued = act.take_queued()
        await act.cancel_tasks()
        timeout = self.settings.deactivation_timeout_s
        if not await act.wait_idle(timeout):
            log.warning("%s: turns still running after %.1fs; deactivating anyway", act.grain_key, timeout)
        try:
            await asyncio.wait_for(act.instance.on_deactivate(reason), timeout)
        except Exception:
            log.exception("%s: on_deactivate failed", act.grain_key)
        if act._state is not None and reason is not DeactivationReason.STATE_CONFLICT:
            try:
                await act._state.flush()
            except Exception:
                log.exception("%s: flushing write-behind state failed", act.grain_key)
        act.status = "inactive"
        queued.extend(act.take_queued())  # calls that arrived while on_deactivate ran
        if act.options.stateless_worker:
            pool = self._workers.get(act.grain_id, [])
            if act in pool:
                pool.remove(act)
            if not pool:
                self._workers.pop(act.grain_id, None)
        else:
            if self._activations.get(act.grain_id) is act:
                del self._activations[act.grain_id]
            try:
                await self._directory.unregister(act.grain_id, self.silo, act.activation_id)
            except Exception:
                log.exception("%s: directory unregister failed", act.grain_key)
        self._deactivated_total += 1
        act.deactivated.set()
        if queued:
            self.on_reroute(act, queued)

    async def deactivate_all(self, reason: DeactivationReason) -> None:
        acts = self.activations()
        await asyncio.gather(*(self.deactivate(a, reason) for a in acts), return_exceptions=True)
        if self._deactivating:
            await asyncio.gather(*list(self._deactivating.values()), return_exceptions=True)

    def drop_all_nowait(self) -> None:
        """We were declared dead: stop serving at once, without touching Redis."""
        self.closed = True
        for act in self.activations():
            act.status = "inactive"
            for timer in list(act.timers):
                timer.cancel()
            for inv in act.take_queued():
                if not inv.future.done():
                    inv.future.set_exception(errors.SiloUnavailableError(str(self.silo), "silo declared dead"))
            for inv in list(act._running):
                if inv.task is not None:
                    inv.task.cancel()
            for task in list(act.tasks):
                task.cancel()
        self._activations.clear()
        self._workers.clear()

    # --- idle collection ---------------------------------------------------
    def start(self) -> None:
        self._collector = asyncio.get_running_loop().create_task(self._collect_forever())

    async def stop(self) -> None:
        self.closed = True
        if self._collector is not None:
            self._collector.cancel()
            await asyncio.gather(self._collector, return_exceptions=True)

    async def _collect_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.collection_interval_s)
            try:
                self.collect_idle()
            except Exception:
                log.exception("idle collection failed")

    def collect_idle(self) -> int:
        """Deactivate activations idle past their timeout; returns how many were scheduled."""
        now = self.clock()
        n = 0
        for act in self.activations():
            if act.options.keep_alive or act.busy or act.status != "active":
                continue
            limit = act.options.idle_timeout_s or self.settings.idle_timeout_s
            if now - act.last_used >= limit:
                self.schedule_deactivation(act, DeactivationReason.IDLE)
                n += 1
        return n

    # --- calls -------------------------------------------------------------
    def _invoke_method(self, ctx: CallContext) -> Awaitable[Any]:
        # Returns the method's own coroutine: one frame fewer per call than awaiting it here.
        fn = getattr(ctx.activation.instance, ctx.method)
        if ctx.kwargs:
            return fn(*ctx.args, **ctx.kwargs)  # type: ignore[no-any-return]
        return fn(*ctx.args)  # type: ignore[no-any-return]

    def running_turns(self) -> list[str]:
        """``type/key.method`` of every turn in progress (for the loop watchdog)."""
        return [
            f"{act.grain_key}.{inv.method}" for act in self.activations() for inv in list(act._running)
        ]

    def statistics(self) -> CatalogStatistics:
        by_type: dict[str, int] = {}
        keys: dict[str, list[str]] = {}
        queued = 0
        for act in self.activations():
            t = act.grain_id.type_name
            by_type[t] = by_type.get(t, 0) + 1
            sample = keys.setdefault(t, [])
            if len(sample) < 50:
                sample.append(act.grain_id.key)
            queued += act.queue_length
        return CatalogStatistics(
            activations=len(self),
            by_type=by_type,
            activated_total=self._activated_total,
            deactivated_total=self._deactivated_total,
            queued_calls=queued,
            failed_activations=self._failed,
            by_type_keys=keys,
        )


def _build_pipeline(filters: list[CallFilter], final: CallNext) -> CallNext:
    """Wrap the filters around the final invoker once (Starlette's middleware stack)."""
    call = final
    for flt in reversed(filters):
        call = _wrap(flt, call)
    return call


def _wrap(flt: CallFilter, nxt: CallNext) -> CallNext:
    # A plain function returning the filter's coroutine: no coroutine frame of its own per call.
    def run(ctx: CallContext) -> Awaitable[Any]:
        return flt(ctx, nxt)

    return run


def format_remote_traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
