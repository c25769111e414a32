"""Outgoing calls: find where a grain lives and send the call there.

Shared by silos and clients. The lookup order is: the local cache, the
directory in Redis, then placement over the membership view. A call that
could not be delivered (connection refused, silo dead) is retried against a
fresh lookup; a call that was delivered and then lost its connection fails
with SiloUnavailableError and is *not* retried, since the method may have run
(at-most-once).

A call arrives as one :class:`~grains.call.Call` from the reference; the
router gives it a deadline on this process's clock once, and every attempt
sends the time left (the REQUEST header carries a duration, not a deadline).
With ``tracing`` set, each call also carries the current span's trace context
(:mod:`silo.tracing`); a forwarded call carries the one it came with.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from grains.call import CALL_CHAIN, UNREAD, Call
from grains.ids import GrainId, SiloAddress
from grains.request_context import current as current_entries
from grains.result_stream import StreamChannel
from silo import errors
from silo.catalog.internal import INTERNAL_TURNS
from silo.cluster.versions import compatible, unknown_versions
from silo.messaging.frame import ONEWAY, REQUEST, STREAM
from silo.messaging.manifests import Manifests, TypeInfo
from silo.messaging.request import encode_request, request_body
from silo.messaging.transport import Transport
from silo.records.membership import MemberRow
from silo.shutdown import raise_if_cancelled
from silo.tracing import Carrier, Tracing, call_carrier

if TYPE_CHECKING:
    # Given to the router, never called by name: the directory, the membership view and the
    # placer belong to the cluster (silo/cluster/), which sends through messaging (.importlinter).
    from silo.cluster.directory import GrainDirectory
    from silo.cluster.placement import Placer
    from silo.cluster.view import MembershipView

log = logging.getLogger("redgrain.router")

__all__ = ["LocalDispatch", "Manifests", "Router", "RouterStatistics", "TypeInfo"]

_chain = CALL_CHAIN.get
_new_call = tuple.__new__

RETRY_BACKOFF_S = 0.025
MAX_RETRY_BACKOFF_S = 0.2
SYSTEM_TYPE = "$silo"
"""Reserved grain type of a silo's control surface (activate, activations, move, drain)."""


