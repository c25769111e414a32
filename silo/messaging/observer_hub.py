"""Observers of one process (a silo or a client): the ones made here, and calls to any.

An observer (:mod:`grains.observer`) is a plain local object made callable by
reference. Each process has one hub. It keeps the handlers made here (by id),
binds the references the codec decodes to itself, and carries every call to
an observer to the process that made it:

- made here: the call runs here, on a copy of its arguments (as a call to a
  grain on the caller's own silo does), within its deadline;
- made by a silo (owner ``host:port@generation``): a REQUEST frame to that
  silo, target ``$observer/<id>``; the silo's dispatcher hands it to its hub;
- made by a client (owner ``client:<id>``): a REQUEST frame on the connection
  *that client opened to us* (each client names itself with a CLIENT frame
  when it connects, :mod:`silo.messaging.connection`), since a client is
  usually not reachable by a silo dialling in. A silo the client is not
  connected to relays the call, one hop, through one of the reference's
  gateways (the silos the client was connected to when the reference left it).

A call that cannot reach its observer any more raises ObserverGoneError: the
connection is closed or lost (the client closed or died), the owner's
process was replaced (a silo of another generation at that address knows
nothing of it), or the observer was disposed (``await obs.dispose()``, the
client closing, or the grain that made it deactivating). ``ObserverSet``
drops such an observer.

Deadlines: the caller's connection expires the request and sends CANCEL, and
the serving hub runs the handler within the same deadline, so both ends stop.
A handler method marked ``@one_way`` is sent as a ONEWAY frame (or run in the
background here); its failure is logged here, never raised to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grains.call import CALL_CHAIN, Call
from grains.ids import GrainId, SiloAddress
from grains.observer import CLIENT_PREFIX, ObserverId, ObserverRef, observer_interface
from silo import errors
from silo.codec import SCALARS, Codec
from silo.messaging.frame import CANCEL, ONEWAY, REQUEST, Frame
from silo.messaging.request import decode_request, encode_request, request_body

if TYPE_CHECKING:
    from silo.messaging.connection import Connection
    from silo.messaging.transport import Transport

log = logging.getLogger("redgrain.observer")

OBSERVER_TYPE = "$observer"
"""Reserved grain type of a call to an observer: the key is the observer's id (``owner/local``)."""

MAX_RELAY_HOPS = 1


def _always() -> bool:
    return True


@dataclass(slots=True)
class _Entry:
    handler: object
    methods: frozenset[str]
    one_way: frozenset[str]
    alive: Callable[[], bool]
    """False once the owner is gone (the activation that made it deactivated)."""


@dataclass(frozen=True, slots=True)
class ObserverStatistics:
    observers: int
    """Observers made here and not disposed."""
    calls_out: int
    """Calls made from here to observers (anywhere)."""
    calls_in: int
    """Calls served here to observers made here."""
    relayed: int
    """Calls relayed here to a client connected to this silo (a silo it is not connected to asked)."""
    gone: int
    """Calls made from here that raised ObserverGoneError."""
    one_way_failed: int
    """One-way calls to observers made here that failed (logged: their callers never hear of it)."""


