"""Incoming calls on a silo: find or create the activation, queue the call, answer.

Requests arrive from the transport (remote callers) or straight from the
router (calls between grains of this silo). A call that reaches a silo that
does not own the grain is forwarded to the owner (at most two hops); a call
that was queued on an activation that then went away is re-routed, never
dropped. A call this silo's ``@version`` of the grain type must not serve (its
version lacks the method, or a newer version is active elsewhere and the grain
has no activation here) is turned away unrun with ``VersionMismatchError``,
after deactivating the activation here if it lacks the method, and the caller
places it again (silo/cluster/versions.py); except that an activation is never
moved back to an older version: a call of a method only older versions have
fails with ``MethodRemovedError`` there.

Each request becomes one :class:`~grains.call.Call` (rebuilt from the frame
header, or handed over by the router) and a deadline on this silo's clock,
set when it arrives; both travel together through serving, forwarding and
re-routing, with the call's trace context when the caller sent one (header
item 8, :mod:`silo.tracing`). With ``tracing`` set, a call's turn runs inside
a SERVER span; a silo without it still forwards the context it received.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grains.base import DeactivationReason
from grains.call import Call
from grains.ids import GrainId, SiloAddress
from grains.placement import GrainOptions
from grains.result_stream import ResultStream, StreamChannel
from silo import errors
from silo.catalog.activation import Activation
from silo.catalog.activation_state import ActivationState
from silo.catalog.catalog import Catalog
from silo.catalog.grain_types import GrainTypes
from silo.catalog.internal import INTERNAL_TURNS
from silo.catalog.invocation import Invocation, Reply, Reroute
from silo.catalog.pipeline import CallContext
from silo.codec import SCALARS as _SCALARS
from silo.codec import Codec
from silo.messaging.connection import Connection
from silo.messaging.frame import CANCEL, ONEWAY, REQUEST, STREAM, Frame
from silo.messaging.observer_hub import OBSERVER_TYPE, ObserverHub
from silo.messaging.request import decode_request
from silo.messaging.results import LocalLink, Sink, open_generator, run_generator
from silo.messaging.wire_errors import as_remote
from silo.tracing import CONTEXT_KEY, Carrier, Tracing, carrier_from_header, context_entries

if TYPE_CHECKING:
    from silo.messaging.router import Router

log = logging.getLogger("redgrain.dispatcher")

MAX_HOPS = 2
MAX_REROUTES = 5
SYSTEM_TYPE = "$silo"
"""Reserved grain type of the silo's control surface (same value as router.SYSTEM_TYPE)."""

SystemHandler = Callable[..., Awaitable[Any]]

_new_call = tuple.__new__  # Call with all seven fields, minus NamedTuple's Python-level __new__


def _never_fenced() -> bool:
    return False


async def _always_alive(timeout_s: float) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    requests: int
    """Requests received over the network."""
    forwarded: int
    """Requests relayed to the grain's owner on another silo."""
    rerouted: int
    """Queued calls re-routed after their activation went away."""
    errors: int
    """Requests answered with an error."""
    in_flight: int
    """Requests being served right now."""
    one_way: int = 0
    """``@one_way`` calls received (over the network or from this silo)."""
    one_way_failed: int = 0
    """Of those, the ones that failed (logged here: their callers never hear of it)."""
    streams: int = 0
    """Streamed calls (async-generator methods) that reached an activation here, from anywhere."""
    version_mismatches: int = 0
    """Calls turned away because this silo's version of the type must not serve them
    (VersionMismatchError: the caller placed them again)."""


class _NoAnswer:
    """Where a one-way call's answer goes: nowhere. A failure is logged and counted instead,
    as the caller has long moved on (it stands in for the connection when serving the call)."""

    __slots__ = ("_dispatcher", "_label", "peer")

    def __init__(self, dispatcher: Dispatcher, peer: str, label: str | Call) -> None:
        # A call stands for its label until one is needed (formatting it costs more than a post).
        self._dispatcher, self.peer, self._label = dispatcher, peer, label

    def send_response(self, req_id: int, value: Any) -> None:
        pass

    def send_error(self, req_id: int, exc: BaseException) -> None:
        label = self._label if isinstance(self._label, str) else f"{self._label.grain}.{self._label.method}"
        self._dispatcher.one_way_failed(label, self.peer, exc)


