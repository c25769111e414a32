"""The activations of one silo: create, look up, deactivate, collect when idle.

The catalog owns every :class:`~silo.catalog.activation.Activation` on this
silo. Activating a grain registers it in the directory first, and only the
registration that wins serves: a loser answers the calls queued on it with
the winner's silo, and the dispatcher forwards them there. The first call
creates the activation synchronously and queues on it like every later one,
so calls run in the order they arrived; registering and ``on_activate`` run in
a task of the catalog's own, so a caller that gives up at its deadline is
withdrawn from the mailbox without stopping the activation. Stateless workers
skip the directory and keep a local pool per grain id.

Deactivating stops an activation taking calls, lets the running turn finish
(up to ``deactivation_timeout_s``), runs ``on_deactivate``, flushes
write-behind state and unregisters; the calls still queued are handed to
``on_reroute`` (the dispatcher), so none is dropped and none hangs (pykka's
actor teardown, Orleans' Catalog). An idle collector deactivates activations
unused for their idle timeout, by the injectable ``clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grains.base import DeactivationReason
from grains.ids import GrainId, SiloAddress
from grains.placement import GrainOptions
from silo import errors
from silo.catalog.activation import Activation, Runtime
from silo.catalog.activation_state import ActivationState
from silo.catalog.invocation import Invocation, Reroute
from silo.catalog.pipeline import CallFilter, CallNext, build_pipeline, invoke_method
from silo.settings import CatalogSettings

if TYPE_CHECKING:
    from silo.catalog.grain_types import GrainTypes
    from silo.cluster.directory import GrainDirectory

log = logging.getLogger("redgrain.catalog")

# An enum attribute lookup costs ~75 ns on Python 3.11: get() runs on every call.
_TAKES_CALLS = (ActivationState.ACTIVE, ActivationState.ACTIVATING)
_GONE = (ActivationState.DEACTIVATING, ActivationState.INACTIVE)


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
        self._starting: set[asyncio.Task[None]] = set()
        """Activations registering and running on_activate (each in a task of its own)."""
        self._deactivating: dict[Activation, asyncio.Task[None]] = {}
        self._abandoned: set[asyncio.Task[Any]] = set()
        self._collector: asyncio.Task[None] | None = None
        self._activated_total = 0
        self._deactivated_total = 0
        self._failed = 0
        self.closed = False
        self.on_reroute: Callable[[Activation, list[Invocation]], None] = lambda a, i: None
        self.check_version: Callable[[GrainId, str], Awaitable[None]] | None = None
        """Raises (VersionMismatchError) when this silo's version of the type must not activate the
        grain for the call of the given method that started it (the dispatcher's rule)."""
        self._filters = list(filters or [])
        self.pipeline: CallNext = build_pipeline(self._filters, invoke_method)
        """The chain of a grain type with no filters of its own."""
        self._pipelines: dict[str, CallNext] = {}

    def pipeline_for(self, type_name: str, options: GrainOptions) -> CallNext:
        """The incoming chain of one grain type: the silo's filters, then the class's own."""
        if not options.incoming_filters:
            return self.pipeline
        chain = self._pipelines.get(type_name)
        if chain is None:
            chain = self._pipelines[type_name] = build_pipeline(
                [*self._filters, *options.incoming_filters], invoke_method
            )
        return chain

    # --- lookups -----------------------------------------------------------
    def get(self, grain_id: GrainId) -> Activation | None:
        act = self._activations.get(grain_id)
        if act is not None and act.status in _TAKES_CALLS:
            return act
        return None

    def activations(self) -> list[Activation]:
        return [*self._activations.values(), *(a for ws in self._workers.values() for a in ws)]

    def __len__(self) -> int:
        return len(self._activations) + sum(len(w) for w in self._workers.values())

    # --- activation --------------------------------------------------------
    def get_or_start(self, grain_id: GrainId, method: str | None = None) -> Activation | None:
        """This silo's activation of ``grain_id`` to queue a call on, started now if it has none.

        Synchronous, so a call queues on the activation in the order it arrived, the one that
        starts it first: a new activation takes calls at once (ACTIVATING) and runs them once
        it has won the directory and ``on_activate`` returned, in a task of its own, not the
        caller's (a caller that gives up at its deadline leaves the activation going). If
        another silo wins the directory, the queued calls are answered with
        :class:`Reroute` naming it; if activating fails, with the error. None while an earlier
        activation of the grain is still leaving (await its ``deactivated``, then ask again).
        ``method``: the call that starts it, checked by ``check_version`` before registering.
        """
        if self.closed:
            raise errors.SiloClosedError("silo")
        act = self._activations.get(grain_id)
        if act is not None:
            return act if act.status in _TAKES_CALLS else None
        cls = self._types.resolve(grain_id.type_name)
        act = Activation(grain_id, cls, self._types.options(grain_id.type_name), self.silo, self._runtime, self)
        self._activations[grain_id] = act
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Activation | SiloAddress] = loop.create_future()
        self._activating[grain_id] = fut
        self._spawn(self._activate(act, fut, method))
        return act

    async def start_after_leaving(self, grain_id: GrainId, method: str | None = None) -> Activation:
        """:meth:`get_or_start`, once an activation of the grain still leaving is gone."""
        while (act := self.get_or_start(grain_id, method)) is None:
            leaving = self._activations.get(grain_id)
            if leaving is not None:
                await leaving.deactivated.wait()
        return act

    async def get_or_activate(self, grain_id: GrainId) -> Activation | SiloAddress:
        """The local activation once it serves, creating it if needed; or the silo that won the directory."""
        act = await self.start_after_leaving(grain_id)
        pending = self._activating.get(grain_id)
        if pending is None:
            return act
        return await asyncio.shield(pending)

    def stateless_worker(self, grain_id: GrainId, options: GrainOptions) -> Activation | None:
        """Pick the least busy local worker, or None when a new one should be made."""
        workers = [a for a in self._workers.get(grain_id, []) if a.status in (ActivationState.ACTIVE, ActivationState.ACTIVATING)]
        idle = [a for a in workers if a.status is ActivationState.ACTIVE and not a.busy]
        if idle:
            return idle[0]
        # Workers still activating count toward the limit: a burst of calls while the first one
        # loads must wait for it, not make a worker per call (seen: 200 for 200 calls).
        if len(workers) >= options.stateless_worker:
            return min(workers, key=lambda a: a.queue_length)
        return None

    def start_worker(self, grain_id: GrainId) -> Activation:
        """A new stateless worker of ``grain_id``, taking calls at once (as :meth:`get_or_start`'s
        activations do); no directory entry."""
        if self.closed:
            raise errors.SiloClosedError("silo")
        cls = self._types.resolve(grain_id.type_name)
        act = Activation(grain_id, cls, self._types.options(grain_id.type_name), self.silo, self._runtime, self)
        self._workers.setdefault(grain_id, []).append(act)
        self._spawn(self._activate_worker(act))
        return act

    async def _activate_worker(self, act: Activation) -> None:
        try:
            await self._run_activation_hooks(act)
        except BaseException as exc:
            self._abandon(act, exc if isinstance(exc, Exception) else Reroute())
            if not isinstance(exc, Exception):
                raise

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _activate(
        self, act: Activation, fut: asyncio.Future[Activation | SiloAddress], method: str | None
    ) -> None:
        grain_id = act.grain_id
        try:
            if method is not None and self.check_version is not None:
                await self.check_version(grain_id, method)
            result = await self._register_and_run(act)
        except BaseException as exc:
            # Cancelled (the silo stops): the queued calls look again, as a deactivation's do.
            self._abandon(act, exc if isinstance(exc, Exception) else Reroute())
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: waiters re-raise it themselves
            if not isinstance(exc, Exception):
                raise
        else:
            fut.set_result(result)
        finally:
            if self._activating.get(grain_id) is fut:
                del self._activating[grain_id]

    async def _register_and_run(self, act: Activation) -> Activation | SiloAddress:
        grain_id = act.grain_id
        while True:
            try:
                winner = await self._directory.register(grain_id, self.silo, act.activation_id)
            except errors.MembershipError as exc:
                # The table no longer names us live (voted out, not yet told by our heartbeat):
                # no grain code ran, so the caller may retry elsewhere, as for a fenced silo.
                raise errors.SiloNotServingError(str(self.silo), str(exc)) from exc
            if winner.silo == self.silo and winner.activation_id == act.activation_id:
                break
            if winner.silo == self.silo and self._activations.get(grain_id) is act:
                # An entry of ours from an activation that is gone: stale, we must not serve
                # under it; take it away and register again.
                await self._directory.unregister(grain_id, winner.silo, winner.activation_id)
                continue
            # Another activation owns the grain: the calls queued here go there.
            self._abandon(act, Reroute(winner.silo))
            return winner.silo
        if act.status is not ActivationState.ACTIVATING:
            # Deactivated while it registered (the silo is stopping): it must not stay registered.
            await self._directory.unregister(grain_id, self.silo, act.activation_id)
            raise errors.SiloNotServingError(str(self.silo), f"{act.grain_key} deactivated while activating")
        act.token = winner.token
        try:
            await self._run_activation_hooks(act)
        except BaseException:
            await self._directory.unregister(grain_id, self.silo, act.activation_id)
            raise
        return act

    def _forget(self, act: Activation) -> None:
        """``act`` is no longer this catalog's: out of its worker pool or the activations."""
        if act.options.stateless_worker:
            pool = self._workers.get(act.grain_id, [])
            if act in pool:
                pool.remove(act)
            if not pool:
                self._workers.pop(act.grain_id, None)
        elif self._activations.get(act.grain_id) is act:
            del self._activations[act.grain_id]

    def _abandon(self, act: Activation, answer: BaseException) -> None:
        """``act`` never served: gone, and every call queued on it answered with ``answer``."""
        act.status = ActivationState.INACTIVE
        self._forget(act)
        act.deactivated.set()
        for inv in act.take_queued():
            if not inv.future.done():
                inv.future.set_exception(answer)

    async def _run_activation_hooks(self, act: Activation) -> None:
        try:
            # Bound before __init__ runs, so a grain's __init__ may read self.key.
            type(act.instance).__init__(act.instance)
            if act.cls.State is not None:
                await act.state_handle().load()
            # Named states asked for in __init__ load with the default one (Orleans loads every
            # persistent state before OnActivateAsync).
            for named in list(act.named.values()):
                await named.read()
            await act.instance.on_activate()
        except BaseException:
            self._failed += 1
            act.status = ActivationState.INACTIVE
            raise
        self._activated_total += 1
        act.begin_serving()

    # --- deactivation ------------------------------------------------------
    def schedule_deactivation(self, act: Activation, reason: DeactivationReason) -> None:
        if act in self._deactivating or act.status in _GONE:
            return
        task = asyncio.get_running_loop().create_task(self.deactivate(act, reason))
        self._deactivating[act] = task
        task.add_done_callback(lambda _: self._deactivating.pop(act, None))

    async def deactivate(self, act: Activation, reason: DeactivationReason) -> None:
        """Stop taking calls, finish the running turn, hand queued calls back, unregister."""
        if act.status in _GONE:
            return
        act.status = ActivationState.DEACTIVATING
        for timer in list(act.timers):
            timer.cancel()
        queued = act.take_queued()
        try:
            await self._deactivate(act, reason, queued)
        except asyncio.CancelledError:
            # The silo stops, or was declared dead, mid-way (stop, drop_all_nowait): the calls this
            # held fail as the silo's others do, and whoever waits for the activation's end is told.
            for inv in queued:
                if not inv.future.done():
                    inv.future.set_exception(errors.SiloUnavailableError(str(self.silo), "silo stopping"))
            act.deactivated.set()
            raise

    async def _deactivate(self, act: Activation, reason: DeactivationReason, queued: list[Invocation]) -> None:
        await act.cancel_tasks()
        timeout = self.settings.deactivation_timeout_s
        if not await act.wait_idle(timeout):
            log.warning("%s: turns still running after %.1fs; cancelling them", act.grain_key, timeout)
            await self._end_abandoned(act.abandon_turns(f"deactivated: its turn ran past {timeout:g}s"))
        try:
            await asyncio.wait_for(act.instance.on_deactivate(reason), timeout)
        except Exception:
            log.exception("%s: on_deactivate failed", act.grain_key)
        if reason is not DeactivationReason.STATE_CONFLICT:
            for handle in act.state_handles():
                try:
                    await handle.flush()
                except Exception:
                    log.exception("%s: flushing write-behind state %r failed", act.grain_key, handle.name)
        act.status = ActivationState.INACTIVE
        queued.extend(act.take_queued())  # calls that arrived while on_deactivate ran
        self._forget(act)
        if not act.options.stateless_worker:
            try:
                await self._directory.unregister(act.grain_id, self.silo, act.activation_id)
            except Exception:
                log.exception("%s: directory unregister failed", act.grain_key)
        self._deactivated_total += 1
        act.deactivated.set()
        if queued:
            self.on_reroute(act, queued)

    async def evict(self, grain_id: GrainId, reason: DeactivationReason) -> None:
        """Deactivate this grain's activation here, if it has one, and wait until it is gone
        (directory entry included), whoever started the deactivation."""
        pending = self._activating.get(grain_id)
        if pending is not None:
            # Let the activation finish first: a deactivation must not race its on_activate.
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        act = self._activations.get(grain_id)
        if act is None:
            return
        if act.status not in _GONE:
            await self.deactivate(act, reason)
        await act.deactivated.wait()

    async def deactivate_all(self, reason: DeactivationReason) -> None:
        acts = self.activations()
        await asyncio.gather(*(self.deactivate(a, reason) for a in acts), return_exceptions=True)
        if self._deactivating:
            await asyncio.gather(*list(self._deactivating.values()), return_exceptions=True)

    def drop_all_nowait(self, why: str = "silo declared dead") -> None:
        """Stop serving at once, without touching Redis: we were declared dead, or stop without a
        hand-off. Timers stop, queued calls fail (their callers may retry elsewhere), running
        turns are cancelled; ``stop()`` waits for those."""
        self.closed = True
        for act in self.activations():
            act.status = ActivationState.INACTIVE
            for timer in list(act.timers):
                timer.cancel()
            for inv in act.take_queued():
                if not inv.future.done():
                    inv.future.set_exception(errors.SiloUnavailableError(str(self.silo), why))
            self._abandoned.update(act.abandon_turns(why))
            act.deactivated.set()
        # A deactivation in flight would still unregister in Redis, and outlive the silo's stop.
        for task in list(self._deactivating.values()):
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
        # Activations still starting, and deactivations still running (the hand-off, when there
        # was one, waited for those it began): none may outlive the stop (the leave purges our
        # directory entries; the calls they hold fail and are re-routed by their callers).
        pending = [*self._starting, *self._deactivating.values()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # A stop without a hand-off (graceful=False, or at the loop's shutdown) leaves activations
        # live: their timers would go on ticking into a stopped silo, past the loop's end (a CI
        # run: a serving grain's poll, started while the test's loop cancelled its tasks, closed
        # by the garbage collector in a later test).
        if self._activations or self._workers:
            self.drop_all_nowait("silo stopped")
        # The turns cancelled by a drop end before the stop does.
        abandoned, self._abandoned = list(self._abandoned), set()
        await self._end_abandoned(abandoned)

    async def _end_abandoned(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Wait for cancelled turns to end; one that swallows its cancellation is named, not waited for."""
        if not tasks:
            return
        _, stuck = await asyncio.wait(tasks, timeout=self.settings.deactivation_timeout_s)
        for task in stuck:
            log.error("%s ignored its cancellation: left running", task.get_name())

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
            if act.options.keep_alive or act.busy or act.status is not ActivationState.ACTIVE:
                continue
            limit = act.options.idle_timeout_s or self.settings.idle_timeout_s
            if now - act.last_used >= limit:
                self.schedule_deactivation(act, DeactivationReason.IDLE)
                n += 1
        return n

    # --- introspection -----------------------------------------------------
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
