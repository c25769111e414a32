"""Incoming calls on a silo: find or create the activation, queue the call, answer.

Requests arrive from the transport (remote callers) or straight from the
router (calls between grains of this silo). A call that reaches a silo that
does not own the grain is forwarded to the owner (at most two hops); a call
that was queued on an activation that then went away is re-routed, never
dropped.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.catalog import Activation, Catalog, Invocation, Reroute
from silo.grain_types import GrainTypes
from silo.transport import CANCEL, ONEWAY, REQUEST, Connection, Frame

if TYPE_CHECKING:
    from silo.router import Router

log = logging.getLogger("redgrain.dispatcher")

MAX_HOPS = 2
MAX_REROUTES = 5


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


class Dispatcher:
    def __init__(self, *, address: SiloAddress, catalog: Catalog, types: GrainTypes, router: Router) -> None:
        self.address = address
        self._catalog = catalog
        self._types = types
        self._router = router
        self._in_flight: dict[tuple[int, int], Invocation] = {}
        self._requests = self._forwarded = self._rerouted = self._errors = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False
        catalog.on_reroute = self._reroute_queued

    # --- from the transport ------------------------------------------------
    def on_frame(self, conn: Connection, frame: Frame) -> None:
        header = frame.header
        kind = header[0]
        if kind == CANCEL:
            inv = self._in_flight.get((id(conn), header[1]))
            if inv is not None and not inv.future.done():
                inv.cancelled = True
                if inv.activation is not None:
                    inv.activation.cancel_call(inv)
            return
        if kind not in (REQUEST, ONEWAY):
            return
        self._requests += 1
        req_id = header[1]
        try:
            _, _, type_name, key, method, timeout_ms, chain, hops = header[:8]
            grain = GrainId(str(type_name), str(key))
            body = conn.codec.decode(frame.meta, frame.buffers)
            if isinstance(body, tuple) and len(body) == 2 and isinstance(body[1], dict) and isinstance(body[0], tuple):
                args, kwargs = body
            elif isinstance(body, (tuple, list)):
                args, kwargs = tuple(body), None
            else:
                raise errors.CodecError(f"request body must be an argument tuple, got {type(body).__name__}")
            deadline = asyncio.get_running_loop().time() + float(timeout_ms) / 1000.0
        except (errors.CodecError, ValueError, TypeError) as exc:
            self._errors += 1
            err = exc if isinstance(exc, errors.CodecError) else errors.CodecError(f"malformed request: {exc}")
            conn.send_error(req_id, err)
            return
        task = asyncio.get_running_loop().create_task(
            self._serve(conn, req_id, grain, str(method), args, kwargs, deadline, tuple(chain or ()), int(hops))
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(
        self,
        conn: Connection,
        req_id: int,
        grain: GrainId,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        deadline: float,
        chain: tuple[str, ...],
        hops: int,
    ) -> None:
        try:
            result = await self.dispatch(grain, method, args, kwargs, deadline, chain, hops, (id(conn), req_id))
        except Exception as exc:
            self._errors += 1
            conn.send_error(req_id, exc)
        else:
            conn.send_response(req_id, result)

    # --- the local entry point (router calls this for grains on this silo) --
    async def dispatch(
        self,
        grain: GrainId,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        deadline: float,
        chain: tuple[str, ...],
        hops: int,
        track: tuple[int, int] | None = None,
    ) -> Any:
        if self.closed:
            raise errors.SiloUnavailableError(str(self.address), "silo is stopping")
        options = self._types.options(grain.type_name)  # UnknownGrainError if not hosted here
        if method not in self._types.methods(grain.type_name):
            raise errors.UnknownMethodError(grain.type_name, method)
        loop = asyncio.get_running_loop()
        for _ in range(MAX_REROUTES):
            if options.stateless_worker:
                act = self._catalog.stateless_worker(grain, options) or await self._catalog.activate_worker(grain)
            else:
                found = await self._catalog.get_or_activate(grain)
                if isinstance(found, SiloAddress):
                    if hops >= MAX_HOPS:
                        raise errors.SiloUnavailableError(str(found), f"{grain} still not found after {hops} hops")
                    self._forwarded += 1
                    return await self._router.forward(found, grain, method, args, kwargs, deadline, chain, hops + 1)
                act = found
            inv = Invocation(
                method=method,
                args=args,
                kwargs=kwargs,
                chain=chain,
                deadline=deadline,
                future=loop.create_future(),
                interleave=method in options.interleave,
                read_only=method in options.read_only,
            )
            if track is not None:
                self._in_flight[track] = inv
                inv.activation = act
            try:
                act.enqueue(inv)
                return await inv.future
            except Reroute:
                self._rerouted += 1
                continue
            finally:
                if track is not None:
                    self._in_flight.pop(track, None)
        raise errors.GrainDeactivatedError(str(grain), "re-routed too many times")

    def _reroute_queued(self, act: Activation, queued: list[Invocation]) -> None:
        # The callers' dispatch() loops see Reroute and look the grain up again.
        for inv in queued:
            if not inv.future.done():
                inv.future.set_exception(Reroute())

    async def close(self) -> None:
        self.closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def statistics(self) -> DispatcherStatistics:
        return DispatcherStatistics(
            requests=self._requests,
            forwarded=self._forwarded,
            rerouted=self._rerouted,
            errors=self._errors,
            in_flight=len(self._tasks),
        )