class Dispatcher:
    def __init__(
        self,
        *,
        address: SiloAddress,
        catalog: Catalog,
        types: GrainTypes,
        router: Router,
        fenced: Callable[[], bool] = _never_fenced,
        confirm_alive: Callable[[float], Awaitable[bool]] = _always_alive,
        moving: dict[GrainId, asyncio.Future[SiloAddress | None]] | None = None,
        system: Mapping[str, SystemHandler] | None = None,
        tracing: Tracing | None = None,
        codec: Codec | None = None,
        observers: ObserverHub | None = None,
    ) -> None:
        self.address = address
        self._address_text = str(address)
        self.observers = observers
        """Serves calls to observers (grain type ``$observer``); None: this silo takes none."""
        self._codec = codec
        self._loop: asyncio.AbstractEventLoop | None = None
        """Read at the first call (silo/loop.py: each read of it is a system call on 3.11)."""
        """Copies a local call's arguments and result (None: passed as they are; tests of the
        dispatcher alone)."""
        self._catalog = catalog
        self._types = types
        self._router = router
        self._in_flight: dict[tuple[int, int], Invocation] = {}
        self._requests = self._forwarded = self._rerouted = self._errors = 0
        self._one_way = self._one_way_failed = 0
        self._version_mismatches = 0
        self._streams = 0
        self._posts = 0
        self._arriving: dict[tuple[int, int], asyncio.Task[None] | None] = {}
        """Requests served by _serve (a task each), which a CANCEL may reach before they are queued."""
        self._recalled: set[tuple[int, int]] = set()
        """Of those, the ones whose caller gave up while on no activation: never queued."""
        self._relaying: set[tuple[int, int]] = set()
        """Of those, the ones being forwarded to their grain's owner: a CANCEL cancels their task,
        whose forwarding call then sends the owner a CANCEL of its own (router.send)."""
        self._waiting: set[Invocation] = set()
        """Calls from this silo waiting for an answer (their deadlines: see _watch)."""
        self._sweep_at = float("inf")
        self._sweeper: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._queued_nowait = 0
        self.closed = False
        self.draining = False
        """Set when the silo is ShuttingDown: serve existing activations, create none."""
        self.fenced = fenced
        """True while liveness is unconfirmed (peers may have declared us dead): serve nothing."""
        self.confirm_alive = confirm_alive
        """Wait up to the given seconds for liveness to be confirmed again (heartbeat thread)."""
        self.moving: dict[GrainId, asyncio.Future[SiloAddress | None]] = {} if moving is None else moving
        """Grains being moved to another silo: their calls wait, then follow (the migrator's dict)."""
        self.system: dict[str, SystemHandler] = {
            "activate": self._system_activate,
            "activations": self._system_activations,
            **(system or {}),
        }
        """The silo's control surface, reached as grain type ``$silo`` (the silo adds move, drain)."""
        self.tracing = tracing
        """Runs each call's turn in a SERVER span; None (the default): no spans."""
        catalog.on_reroute = self._reroute_queued
        catalog.check_version = self._refuse_if_outdated

    # --- from the transport ------------------------------------------------
    def on_frame(self, conn: Connection, frame: Frame) -> None:
        header = frame.header
        kind = header[0]
        if len(header) < 2 or not isinstance(header[1], int):
            raise errors.CodecError(f"frame header without a request id: {header!r:.100}")
        if kind == CANCEL:
            track = (id(conn), header[1])
            inv = self._in_flight.get(track)
            if inv is None and track in self._arriving:
                # Not on an activation yet (its grain is activating): dropped when it would be queued.
                self._recalled.add(track)
            elif inv is not None and not inv.future.done():
                inv.cancelled = True
                if inv.activation is not None:
                    inv.activation.cancel_call(inv)
            elif track in self._arriving:
                # Between activations (re-routed) or relayed to the grain's owner: never queued
                # again here, and a relayed call is cancelled where it runs, one CANCEL per hop.
                self._recalled.add(track)
                task = self._arriving[track]
                if track in self._relaying and task is not None:
                    task.cancel()
            return
        if kind not in (REQUEST, ONEWAY, STREAM):
            return
        self._requests += 1
        req_id = header[1]
        codec = conn.codec
        if kind == ONEWAY:
            self._one_way += 1
            label = f"{header[2]}/{header[3]}.{header[4]}" if len(header) > 4 else "?"
            conn = _NoAnswer(self, conn.peer, label)  # type: ignore[assignment]
        try:
            call = decode_request(header, frame, codec)
        except errors.CodecError as exc:
            self._errors += 1
            conn.send_error(req_id, exc)
            return
        # A peer that sends no trace context (or predates it) sends eight items.
        trace = carrier_from_header(header) if len(header) > 8 else None
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + (call.timeout_s or 0.0)
        if kind == STREAM:
            # Known now, before the CREDIT that follows it on this connection is read.
            sink = conn.serve_stream(req_id)
            self._spawn_serve(conn, req_id, call, deadline, trace, sink)
            return
        if not self._serve_nowait(conn, req_id, call, deadline, trace):
            self._spawn_serve(conn, req_id, call, deadline, trace)

    def _spawn_serve(
        self, conn: Connection, req_id: int, call: Call, deadline: float, trace: Carrier | None, sink: Sink | None = None
    ) -> None:
        # Known as arriving now, not when the task starts: a CANCEL read next may reach it first.
        track = (id(conn), req_id)
        self._arriving[track] = None
        task = self._arriving[track] = asyncio.get_running_loop().create_task(
            self._serve(conn, req_id, call, deadline, trace, sink)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _serve_nowait(
        self, conn: Connection, req_id: int, call: Call, deadline: float, trace: Carrier | None
    ) -> bool:
        """Queue a call on a local activation without a task of its own.

        A task per request cost more than the rest of serving a small call; when
        nothing special applies, the call goes straight into the mailbox (of an
        activation still activating too, or one started now for it) and the
        answer is sent from the invocation's done callback. Queued here, in the
        order the calls arrive, no call overtakes another that came before it
        (a task would start a turn of the loop later). Returns False when
        dispatch() must handle the call.
        """
        grain, method, args, kwargs, _, chain, _ = call
        if (
            self.closed
            or self.draining
            or method in INTERNAL_TURNS  # a reminder tick, a stream item: dispatch() runs their turns
            or (trace is not None and CONTEXT_KEY in trace)  # a request context: checked by dispatch()
            or (self.moving and grain in self.moving)
            or self.fenced()
        ):
            return False
        act = self._catalog.get(grain)
        if act is None:
            act = self._start_nowait(grain, method)
            if act is None:
                return False
        elif method not in self._types.awaited(grain.type_name):
            return False
        options = act.options
        track = (id(conn), req_id)

        def answer(result: Any, exc: BaseException | None) -> None:
            # Runs inside the activation's turn: a failure to answer must not break its mailbox.
            try:
                self._answer(result, exc, conn, req_id, track, call, deadline, trace)
            except Exception:
                log.exception("could not answer %s.%s to %s", call.grain, call.method, conn.peer)

        # Positional (method, args, kwargs, chain, deadline, future, callback, interleave,
        # read_only): keyword arguments cost 0.3 µs more per call on Python 3.11.
        inv = Invocation(
            method, args, kwargs, chain, deadline, Reply(answer),
            None if self.tracing is None else self._traced_turn(act, call, trace),
            method in options.interleave, method in options.read_only,
        )
        inv.activation = act
        self._in_flight[track] = inv
        self._queued_nowait += 1
        act.enqueue(inv)
        return True

    def _start_nowait(self, grain: GrainId, method: str) -> Activation | None:
        """A new activation of ``grain`` for a call of ``method``, or None where dispatch() decides."""
        if grain.type_name == SYSTEM_TYPE or grain.type_name == OBSERVER_TYPE or self._catalog.closed:
            return None
        try:
            options = self._types.options(grain.type_name)
        except errors.UnknownGrainError:
            return None
        if method not in self._types.awaited(grain.type_name):
            return None
        if options.stateless_worker:
            # As dispatch() picks one: the least busy worker, or a new one below the limit. A
            # served model is a reentrant worker: its requests skip a task each this way.
            return self._catalog.stateless_worker(grain, options) or self._catalog.start_worker(grain)
        return self._catalog.get_or_start(grain, method)

    def _answer(
        self,
        result: Any,
        exc: BaseException | None,
        conn: Connection,
        req_id: int,
        track: tuple[int, int],
        call: Call,
        deadline: float,
        trace: Carrier | None,
    ) -> None:
        self._queued_nowait -= 1
        self._in_flight.pop(track, None)
        if isinstance(exc, Reroute):
            # The activation went away before the call started: the full path looks again.
            self._rerouted += 1
            self._spawn_serve(conn, req_id, call, deadline, trace)  # a streamed call never comes here
        elif exc is not None:
            if isinstance(conn, _NoAnswer) and isinstance(exc, Exception) and self._send_one_way_again(call, deadline, exc):
                return
            self._errors += 1
            conn.send_error(req_id, exc)
        elif self.fenced():
            self._answer_when_alive(conn, req_id, result, deadline)
        else:
            conn.send_response(req_id, result)

    def _answer_when_alive(self, conn: Connection, req_id: int, result: Any, deadline: float) -> None:
        """The method ran while liveness was unconfirmed: answer only once the heartbeat confirms it.

        An overloaded silo's heartbeat is just late; a zombie's never comes, and it
        must not answer (nor may the caller retry: the method ran).
        """

        async def answer() -> None:
            if await self.confirm_alive(deadline - asyncio.get_running_loop().time()):
                conn.send_response(req_id, result)
            else:
                self._errors += 1
                conn.send_error(req_id, errors.SiloUnavailableError(str(self.address), "silo fenced"))

        task = asyncio.get_running_loop().create_task(answer())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(
        self, conn: Connection, req_id: int, call: Call, deadline: float, trace: Carrier | None, sink: Sink | None = None
    ) -> None:
        track = (id(conn), req_id)
        try:
            result = await self.dispatch(call, deadline, track, trace, sink=sink)
        except asyncio.CancelledError:
            if track in self._recalled:
                # Its caller's CANCEL stopped the call this silo relayed: answered as a cancelled
                # turn is (the caller has forgotten it), which frees its place on the connection.
                self._errors += 1
                conn.send_error(req_id, errors.GrainTimeoutError(str(call.grain), call.method, 0.0))
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is answered to the caller
            if isinstance(conn, _NoAnswer) and self._send_one_way_again(call, deadline, exc):
                return
            self._errors += 1
            conn.send_error(req_id, exc)
        else:
            if self.fenced():
                self._answer_when_alive(conn, req_id, result, deadline)
                return
            conn.send_response(req_id, result)
        finally:
            self._arriving.pop(track, None)
            self._recalled.discard(track)
            if sink is not None:
                conn.end_stream(req_id)

    # --- the local entry point (router calls this for grains on this silo) --
    async def dispatch(
        self,
        call: Call,
        deadline: float,
        track: tuple[int, int] | None = None,
        trace: Carrier | None = None,
        *,
        stream: StreamChannel | None = None,
        sink: Sink | None = None,
    ) -> Any:
        """Run ``call`` on this silo's activation of its grain, or forward it to the grain's owner.

        ``trace``: the caller's trace context, parent of this call's span (and passed on if forwarded).
        A streamed call (an async-generator method: silo/messaging/results.py) comes with the
        caller's ``stream`` when the caller is on this silo (this returns once the stream has its
        first item or its end), or with the ``sink`` its network request's items go to (this
        returns when the stream ends).
        """
        grain, method, args, kwargs, _, chain, hops = call  # one unpack: cheaper than six reads
        if self.closed:
            raise errors.SiloNotServingError(str(self.address), "silo is stopping")
        if self.fenced():
            raise errors.SiloNotServingError(str(self.address), "liveness unconfirmed (fenced)")
        if grain.type_name == SYSTEM_TYPE:
            handler = self.system.get(method)
            if handler is None:
                raise errors.UnknownMethodError(SYSTEM_TYPE, method)
            return await handler(*args)
        if grain.type_name == OBSERVER_TYPE and self.observers is not None:
            return await self.observers.serve(call, deadline)
        options = self._types.options(grain.type_name)  # UnknownGrainError if not hosted here
        entries = None if trace is None else context_entries(trace)  # CodecError: a peer's bad one
        streamed = stream is not None or sink is not None
        internal = None
        # An awaited method of the type, most calls: one set lookup decides all three checks.
        if streamed or method not in self._types.awaited(grain.type_name):
            internal = INTERNAL_TURNS.get(method)  # a reminder tick, a stream item (silo/catalog/internal.py)
            if internal is None and method not in self._types.methods(grain.type_name):
                raise await self._not_in_this_version(grain, method, options)
            if internal is None and streamed != (method in self._types.streams(grain.type_name)):
                raise TypeError(
                    f"{grain}.{method} is an async generator: iterate it (async for ... in ref.{method}(...))"
                    if not streamed
                    else f"{grain}.{method} is no async generator: await it"
                )
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        for _ in range(MAX_REROUTES):
            move = self.moving.get(grain)
            if move is not None:
                target = await asyncio.shield(move)
                if target is not None and target != self.address and hops < MAX_HOPS:
                    self._forwarded += 1
                    return await self._forward(target, call, deadline, trace, stream, sink, track)
            if self.draining and not self._has_activation(grain, options):
                raise errors.SiloNotServingError(str(self.address), "silo is draining")
            # The call goes into the mailbox now, also of an activation still registering or
            # running on_activate (which it waits for there, within its deadline): calls run in
            # the order they arrived, the one that started the activation first.
            if options.stateless_worker:
                act = self._catalog.stateless_worker(grain, options) or self._catalog.start_worker(grain)
            else:
                act = self._catalog.get_or_start(grain, method) or await self._catalog.start_after_leaving(grain, method)
            local = track is None and self._codec is not None
            if local:
                # The callee gets what it would decode from the wire, never the caller's objects
                # (plain immutable arguments, most calls, are checked here without a call).
                assert self._codec is not None
                if not _SCALARS.issuperset(map(type, args)):
                    args = self._codec.copy(args)
                if kwargs:
                    kwargs = self._codec.copy(kwargs)
            fut: asyncio.Future[Any] = loop.create_future()
            turn: Callable[[], Awaitable[Any]] | None
            link: LocalLink | None = None
            if internal is not None:
                internal(act, args)  # its arguments checked now (CodecError), not in the turn
                # An internal turn runs through the incoming filters like any call: the chain's
                # last link (invoke_method) turns its method name into the turn it names.
                turn = None if self.tracing is None else self._traced_turn(act, call, trace)
            elif streamed:
                self._streams += 1
                if stream is not None:
                    link = LocalLink(stream, self._codec if local else None, act, method)
                    stream.attach(link)
                turn = self._stream_turn(act, call._replace(args=args, kwargs=kwargs), trace, link.sink if link else sink)  # type: ignore[arg-type]
            else:
                turn = None if self.tracing is None else self._traced_turn(act, call, trace)
            inv = Invocation(  # positional, as in _serve_nowait
                method, args, kwargs, chain, deadline, fut, turn,
                method in options.interleave, method in options.read_only,
            )
            inv.context = entries
            if track is not None:
                self._in_flight[track] = inv
                inv.activation = act
            try:
                if track is not None and track in self._recalled:
                    raise errors.GrainTimeoutError(str(grain), method, 0.0)  # its caller gave up meanwhile
                act.enqueue(inv)
                if track is not None:
                    return await fut
                if link is not None:
                    assert stream is not None
                    return await self._opened_here(act, inv, link, stream)
                # A call from this silo: no connection sweeps its deadline, so this does, as a
                # remote caller's CANCEL would (the callee's turn is cancelled too).
                inv.activation = act
                self._watch(inv)
                try:
                    result = await fut
                except asyncio.CancelledError:
                    # The caller gave up (task cancelled, wait_for, a TaskGroup failing): the
                    # callee's turn is cancelled, or the queued call dropped, as a CANCEL does.
                    act.cancel_call(inv)
                    raise
                except Reroute:
                    raise
                except Exception as exc:
                    # What a caller on another silo would get (wire_errors.as_remote).
                    remote = as_remote(exc, None if self._codec is None else self._codec.registry)
                    if remote is exc:
                        raise
                    raise remote from None
                finally:
                    self._waiting.discard(inv)
                if local and type(result) not in _SCALARS:
                    return self._codec.copy(result)  # type: ignore[union-attr]
                return result
            except Reroute as reroute:
                if reroute.to is not None and reroute.to != self.address:
                    # Queued on an activation that lost the directory to another silo's: go there.
                    if hops >= MAX_HOPS:
                        raise errors.SiloUnavailableError(str(reroute.to), f"{grain} still not found after {hops} hops") from None
                    self._forwarded += 1
                    return await self._forward(reroute.to, call, deadline, trace, stream, sink, track)
                self._rerouted += 1
                continue
            finally:
                if track is not None:
                    self._in_flight.pop(track, None)
        raise errors.GrainDeactivatedError(str(grain), "re-routed too many times")

    # --- deadlines of calls from this silo ---------------------------------------
    # A connection keeps a heap of its requests' deadlines; here a set of the waiting calls and
    # one timer for the earliest deadline (a timer, or a heap entry, per call cost a tenth of a
    # local call: allocations that also kept answered calls alive). The timer rarely fires while
    # calls are answered well within their deadline: when it does, one pass over the waiting
    # calls expires the late ones and finds the next earliest.
    def _watch(self, inv: Invocation) -> None:
        self._waiting.add(inv)
        if inv.deadline < self._sweep_at:
            if self._sweeper is not None:
                self._sweeper.cancel()
            self._sweep_at = inv.deadline
            self._sweeper = asyncio.get_running_loop().call_at(inv.deadline, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self._sweep_at = float("inf")
        now = asyncio.get_running_loop().time()
        for inv in [i for i in self._waiting if i.deadline <= now]:
            self._waiting.discard(inv)
            act = inv.activation
            if not inv.future.done() and act is not None:
                inv.future.set_exception(errors.GrainTimeoutError(act.grain_key, inv.method, 0.0))
                act.cancel_call(inv)
        if self._waiting:
            self._sweep_at = min(i.deadline for i in self._waiting)
            self._sweeper = asyncio.get_running_loop().call_at(self._sweep_at, self._sweep)

    def _stream_turn(
        self, act: Activation, call: Call, trace: Carrier | None, sink: Sink
    ) -> Callable[[], Awaitable[Any]]:
        """A streamed call's turn: the call filters open the call (with tracing, inside its span)
        and hand back the generator, which then runs against the caller's credit."""
        grain, method, args, kwargs, _, chain, _ = call
        opening = None if self.tracing is None else self._traced_turn(act, call, trace)

        async def run() -> None:
            if opening is not None:
                result = await opening()
            else:
                result = await act.pipeline(CallContext(grain, method, args, kwargs, chain, act))
            await run_generator(open_generator(result, method), sink)

        return run

    async def _forward(
        self,
        target: SiloAddress,
        call: Call,
        deadline: float,
        trace: Carrier | None,
        stream: StreamChannel | None,
        sink: Sink | None,
        track: tuple[int, int] | None = None,
    ) -> Any:
        """Relay a call to its grain's owner. A streamed one from this silo is opened there for
        its caller's own stream; one from the network is relayed item by item, no faster than
        its caller's credit (the relay's own window bounds what waits here).

        A caller on this silo cancels the relay by cancelling its own task; a network request's
        CANCEL (``track``) cancels the task serving it here (on_frame). Either way the relaying
        call sends the owner its CANCEL, as any call does when its caller gives up."""
        if track is not None:
            if track in self._recalled:
                raise errors.GrainTimeoutError(str(call.grain), call.method, 0.0)  # its caller gave up meanwhile
            self._relaying.add(track)
        try:
            if sink is None:
                return await self._router.forward(target, call, deadline, trace, stream=stream)
            relay: ResultStream[Any] = ResultStream(self._router, call)
            await self._router.forward(target, call, deadline, trace, stream=relay.channel)
            await run_generator(relay, sink)  # closes the relay (a CANCEL there) however it ends
            return None
        finally:
            if track is not None:
                self._relaying.discard(track)

    async def _opened_here(self, act: Activation, inv: Invocation, link: LocalLink, stream: StreamChannel) -> None:
        """A streamed call from this silo: wait for its first item or its end; the turn's end
        (its future) ends the caller's stream with what a remote caller would get."""
        link.bind(inv)
        registry = None if self._codec is None else self._codec.registry

        def ended(fut: asyncio.Future[Any]) -> None:
            # A loop step after the turn ended: every item it delivered is in the stream already.
            exc = None if fut.cancelled() else fut.exception()
            stream.finish(exc if exc is None or isinstance(exc, Reroute) else as_remote(exc, registry))

        inv.future.add_done_callback(ended)  # type: ignore[union-attr]
        try:
            await stream.opened()
        except asyncio.CancelledError:
            act.cancel_call(inv)  # the caller gave up (or its deadline passed) before the first item
            raise

    def _traced_turn(self, act: Activation, call: Call, trace: Carrier | None) -> Callable[[], Awaitable[Any]]:
        """The call's turn inside a SERVER span (the turn's own body: the pipeline, as untraced)."""
        assert self.tracing is not None
        grain, method, args, kwargs, _, chain, _ = call
        pipeline = act.pipeline  # the grain type's chain (its class's own filters included)

        def run() -> Awaitable[Any]:
            return pipeline(CallContext(grain, method, args, kwargs, chain, act))

        return self.tracing.server_turn(str(self.address), grain, method, trace, run)

    def _reroute_queued(self, act: Activation, queued: list[Invocation]) -> None:
        # The callers' dispatch() loops see Reroute and look the grain up again.
        for inv in queued:
            if not inv.future.done():
                inv.future.set_exception(Reroute())

    # --- versions (silo/cluster/versions.py has the rule) --------------------------
    async def _not_in_this_version(self, grain: GrainId, method: str, options: GrainOptions) -> errors.RedgrainError:
        """The error for a call of a method this silo's version of the type lacks.

        No version has it: UnknownMethodError. Only older versions have it and the grain is
        active here: MethodRemovedError (a grain moves only to newer versions, so it never
        bounces between versions). Another version has it: this silo's
        activation of the grain (if any) is deactivated and waited for, so its
        directory entry is gone, and the caller is told to place the call again
        (VersionMismatchError), where the rule sends it to a version that has it.
        """
        versions = await self._router.versions_with(grain.type_name, method)  # UnknownMethodError if none
        if max(versions) < options.version and self._has_activation(grain, options):
            # Only older versions have it: moving the grain back would let callers of this method
            # and of a newer one move it to and fro, one activation per call. It stays.
            return errors.MethodRemovedError(str(grain), method, options.version, versions)
        wanted = await self._router.newest_version(grain.type_name, method)
        if wanted is None:
            # The silo of that version may have joined a moment ago: look once more.
            await self._router.refresh_membership()
            wanted = await self._router.newest_version(grain.type_name, method)
        if wanted is None:
            # No active silo hosts a version with the method: keep the activation, say so.
            return errors.SiloUnavailableError(
                "", f"no active silo hosts a version of {grain.type_name} with method {method!r}"
            )
        if not options.stateless_worker:
            await self._catalog.evict(grain, DeactivationReason.INCOMPATIBLE_VERSION)
        self._version_mismatches += 1
        return errors.VersionMismatchError(str(self.address), grain.type_name, method, options.version, wanted)

    async def _refuse_if_outdated(self, grain: GrainId, method: str) -> None:
        """Create no activation of an older version than the rule places new ones on (the
        catalog asks before it registers one; every call queued on it gets the error). An
        internal turn is placed as a call of no particular method: every version takes it."""
        options = self._types.options(grain.type_name)
        wanted = await self._router.newest_version(grain.type_name, None if method in INTERNAL_TURNS else method)
        if wanted is not None and wanted > options.version:
            self._version_mismatches += 1
            raise errors.VersionMismatchError(str(self.address), grain.type_name, method, options.version, wanted)

    def _has_activation(self, grain: GrainId, options: GrainOptions) -> bool:
        if options.stateless_worker:
            return self._catalog.stateless_worker(grain, options) is not None
        return self._catalog.get(grain) is not None

    async def _system_activate(self, grain_text: str) -> str:
        """Activate a grain here without calling a method (keep-alive failover, moves)."""
        grain = GrainId.parse(grain_text)
        options = self._types.options(grain.type_name)
        if self.draining:
            raise errors.SiloNotServingError(str(self.address), "silo is draining")
        if options.stateless_worker:
            return str(self.address)
        found = await self._catalog.get_or_activate(grain)
        return str(found if isinstance(found, SiloAddress) else self.address)

    async def _system_activations(self) -> dict[str, str]:
        """grain id -> activation id of every live activation here (tests, `redgrain status`)."""
        return {
            str(a.grain_id): a.activation_id
            for a in self._catalog.activations()
            if a.status in (ActivationState.ACTIVE, ActivationState.ACTIVATING) and not a.options.stateless_worker
        }

    async def close(self) -> None:
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def statistics(self) -> DispatcherStatistics:
        return DispatcherStatistics(
            requests=self._requests,
            forwarded=self._forwarded,
            rerouted=self._rerouted,
            errors=self._errors,
            in_flight=len(self._tasks) + self._queued_nowait,
            one_way=self._one_way,
            one_way_failed=self._one_way_failed,
            version_mismatches=self._version_mismatches,
            streams=self._streams,
        )

    # --- one-way calls -------------------------------------------------------
    def post(self, call: Call, deadline: float, trace: Carrier | None = None) -> None:
        """Deliver a ``@one_way`` call from this silo: queued now, run in the background.

        The arguments are copied before this returns (the caller may change its objects at once);
        the call is tracked as a network request would be, so it runs until done, not until its
        deadline, and a failure is logged and counted here."""
        grain, method, args, kwargs, timeout_s, _, hops = call
        if self._codec is not None:
            args = self._codec.copy(args)
            if kwargs:
                kwargs = self._codec.copy(kwargs)
        self._one_way += 1
        self._posts += 1
        # No chain: the caller does not wait for a one-way call (see the router's ONEWAY header).
        copied = _new_call(Call, (grain, method, args, kwargs, timeout_s, (), hops))
        # Into the mailbox now, as a one-way frame from the network goes: a two-way call this
        # caller makes next (served inline) must not overtake it.
        if self._serve_nowait(_NoAnswer(self, self._address_text, copied), self._posts, copied, deadline, trace):  # type: ignore[arg-type]
            return
        # (0, n) never collides with a connection's (id(conn), req_id): no CANCEL reaches it.
        track = (0, self._posts)
        task = asyncio.get_running_loop().create_task(self._run_posted(copied, deadline, track, trace))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_posted(self, call: Call, deadline: float, track: tuple[int, int], trace: Carrier | None) -> None:
        try:
            await self.dispatch(call, deadline, track, trace)
        except Exception as exc:  # noqa: BLE001 - nobody waits for the answer: log and count it
            if not self._send_one_way_again(call, deadline, exc):
                self.one_way_failed(f"{call.grain}.{call.method}", str(self.address), exc)

    def _send_one_way_again(self, call: Call, deadline: float, exc: Exception) -> bool:
        """A one-way call turned away here unrun (a drain, a version mismatch): its caller has
        moved on and cannot retry it, so this silo places it again, as the caller's router would
        have, one hop further. False when it may not (hops used up, deadline passed)."""
        remaining = deadline - asyncio.get_running_loop().time()
        if not isinstance(exc, errors.SiloNotServingError) or call.hops >= MAX_HOPS or remaining <= 0:
            return False
        if self.closed:
            # Closed: its tasks were cancelled and awaited, so a new one would outlive the silo's
            # stop (the simulator's seed 47 of `stops`). The call fails here, logged and counted.
            return False
        self._router.forget(call.grain)
        again = call.forwarded(remaining)

        async def send() -> None:
            try:
                await self._router.invoke(again, True)
            except Exception as err:  # noqa: BLE001 - nobody waits for the answer: log and count it
                self.one_way_failed(f"{call.grain}.{call.method}", str(self.address), err)

        task = asyncio.get_running_loop().create_task(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def one_way_failed(self, label: str, peer: str, exc: BaseException) -> None:
        self._one_way_failed += 1
        log.warning("one-way call %s from %s failed: %s: %s", label, peer, type(exc).__name__, exc)