class ObserverHub:
    """The observers of one process, and the way out to everybody else's (module doc)."""

    def __init__(
        self,
        *,
        owner: str,
        codec: Codec,
        transport: Transport | None,
        call_timeout_s: float,
    ) -> None:
        self.owner = owner
        """``client:<id>`` on a client, ``str(SiloAddress)`` on a silo: the owner part of ids made here."""
        self._codec = codec
        self._transport = transport
        self._timeout_s = call_timeout_s
        self._mine: dict[str, _Entry] = {}
        self._sweep_at = 64
        self._endpoint = None if owner.startswith(CLIENT_PREFIX) else SiloAddress.parse(owner).endpoint
        self._serving: dict[tuple[int, int], asyncio.Task[Any]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._calls_out = self._calls_in = self._relayed = self._gone = self._one_way_failed = 0
        self.closed = False
        codec.observers = self

    # --- observers made here -------------------------------------------------------
    def create(self, handler: object, *, alive: Callable[[], bool] = _always) -> ObserverRef:
        """A reference to ``handler``; ``alive`` says whether its owner (an activation) still lives."""
        if self.closed:
            raise errors.SiloClosedError("observer hub")
        methods, one_way = observer_interface(handler)
        if len(self._mine) >= self._sweep_at:
            # Observers of activations that went away, never called since: forgotten in bulk, now
            # and then, rather than on every deactivation.
            self._mine = {k: e for k, e in self._mine.items() if e.alive()}
            self._sweep_at = 2 * len(self._mine) + 64
        local_id = uuid.uuid4().hex
        self._mine[local_id] = _Entry(handler, methods, one_way, alive)
        return ObserverRef(self, ObserverId(self.owner, local_id), methods, one_way)

    def dispose_nowait(self, ref: ObserverRef) -> bool:
        """Forget an observer made here; False when it was not (or no longer) ours."""
        oid = ref.observer_id
        return oid.owner == self.owner and self._mine.pop(oid.local_id, None) is not None

    def close(self) -> None:
        """Dispose of every observer made here and stop their running calls."""
        self.closed = True
        self._mine.clear()
        for task in [*self._tasks, *self._serving.values()]:
            task.cancel()

    # --- the ObserverCaller protocol (grains/observer.py) -----------------------------
    async def dispose_observer(self, ref: ObserverRef) -> None:
        if ref.observer_id.owner != self.owner:
            raise ValueError(f"observer {ref.observer_id} was made by another process: only it can dispose of it")
        self.dispose_nowait(ref)

    def is_gone(self, exc: BaseException) -> bool:
        return isinstance(exc, errors.ObserverGoneError)

    async def invoke_observer(
        self, ref: ObserverRef, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None, one_way: bool
    ) -> Any:
        self._calls_out += 1
        timeout_s = ref.timeout_s if ref.timeout_s is not None else self._timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        oid = ref.observer_id
        try:
            if oid.owner == self.owner:
                args = self._copy(args)
                kwargs = self._copy(kwargs) if kwargs else None
                call = Call(GrainId(OBSERVER_TYPE, str(oid)), method, args, kwargs, timeout_s, CALL_CHAIN.get())
                if one_way:
                    self._spawn_one_way(call, deadline, "this process")
                    return None
                return self._copy(await self.serve(call, deadline))
            return await self._remote(ref, method, args, kwargs, deadline, one_way)
        except errors.ObserverGoneError:
            self._gone += 1
            raise

    # --- the way out ------------------------------------------------------------------
    async def _remote(
        self,
        ref: ObserverRef,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        deadline: float,
        one_way: bool,
    ) -> Any:
        """Send a call to an observer made elsewhere (ObserverGoneError when no way is left)."""
        oid = ref.observer_id
        key = str(oid)
        transport = self._transport
        if transport is None:
            raise errors.ObserverGoneError(key, "this process has no network to reach it")
        client = oid.client
        if client is None:
            try:
                silo = SiloAddress.parse(oid.owner)
            except ValueError as exc:
                raise errors.ObserverGoneError(key, f"owner {oid.owner!r} is neither a client nor a silo") from exc
            conn = await self._connect(transport, silo.endpoint, oid, deadline)
            return await self._send(conn, key, method, args, kwargs, deadline, one_way, 0)
        back = transport.client_connection(client)
        if back is not None:
            return await self._send(back, key, method, args, kwargs, deadline, one_way, 0)
        # Not connected to us: through a silo it was connected to (a client never dials another),
        # the next one if that one has lost it too.
        gone = errors.ObserverGoneError(key, "its client has no connection to this process (closed, or it died)")
        for gateway in ref.gateways:
            if gateway == self._endpoint:
                continue  # that is us, and we have no connection from it
            try:
                conn = await self._connect(transport, gateway, oid, deadline)
                return await self._send(conn, key, method, args, kwargs, deadline, one_way, 0)
            except errors.ObserverGoneError as exc:
                gone = exc
        raise gone

    async def _connect(self, transport: Transport, endpoint: str, oid: ObserverId, deadline: float) -> Connection:
        conn = transport.connection_nowait(endpoint)
        if conn is not None:
            return conn
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(asyncio.shield(transport.connect(endpoint)), max(remaining, 0.0))
        except TimeoutError:
            raise errors.GrainTimeoutError(str(oid), "(connect)", remaining) from None
        except (errors.SiloUnavailableError, errors.SiloClosedError) as exc:
            raise errors.ObserverGoneError(str(oid), f"cannot reach {endpoint}: {exc}") from exc

    async def _send(
        self,
        conn: Connection,
        key: str,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        deadline: float,
        one_way: bool,
        hops: int,
    ) -> Any:
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise errors.GrainTimeoutError(key, method, 0.0)
        body = request_body(args, kwargs)
        try:
            if one_way:
                conn.send_one_way(encode_request(ONEWAY, OBSERVER_TYPE, key, method, remaining, (), hops), body)
                return None
            if not conn.has_slot():
                try:
                    await conn.wait_slot(deadline)
                except TimeoutError:
                    raise errors.GrainTimeoutError(key, method, remaining) from None
                remaining = deadline - loop.time()
            header = encode_request(REQUEST, OBSERVER_TYPE, key, method, remaining, CALL_CHAIN.get(), hops)
            return await conn.request(header, body, remaining, (key, method))
        except errors.SiloNotServingError as exc:
            raise errors.ObserverGoneError(key, f"its silo is stopping ({exc.detail})") from exc
        except errors.SiloUnavailableError as exc:
            # Lost before or while it ran: the client (or silo) that made it is gone.
            raise errors.ObserverGoneError(key, f"connection lost ({exc.detail or exc})") from exc

    # --- the way in -------------------------------------------------------------------
    async def serve(self, call: Call, deadline: float) -> Any:
        """Run a call to an observer made here, or relay it to the client it belongs to.

        The silo's dispatcher calls this for target ``$observer``; on a client,
        :meth:`on_frame` does.
        """
        key, method = call.grain.key, call.method
        try:
            oid = ObserverId.parse(key)
        except ValueError as exc:
            raise errors.CodecError(str(exc)) from None
        if oid.owner != self.owner:
            return await self._relay(oid, call, deadline)
        entry = self._mine.get(oid.local_id)
        if entry is not None and not entry.alive():
            del self._mine[oid.local_id]
            entry = None
        if entry is None:
            raise errors.ObserverGoneError(key, "disposed")
        if method not in entry.methods:
            raise errors.UnknownMethodError(f"{key} ({type(entry.handler).__qualname__})", method, kind="observer")
        self._calls_in += 1
        fn = getattr(entry.handler, method)
        # The handler's calls carry the caller's chain, as a grain's turn does: one back into the
        # grain that is waiting on this notification is a DeadlockError at once, not a hang.
        token = CALL_CHAIN.set(call.chain)
        try:
            async with asyncio.timeout_at(deadline):
                return await (fn(*call.args, **call.kwargs) if call.kwargs else fn(*call.args))
        except TimeoutError:
            raise errors.GrainTimeoutError(key, method, call.timeout_s or 0.0) from None
        finally:
            CALL_CHAIN.reset(token)

    async def _relay(self, oid: ObserverId, call: Call, deadline: float) -> Any:
        """A call for a client connected to this silo, from a silo it is not connected to."""
        client = oid.client
        conn = self._transport.client_connection(client) if client is not None and self._transport is not None else None
        if conn is None or call.hops >= MAX_RELAY_HOPS:
            why = "its client has no connection to this silo" if client is not None else "made by a process replaced since"
            raise errors.ObserverGoneError(str(oid), why)
        self._relayed += 1
        return await self._send(conn, str(oid), call.method, call.args, call.kwargs, deadline, False, call.hops + 1)

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        """A client's handler of requests on its connections: calls to its observers."""
        header = frame.header
        kind = header[0]
        if len(header) < 2 or not isinstance(header[1], int):
            raise errors.CodecError(f"frame header without a request id: {header!r:.100}")
        track = (id(conn), header[1])
        if kind == CANCEL:
            task = self._serving.get(track)
            if task is not None:
                task.cancel()
            return
        if kind not in (REQUEST, ONEWAY):
            return
        req_id = header[1]
        try:
            call = decode_request(header, frame, conn.codec)
            if call.grain.type_name != OBSERVER_TYPE:
                raise errors.UnknownGrainError(call.grain.type_name, "a client hosts observers only")
        except errors.RedgrainError as exc:
            if kind == REQUEST:
                conn.send_error(req_id, exc)
            return
        deadline = asyncio.get_running_loop().time() + (call.timeout_s or 0.0)
        if kind == ONEWAY:
            self._spawn_one_way(call, deadline, conn.peer)
            return
        task = asyncio.get_running_loop().create_task(self.serve(call, deadline))
        self._serving[track] = task
        task.add_done_callback(lambda t: self._answer(conn, req_id, track, call, t))

    def _answer(self, conn: Connection, req_id: int, track: tuple[int, int], call: Call, task: asyncio.Task[Any]) -> None:
        # Every request is answered once, even a cancelled one: the connection counts those it serves.
        self._serving.pop(track, None)
        try:
            if task.cancelled():
                conn.send_error(req_id, errors.GrainTimeoutError(call.grain.key, call.method, call.timeout_s or 0.0))
            elif task.exception() is not None:
                conn.send_error(req_id, task.exception())  # type: ignore[arg-type]
            else:
                conn.send_response(req_id, task.result())
        except errors.SiloError:
            pass  # the silo that asked is gone: nobody to answer

    def _spawn_one_way(self, call: Call, deadline: float, peer: str) -> None:
        call = call._replace(chain=())  # nobody waits on a one-way call: calling back is no cycle

        async def run() -> None:
            try:
                await self.serve(call, deadline)
            except Exception as exc:  # noqa: BLE001 - nobody waits for the answer: log and count it
                self._one_way_failed += 1
                log.warning("one-way call %s.%s from %s failed: %s: %s", call.grain.key, call.method, peer,
                            type(exc).__name__, exc)  # fmt: skip

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _copy(self, value: Any) -> Any:
        if type(value) in SCALARS or value is None:
            return value
        return self._codec.copy(value)

    # --- the codec's ObserverBinding --------------------------------------------------
    def bind(
        self, observer_id: ObserverId, methods: frozenset[str], one_way: frozenset[str], gateways: tuple[str, ...]
    ) -> ObserverRef:
        return ObserverRef(self, observer_id, methods, one_way, gateways)

    def gateways(self, ref: ObserverRef) -> tuple[str, ...]:
        if ref.observer_id.owner != self.owner or self._transport is None or ref.observer_id.client is None:
            return ref.gateways
        return tuple(self._transport.open_endpoints())

    def statistics(self) -> ObserverStatistics:
        return ObserverStatistics(
            observers=len(self._mine),
            calls_out=self._calls_out,
            calls_in=self._calls_in,
            relayed=self._relayed,
            gone=self._gone,
            one_way_failed=self._one_way_failed,
        )