class LocalDispatch(Protocol):
    """A silo delivers calls to its own grains without the network."""

    address: SiloAddress

    async def dispatch(
        self,
        call: Call,
        deadline: float,
        track: tuple[int, int] | None = None,
        trace: Carrier | None = None,
        *,
        stream: StreamChannel | None = None,
    ) -> Any: ...

    def post(self, call: Call, deadline: float, trace: Carrier | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class RouterStatistics:
    calls: int
    """Calls sent by this router (local and remote)."""
    local_calls: int
    """Calls delivered to this silo's own grains without the network."""
    retries: int
    """Undelivered calls retried after a fresh lookup."""
    placements: int
    """Calls that placed a new activation."""
    cached_locations: int = 0
    """Grain locations in the cache (at most ``directory.cache_size``); some may name dead silos,
    which calls skip: the cache is not swept when a silo dies."""


class Router:
    def __init__(
        self,
        *,
        transport: Transport,
        directory: GrainDirectory,
        view: MembershipView,
        manifests: Manifests,
        placer: Placer,
        call_timeout_s: float,
        stream_window: int = 16,
        local: LocalDispatch | None = None,
        cache_size: int = 1_000_000,
        tracing: Tracing | None = None,
    ) -> None:
        self._transport = transport
        self._directory = directory
        self._view = view
        self._manifests = manifests
        self._placer = placer
        self._timeout_s = call_timeout_s
        self.stream_window = stream_window
        """Items a streamed call's callee may produce ahead of the caller's loop (its credit)."""
        self._local = local
        self._where: OrderedDict[GrainId, SiloAddress] = OrderedDict()
        self._locating: dict[GrainId, asyncio.Future[SiloAddress]] = {}
        self._refused: dict[SiloAddress, errors.AuthenticationError] = {}
        """Silos that failed the cluster-secret handshake: never placed on."""
        self._cache_size = cache_size
        self._calls = self._local_calls = self._retries = self._placements = 0
        self.tracing = tracing
        """Sends the current span's trace context with each call; None (the default): sends none."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """Read at the first call (silo/loop.py: each read of it is a system call on 3.11)."""
        view.on_change(self._on_membership_change)

    def set_local(self, local: LocalDispatch) -> None:
        self._local = local

    def _on_membership_change(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        # The location cache is not swept here: both of its readers skip a silo the view
        # calls dead, and the next locate replaces the entry. A sweep would walk the whole
        # cache (a million entries: ~0.85 s of this loop) on every silo at every death.
        for addr, row in new.items():
            if row.status.value == "Dead":
                was = old.get(addr)
                # A silo that left gracefully closes its own connections once
                # callers stop sending; only a silo declared dead is cut off.
                if was is None or was.status.value not in ("Dead", "ShuttingDown"):
                    # Calls in flight to a silo declared dead (a hung one) fail now
                    # with SiloUnavailableError instead of waiting for their deadline.
                    self._transport.drop(row.silo.endpoint)

    def forget_silo(self, silo: SiloAddress) -> None:
        """Drop every cached location at ``silo`` (walks the cache: for rare events only)."""
        for grain in [g for g, s in self._where.items() if s == silo]:
            del self._where[grain]
        self._directory.invalidate_silo(silo)

    def forget(self, grain: GrainId) -> None:
        self._where.pop(grain, None)
        self._directory.invalidate(grain)

    def _remember(self, grain: GrainId, silo: SiloAddress) -> None:
        self._where[grain] = silo
        if len(self._where) > self._cache_size:
            self._where.popitem(last=False)

    async def locate(self, grain: GrainId, info: TypeInfo, method: str | None = None) -> SiloAddress:
        """Where ``grain`` lives, or where a new activation for a call of ``method`` goes."""
        if info.stateless_worker:
            return await self._place(grain, info, method)
        silo = self._where.get(grain)
        if silo is not None and not self._view.is_dead(silo):
            return silo
        # One lookup per grain at a time: a burst of first calls shares it,
        # and keeps its send order.
        pending = self._locating.get(grain)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[SiloAddress] = asyncio.get_running_loop().create_future()
        self._locating[grain] = fut
        try:
            silo = await self._lookup_or_place(grain, info, method)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()
            raise
        finally:
            self._locating.pop(grain, None)
        fut.set_result(silo)
        return silo

    async def _lookup_or_place(self, grain: GrainId, info: TypeInfo, method: str | None) -> SiloAddress:
        entry = await self._directory.lookup(grain)
        if entry is not None and not self._view.is_dead(entry.silo):
            self._remember(grain, entry.silo)
            return entry.silo
        silo = await self._place(grain, info, method)
        self._remember(grain, silo)
        return silo

    async def _place(self, grain: GrainId, info: TypeInfo, method: str | None = None) -> SiloAddress:
        self._placements += 1
        local = self._local.address if self._local is not None else None
        candidates = await self._candidates(info, method)
        if not candidates:
            # Our view may predate the silos that host this type: read it again once.
            await self._view.refresh()
            candidates = await self._candidates(info, method)
        if not candidates and self._refused:
            raise next(iter(self._refused.values()))
        if not candidates and method is not None and self._view.hosting(info.name):
            hosted = sorted({r.version_of(info.name) for r in self._view.hosting(info.name)})
            raise errors.SiloUnavailableError(
                "", f"no active silo hosts a version of {info.name} with method {method!r} (versions with it: "
                f"{info.versions_with(method)}; versions hosted now: {hosted})"
            )
        return self._placer.place(grain, info.placement, candidates, local)

    async def _candidates(self, info: TypeInfo, method: str | None) -> list[MemberRow]:
        """The silos a new activation for ``method`` may go to: the version rule (silo/cluster/versions.py)."""
        rows = [c for c in self._view.hosting(info.name) if c.silo not in self._refused]
        versions = info.versions
        if len(versions) == 1 and all(r.version_of(info.name) in versions for r in rows):
            return rows  # one version everywhere (no upgrade under way): every silo hosting the type
        for version in unknown_versions(rows, info.name, versions):
            # A silo of a version we have not read yet (it joined after our last read).
            known = await self._manifests.with_version(info.name, version)
            if known is not None:
                versions = known.versions
        return compatible(rows, info.name, versions, method)

    async def newest_version(self, type_name: str, method: str | None) -> int | None:
        """The version a new activation of ``type_name`` for ``method`` gets now (None: no silo has one)."""
        info = self._manifests.get_nowait(type_name)
        if info is None:
            return None
        rows = await self._candidates(info, method)
        return rows[0].version_of(type_name) if rows else None

    async def refresh_membership(self) -> None:
        """Read the membership table now (a silo that just joined may not be in the view yet)."""
        await self._view.refresh()

    async def versions_with(self, type_name: str, method: str) -> list[int]:
        """The versions of ``type_name`` that have ``method`` (manifests re-read, bounded, when
        none does); UnknownMethodError naming the versions known when still none does."""
        return (await self._manifests.with_method(type_name, method)).versions_with(method)

    # --- the Caller protocol used by GrainRef ------------------------------
    async def invoke(self, call: Call, one_way: bool = False, stream: StreamChannel | None = None) -> Any:
        """Deliver ``call`` (the Caller protocol, grains/ref.py): its result; None for a one-way
        call once sent; for a streamed call, None once ``stream`` has its first item or its end
        (within the deadline; a call turned away unrun is retried as any call is)."""
        try:
            grain_id, method, args, kwargs, timeout_s, chain, hops = call  # one unpack: cheaper than seven reads
            if chain is UNREAD:  # as a reference leaves it: the chain of the task this call starts in
                chain = _chain()
                call = _new_call(Call, (grain_id, method, args, kwargs, timeout_s, chain, hops))
            info = self._manifests.get_nowait(grain_id.type_name) or await self._manifests.get(grain_id.type_name)
            placed_for: str | None = method
            if method not in info.methods:
                if method in INTERNAL_TURNS:
                    placed_for = None  # a reminder tick, a stream item: every version takes it
                else:
                    # Maybe a version that joined after we read the manifests (a rolling upgrade).
                    info = await self._manifests.with_method(grain_id.type_name, method)
            timeout = timeout_s if timeout_s is not None else self._timeout_s
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            self._calls += 1
            # Tracing off and no request context: the whole cost on this path is one context-variable
            # read, no Python call (the trace context and the task's entries travel together).
            trace = None if self.tracing is None and current_entries() is None else call_carrier(self.tracing)
            last: Exception | None = None
            attempt = 0
            # Undelivered calls are retried until the deadline: a killed silo is
            # declared dead within about a second, and its grains then re-place.
            while True:
                if attempt:
                    self._retries += 1
                    # Give membership a moment to learn of the death we just saw; a shedding
                    # silo gets jittered waits, so its callers do not come back all at once.
                    backoff = min(RETRY_BACKOFF_S * 2**attempt, MAX_RETRY_BACKOFF_S)
                    if isinstance(last, errors.LoadShedError):
                        backoff *= random.uniform(0.5, 1.0)
                    await asyncio.sleep(min(backoff, max(0.0, deadline - loop.time())))
                attempt += 1
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                if stream is not None:
                    stream.begin(self.stream_window, timeout)
                # Cache hit inline: locate() is a coroutine, a cost on every call.
                target = self._where.get(grain_id) if not info.stateless_worker else None
                if target is None or self._view.is_dead(target):
                    target = await self.locate(grain_id, info, placed_for)
                try:
                    if self._local is not None and target == self._local.address:
                        self._local_calls += 1
                        if one_way:
                            self._local.post(call, deadline, trace)
                            return None
                        if stream is not None:
                            return await self._opened(call, deadline, self._local.dispatch(call, deadline, None, trace, stream=stream))
                        if trace is None:
                            return await self._local.dispatch(call, deadline)
                        return await self._local.dispatch(call, deadline, None, trace)
                    try:
                        conn = self._transport.connection_nowait(target.endpoint) or await self._connect(target, remaining)
                    except errors.SiloUnavailableError as exc:
                        # Not delivered: safe to retry elsewhere. Only this grain's entry
                        # goes (the others at that silo go as their own calls fail, or
                        # are skipped once it is declared dead): no walk of the cache.
                        last = exc
                        self.forget(grain_id)
                        self._view.hint_unreachable(target)
                        continue
                    except errors.AuthenticationError as exc:
                        # A silo outside our secret: never place there again; if the
                        # grain already lives there we cannot reach it, say so.
                        self._refused[target] = exc
                        self.forget_silo(target)
                        entry = await self._directory.lookup(grain_id)
                        if entry is not None and entry.silo == target:
                            raise
                        continue
                    if one_way:
                        # Sent and done: no answer comes, so it takes no in-flight slot.
                        header = encode_request(ONEWAY, grain_id.type_name, grain_id.key, method, remaining, (), hops, trace)
                        conn.send_one_way(header, request_body(args, kwargs))
                        return None
                    if not conn.has_slot():
                        # max_in_flight reached: wait our turn within the deadline, never fail for it.
                        try:
                            await conn.wait_slot(deadline)
                        except TimeoutError:
                            raise errors.GrainTimeoutError(str(grain_id), method, timeout) from None
                        except errors.SiloUnavailableError as exc:
                            last = exc  # lost while we waited, nothing sent: reconnect and retry
                            continue
                        remaining = deadline - loop.time()
                    if stream is not None:
                        return await self._open_stream(conn, call, remaining, deadline, stream, trace)
                    # send() inlined: one coroutine frame fewer on every call.
                    header = encode_request(REQUEST, grain_id.type_name, grain_id.key, method, remaining, chain, hops, trace)
                    try:
                        return await conn.request(header, request_body(args, kwargs), remaining, (grain_id, method))
                    except errors.GrainTimeoutError as exc:
                        raise errors.GrainTimeoutError(str(grain_id), method, remaining) from exc
                    except asyncio.CancelledError:
                        # The caller gave up: the callee's turn is cancelled (or its queued call
                        # dropped) by the CANCEL a deadline sends. header[1]: the request's id.
                        conn.cancel(header[1])
                        raise
                except errors.SiloNotServingError as exc:
                    # Turned away before any grain code ran (draining, fenced, or its version of
                    # the type cannot serve the method: VersionMismatchError): retry.
                    last = exc
                    self.forget(grain_id)
                    continue
                except errors.LoadShedError as exc:
                    # Shed unrun (a connection or mailbox over its limit): back off and retry.
                    last = exc
                    continue
            if last is not None and not isinstance(last, errors.LoadShedError):
                raise last
            raise errors.GrainTimeoutError(str(grain_id), method, timeout) from last
        except Exception:
            # A cancellation that a command underneath swallowed (redis-py on 3.11 can turn one
            # into a timeout: silo/shutdown.py) must not come back as an ordinary error that a
            # caller's retry loop absorbs and goes on: the task was asked to end.
            raise_if_cancelled()
            raise

    async def _open_stream(
        self, conn: Any, call: Call, remaining: float, deadline: float, stream: StreamChannel, trace: Carrier | None
    ) -> None:
        """Send a streamed call on ``conn``; return once ``stream`` has its first item or its end."""
        grain, method, args, kwargs, _, chain, hops = call
        header = encode_request(STREAM, grain.type_name, grain.key, method, remaining, chain, hops, trace)
        req_id = conn.open_stream(header, request_body(args, kwargs), stream, (grain, method))
        try:
            await self._opened(call, deadline, stream.opened())
        except BaseException:
            conn.cancel(req_id)  # the caller gave up, or the deadline passed: CANCEL, as for any call
            raise

    async def _opened(self, call: Call, deadline: float, opening: Any) -> None:
        """Await a stream's opening within the call's deadline (GrainTimeoutError past it)."""
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                await opening
        except TimeoutError:
            if not scope.expired():
                raise  # the callee's own error
            raise errors.GrainTimeoutError(str(call.grain), call.method, call.timeout_s or self._timeout_s) from None

    async def system_call(
        self, silo: SiloAddress, method: str, args: tuple[Any, ...] = (), timeout_s: float | None = None
    ) -> Any:
        """Call a silo's own control surface (activate, activations, move, drain), not a grain."""
        timeout = timeout_s if timeout_s is not None else self._timeout_s
        call = Call(GrainId(SYSTEM_TYPE, str(silo)), method, args, None, timeout)
        if self._local is not None and silo == self._local.address:
            return await self._local.dispatch(call, asyncio.get_running_loop().time() + timeout)
        conn = await self._connect(silo, timeout)
        return await self.send(conn, call)

    async def activate(self, grain: GrainId, target: SiloAddress | None = None, timeout_s: float = 10.0) -> str:
        """Make sure ``grain`` has an activation (on ``target`` if it has none yet); its silo."""
        if target is None:
            info = self._manifests.get_nowait(grain.type_name) or await self._manifests.get(grain.type_name)
            target = await self.locate(grain, info)
        return str(await self.system_call(target, "activate", (str(grain),), timeout_s))

    async def send(self, conn: Any, call: Call, trace: Carrier | None = None) -> Any:
        """Send ``call`` on ``conn`` and wait for its answer (``call.timeout_s``, else the default)."""
        grain, method = call.grain, call.method
        timeout_s = call.timeout_s if call.timeout_s is not None else self._timeout_s
        if not conn.has_slot():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            try:
                await conn.wait_slot(deadline)
            except TimeoutError:
                raise errors.GrainTimeoutError(str(grain), method, timeout_s) from None
            timeout_s = max(deadline - loop.time(), 0.001)
        header = encode_request(REQUEST, grain.type_name, grain.key, method, timeout_s, call.chain, call.hops, trace)
        fut = conn.request(header, request_body(call.args, call.kwargs), timeout_s, label=(grain, method))  # formatted only on timeout
        try:
            return await fut
        except errors.GrainTimeoutError as exc:
            raise errors.GrainTimeoutError(str(grain), method, timeout_s) from exc
        except asyncio.CancelledError:
            conn.cancel(header[1])
            raise

    async def forward(
        self,
        target: SiloAddress,
        call: Call,
        deadline: float,
        trace: Carrier | None = None,
        *,
        stream: StreamChannel | None = None,
    ) -> Any:
        """Relay a call that reached the wrong silo to the directory's winner, one hop further
        (``trace`` as it came); a streamed call is opened there for ``stream``."""
        self._remember(call.grain, target)
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise errors.GrainTimeoutError(str(call.grain), call.method, 0.0)
        conn = await self._connect(target, remaining)
        if stream is not None:
            stream.begin(self.stream_window, call.timeout_s or self._timeout_s)
            return await self._open_stream(conn, call.forwarded(remaining), remaining, deadline, stream, trace)
        return await self.send(conn, call.forwarded(remaining), trace)

    async def _connect(self, silo: SiloAddress, timeout_s: float) -> Any:
        """The connection to ``silo``, waited for no longer than the call's time left.

        Opening one to a host behind a partition hangs until connect_timeout_s,
        which may be past the call's deadline; the attempt goes on (shielded) for
        whoever asks next.
        """
        try:
            return await asyncio.wait_for(asyncio.shield(self._transport.connect(silo.endpoint)), max(timeout_s, 0.0))
        except TimeoutError as exc:
            raise errors.SiloUnavailableError(str(silo), f"cannot connect within the call's deadline ({timeout_s:.2f}s)") from exc

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            calls=self._calls,
            local_calls=self._local_calls,
            retries=self._retries,
            placements=self._placements,
            cached_locations=len(self._where),
        )


