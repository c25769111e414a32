"""One activation: a live grain instance, its mailbox and the turns it runs.

Calls run one at a time in arrival order (a *turn*), unless the class is
``@reentrant``, the method ``@interleave``, or consecutive calls are all
``@read_only`` (those run together). The mailbox is a deque drained by one
pump task per busy activation; an interleaved or reentrant call starts a task
of its own at once (once the activation is ACTIVE). The mailbox holds
``max_queue`` calls: past that a two-way call is shed unrun
(``LoadShedError``, which its caller's router retries with back-off until its
deadline), while a ``@one_way`` call, whose caller has moved on, waits behind
the mailbox in arrival order and moves in as it drains (its deadline still
applies: one that expires there fails, logged and counted on this silo); past
another ``max_queue`` of those, a one-way call is shed too (logged, counted). Each turn sets ``CALL_CHAIN`` to the chain it runs in, so
a call that would wait on an activation already in its own chain fails with
``DeadlockError`` instead of hanging.

An activation moves through :class:`~silo.catalog.activation_state.ActivationState`
one way: ACTIVATING (directory registration, state loading, ``on_activate``;
calls queue in arrival order, the one that started it first, but none runs),
ACTIVE, DEACTIVATING (the running turn finishes, queued calls are handed back
to the catalog for re-routing) and INACTIVE. The catalog drives the moves; the
activation only refuses work that its state no longer allows. It knows its
catalog only as an :class:`ActivationHost`, what it needs of it, so this
module and catalog.py do not import each other, not even for types.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from grains import request_context
from grains.base import DeactivationReason, Grain
from grains.call import CALL_CHAIN
from grains.ids import GrainId, SiloAddress
from grains.placement import GrainOptions
from silo import errors
from silo.catalog.activation_state import ActivationState
from silo.catalog.context import ActivationContext
from silo.catalog.invocation import Invocation, Reroute
from silo.catalog.pipeline import CallContext, CallNext
from silo.catalog.state import NamedState
from silo.catalog.timer import Timer
from silo.loop import running_loop

if TYPE_CHECKING:
    from silo.catalog.state import StateHandle
    from silo.settings import CatalogSettings

log = logging.getLogger("redgrain.catalog")


# An enum attribute lookup costs ~75 ns on Python 3.11, a module global ~10: the
# checks made on every call compare against these.
_ACTIVE = ActivationState.ACTIVE
_TAKES_CALLS = (ActivationState.ACTIVE, ActivationState.ACTIVATING)
_RUNS_TURNS = (ActivationState.ACTIVE, ActivationState.DEACTIVATING)


class Runtime(Protocol):
    """Silo services an activation (and its grain) may use."""

    device: str

    def get_grain(self, grain: Any, key: Any, source: Activation | None = None) -> Any: ...

    async def run_in_thread(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...

    def reminders(self) -> Any: ...

    def checkpoints(self) -> Any: ...

    def cluster_members(self, type_name: str | None = None) -> list[Any]: ...

    async def refresh_cluster_members(self) -> None: ...

    def state_handle(self, activation: Activation) -> StateHandle: ...

    def named_state_handle(
        self, activation: Activation, name: str, model: type[Any], storage: str | None
    ) -> StateHandle: ...
    def observer(self, activation: Activation, handler: object) -> Any: ...


class ActivationHost(Protocol):
    """What an activation needs of the catalog that owns it: the mailbox's bound
    (``settings.max_queue``), the clock its idle collection reads ``last_used`` by, the
    incoming call chain of its type, and a way to ask to be deactivated. catalog.py's
    ``Catalog`` is the one host; the activation naming that class made the two modules a cycle."""

    @property
    def settings(self) -> CatalogSettings: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    def pipeline_for(self, type_name: str, options: GrainOptions) -> CallNext: ...

    def schedule_deactivation(self, act: Activation, reason: DeactivationReason) -> None: ...


class Activation:
    """One live grain instance and its mailbox."""

    def __init__(
        self,
        grain_id: GrainId,
        cls: type[Grain],
        options: GrainOptions,
        silo: SiloAddress,
        runtime: Runtime,
        catalog: ActivationHost,
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
        self.status = ActivationState.ACTIVATING
        self.timers: set[Timer] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.instance: Grain = cls.__new__(cls)
        self.instance._rg_context = ActivationContext(self)
        self._catalog = catalog
        self._queue: deque[Invocation] = deque()
        self._overflow: deque[Invocation] = deque()
        """One-way calls that came while the mailbox was full (at most ``max_queue``), in arrival
        order, moved into it as it drains: their callers have moved on and cannot retry them as
        a shed two-way call's do."""
        self._running: set[Invocation] = set()
        self._pump: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._deactivate_reason: DeactivationReason | None = None
        self._state: StateHandle | None = None
        self.named: dict[str, NamedState] = {}
        """The named states asked for so far (``Grain.named_state``), by name."""
        self.pipeline = catalog.pipeline_for(grain_id.type_name, options)
        self.last_used = catalog.clock()
        self.calls = 0
        self.deactivated = asyncio.Event()
        # The loop this activation lives on, read once: on Python 3.11 each get_running_loop()
        # (and current_task()) is a getpid() system call, and a call's turn made three of them.
        self._loop = running_loop()

    def __repr__(self) -> str:
        return f"<Activation {self.grain_key} {self.status}>"

    # --- state -------------------------------------------------------------
    def state_handle(self) -> StateHandle:
        if self._state is None:
            self._state = self.runtime.state_handle(self)
        return self._state

    def named_state(self, name: str, model: type[Any], storage: str | None) -> NamedState:
        found = self.named.get(name)
        if found is not None:
            if found.model is not model:
                raise errors.ConfigError(
                    f"{self.grain_key}: state {name!r} was asked for as {found.model.__qualname__},"
                    f" now as {model.__qualname__}"
                )
            return found
        found = self.named[name] = NamedState(self.runtime.named_state_handle(self, name, model, storage))
        return found

    def state_handles(self) -> list[StateHandle]:
        """Every state handle made so far: the default one, then the named ones."""
        handles = [] if self._state is None else [self._state]
        return handles + [n._handle for n in self.named.values()]

    # --- mailbox -----------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return len(self._queue) + len(self._overflow)

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._running or self._overflow)

    def enqueue(self, inv: Invocation) -> None:
        if self.status not in _TAKES_CALLS:
            inv.future.set_exception(Reroute())
            return
        # A full mailbox sheds a two-way call unrun (its caller's router backs off and sends it
        # again until its deadline); a one-way call waits behind it, in arrival order, until
        # its deadline, as nobody is left to send it again: up to max_queue of them, so a flood
        # (or a peer's huge deadlines) cannot hold unbounded memory.
        limit = self._catalog.settings.max_queue
        full = len(self._queue) >= limit
        if full and (inv.method not in self.options.one_way or len(self._overflow) >= limit):
            inv.future.set_exception(errors.LoadShedError(f"mailbox of {self.grain_key}", limit))
            return
        if not inv.internal:
            self.last_used = self._catalog.clock()
        if self.grain_key in inv.chain and not (self.options.reentrant or inv.interleave):
            inv.future.set_exception(errors.DeadlockError(self.grain_key, list(inv.chain)))
            return
        self._idle.clear()
        if (self.options.reentrant or inv.interleave) and self.status is _ACTIVE:
            self._start(inv)
            return
        if full or self._overflow:
            self._overflow.append(inv)
            return
        self._queue.append(inv)
        if self._pump is None and self.status is _ACTIVE:
            self._pump = (self._loop or asyncio.get_running_loop()).create_task(self._drain_mailbox())

    def enqueue_internal(
        self, callback: Callable[[], Awaitable[Any]], *, interleave: bool = False
    ) -> asyncio.Future[Any]:
        """Queue a timer tick (or a write-behind flush) as a turn of this activation.

        It is no use of the activation: as in Orleans, a timer does not keep an otherwise idle
        grain from being collected (a reminder, a call, does)."""
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
            internal=True,
        )
        self.enqueue(inv)
        fut.add_done_callback(_consume_exception)
        return fut

    def _start(self, inv: Invocation) -> None:
        self._running.add(inv)
        inv.task = (self._loop or asyncio.get_running_loop()).create_task(self._turn(inv))

    async def _drain_mailbox(self) -> None:
        try:
            # A turn whose state write failed or was refused ends the serving: calls queued
            # behind it are re-routed to an activation that reloads, never served from memory
            # the store may not hold (simulator, seed 39 "mixed"). deactivate_on_idle() keeps
            # the old rule: what is queued runs first.
            while self._queue and self.status in _RUNS_TURNS and self._deactivate_reason not in _UNTRUSTED:
                inv = self._queue.popleft()
                if self._overflow:
                    self._refill()
                if inv.read_only:
                    batch = [inv]
                    while self._queue and self._queue[0].read_only:
                        batch.append(self._queue.popleft())
                        if self._overflow:
                            self._refill()
                    for b in batch:
                        self._start(b)
                    await asyncio.gather(*(b.task for b in batch if b.task), return_exceptions=True)
                else:
                    self._running.add(inv)
                    await self._turn(inv)
        finally:
            self._pump = None
            self._check_idle()

    def _refill(self) -> None:
        """Move waiting one-way calls into the mailbox while it has room (in their order)."""
        room = self._catalog.settings.max_queue - len(self._queue)
        while self._overflow and room > 0:
            self._queue.append(self._overflow.popleft())
            room -= 1

    def _check_idle(self) -> None:
        if not self._queue and not self._running and not self._overflow:
            self._idle.set()

    async def _turn(self, inv: Invocation) -> None:
        loop = self._loop or asyncio.get_running_loop()
        try:
            if inv.cancelled or inv.future.done():
                return
            if loop.time() > inv.deadline:
                inv.future.set_exception(errors.GrainTimeoutError(self.grain_key, inv.method, 0.0))
                return
            inv.task = inv.task or asyncio.current_task(loop)
            self.calls += 1
            chain_token = CALL_CHAIN.set((*inv.chain, self.grain_key))
            # The caller's entries, or none: never those of whoever created this mailbox task.
            # (Neither has any, most turns: then no Python call.)
            context_token = (
                None if inv.context is None and request_context.current() is None else request_context.enter(inv.context)
            )
            try:
                if inv.callback is not None:
                    result = await inv.callback()
                else:
                    ctx = CallContext(self.grain_id, inv.method, inv.args, inv.kwargs, inv.chain, self)
                    result = await self.pipeline(ctx)
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
                if context_token is not None:
                    request_context.leave(context_token)
            if not inv.future.done():
                inv.future.set_result(result)
        finally:
            self._running.discard(inv)
            if not inv.internal:
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
            try:
                self._overflow.remove(inv)
            except ValueError:
                pass
        else:
            if self._overflow:
                self._refill()
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
        if self.status not in _TAKES_CALLS:
            coro.close()
            raise errors.GrainDeactivatedError(self.grain_key, "cannot start a task on an inactive activation")
        # Outside the starting turn's call chain: the task outlives the turn, so a call
        # it makes back into this grain is an ordinary call, not a cycle (it would be
        # refused as a deadlock). Calls it makes start a chain of their own.
        context = contextvars.copy_context()
        context.run(CALL_CHAIN.set, ())
        task = asyncio.get_running_loop().create_task(coro, name=name or f"{self.grain_key} task", context=context)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: background task %s failed", self.grain_key, task.get_name(), exc_info=task.exception())

    def abandon_turns(self, reason: str) -> list[asyncio.Task[Any]]:
        """End the turns still running on an activation that must go anyway (its deactivation
        timed out, its silo stops without a hand-off or was declared dead): each caller is
        told, each turn cancelled, and so is any background task (``start_task``) still left.

        Left running, a turn would outlive its activation: its state writes after the final
        flush, its task pending when the silo's loop closed (seen as a coroutine closed by the
        garbage collector in a later test). Returns the tasks, to be awaited by the catalog."""
        tasks: list[asyncio.Task[Any]] = []
        for inv in list(self._running):
            inv.cancelled = True  # so the turn takes its cancellation as its end, not the pump's
            if not inv.future.done():
                inv.future.set_exception(errors.GrainDeactivatedError(self.grain_key, reason))
            if inv.task is not None and not inv.task.done():
                inv.task.cancel()
                tasks.append(inv.task)
        for task in self.tasks:
            task.cancel()
            tasks.append(task)
        return tasks

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
        if self.status is not ActivationState.ACTIVATING:
            return  # deactivated while on_activate ran: it stays on its way out
        self.status = ActivationState.ACTIVE
        early: list[Invocation] = []
        if self._queue and (self.options.reentrant or any(inv.interleave for inv in self._queue)):
            # Calls that may interleave queued while on_activate ran: they start now, beside the pump.
            waiting = list(self._queue)
            self._queue.clear()
            for inv in waiting:
                (early if self.options.reentrant or inv.interleave else self._queue).append(inv)
            self._refill()
        if self._queue and self._pump is None:
            self._pump = (self._loop or asyncio.get_running_loop()).create_task(self._drain_mailbox())
        for inv in early:
            self._start(inv)

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def take_queued(self) -> list[Invocation]:
        queued = [*self._queue, *self._overflow]
        self._queue.clear()
        self._overflow.clear()
        # With no turn running, the activation is idle now: a deactivation waiting for idle
        # must not wait out its timeout for a queue it emptied itself (simulator, seed 79 "churn").
        self._check_idle()
        return queued


_UNTRUSTED = (DeactivationReason.STATE_CONFLICT, DeactivationReason.ERROR)
"""Reasons after which the activation's memory may differ from the store."""


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("timer callback failed: %r", fut.exception())
