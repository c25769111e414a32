"""One silo's catalog in-process, on the twins: grain tests without Redis or TCP.

:class:`InProcessSilo` assembles what a silo runs a call with (grain types,
codec, :class:`~silo.catalog.catalog.Catalog`, the runtime services, the
dispatcher) over the in-memory directory and state store, and replaces the
router (directory lookups, placement, the network) with a caller that hands
every call straight to this silo's dispatcher. Calls between grains take the
same way, carrying their call chain, so turn order, reentrancy, deadlock
detection, re-routing after a deactivation, idle collection, timers and
state conflicts behave as on a real silo::

    async with InProcessSilo([Counter], clock=clock) as silo:
        counter = silo.get_grain(Counter, "c")
        assert await counter.add(2) == 2
        await clock.advance(silo.settings.idle_timeout_s)
        ...

With a :class:`~silo.testing.clock.VirtualClock` installed and passed as
``clock``, idle collection and timers follow virtual time.

Every grain lives on this one silo: a call the directory says belongs to
another silo (a test registered one there) fails with SiloUnavailableError.
This module is the one place that knows how a silo wires its catalog, so a
change to that wiring is mended here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

from grains.base import DeactivationReason, Grain
from grains.call import Call
from grains.ids import GrainId, SiloAddress
from silo import errors
from silo.catalog.catalog import Catalog
from silo.catalog.grain_types import GrainTypes
from silo.catalog.runtime import RefFactory, SiloRuntime
from silo.codec import Codec, TypeRegistry
from silo.keys import Keys
from silo.messaging.dispatcher import Dispatcher
from silo.messaging.router import Manifests, TypeInfo
from silo.settings import CatalogSettings
from silo.testing.directory import InMemoryGrainDirectory
from silo.testing.store import InMemoryStateStore

if TYPE_CHECKING:
    from silo.catalog.activation import Activation

ADDRESS = SiloAddress("127.0.0.1", 11111, 1)


class _LocalRouter:
    """The router's part for a silo alone: every call goes to its own dispatcher.

    The silo's real router does the same for a grain it finds on its own silo
    (a deadline from the call's timeout, the chain as the reference read it). A
    call the dispatcher forwards to this same silo (the directory named it the
    owner) is served again one hop further, as the real router's trip over the
    network back to its own silo would be.
    """

    def __init__(self, address: SiloAddress, call_timeout_s: float) -> None:
        self.dispatcher: Dispatcher | None = None
        self._address = address
        self._timeout_s = call_timeout_s
        self.calls = 0
        self.forwards = 0

    async def invoke(self, call: Call) -> Any:
        assert self.dispatcher is not None, "InProcessSilo wires the dispatcher before any call"
        timeout = call.timeout_s if call.timeout_s is not None else self._timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        self.calls += 1
        return await self.dispatcher.dispatch(call, deadline)

    async def forward(self, target: SiloAddress, call: Call, deadline: float) -> Any:
        assert self.dispatcher is not None
        if target != self._address:
            raise errors.SiloUnavailableError(
                str(target), f"{call.grain} is registered there; an in-process silo reaches no other"
            )
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise errors.GrainTimeoutError(str(call.grain), call.method, 0.0)
        self.forwards += 1
        return await self.dispatcher.dispatch(call.forwarded(remaining), deadline)


class InProcessSilo:
    """A silo's catalog and dispatcher over the twins, called in-process (see the module docstring).

    ``directory`` and ``store`` default to fresh twins (the store fenced by the
    directory's tokens); pass shared ones to give several tests' worlds one
    backend. ``clock`` is the catalog's clock (idle collection).
    """

    def __init__(
        self,
        grains: Iterable[type[Grain]],
        *,
        clock: Callable[[], float] = time.monotonic,
        settings: CatalogSettings | None = None,
        directory: InMemoryGrainDirectory | None = None,
        store: InMemoryStateStore | None = None,
        address: SiloAddress = ADDRESS,
        call_timeout_s: float = 30.0,
    ) -> None:
        self.address = address
        self.settings = settings or CatalogSettings()
        self.types = GrainTypes(grains)
        registry = TypeRegistry()
        for cls in self.types.classes():
            registry.register_annotations(cls)
        self.codec = Codec(registry)
        self.directory = directory or InMemoryGrainDirectory()
        self.store = store or InMemoryStateStore(owner=self.directory.token_of)
        # Every type is local, so the manifests never read Redis.
        manifests = Manifests(cast(Any, None), Keys("in-process"))
        for name in self.types.names():
            opts = self.types.options(name)
            manifests.add_local(TypeInfo(name, self.types.methods(name), opts.placement, opts.stateless_worker))
        self.router = _LocalRouter(address, call_timeout_s)
        self.refs = RefFactory(self.router, manifests, self.codec)
        self.runtime = SiloRuntime(
            device="cpu",
            refs=self.refs,
            store=self.store,
            codec=self.codec,
            threads=self.settings.thread_pool_size,
        )
        self.catalog = Catalog(
            settings=self.settings,
            silo=address,
            types=self.types,
            directory=self.directory,
            runtime=self.runtime,
            clock=clock,
        )
        self.dispatcher = Dispatcher(
            address=address, catalog=self.catalog, types=self.types, router=cast(Any, self.router)
        )
        self.router.dispatcher = self.dispatcher
        self._started = False

    # --- life ----------------------------------------------------------------------
    async def start(self) -> Self:
        """Start idle collection (every ``collection_interval_s`` of the loop's time)."""
        self.catalog.start()
        self._started = True
        return self

    async def stop(self) -> None:
        """Deactivate every activation (as a silo shutting down does), then stop."""
        if not self._started:
            return
        self._started = False
        await self.catalog.deactivate_all(DeactivationReason.SHUTDOWN)
        await self.catalog.stop()
        await self.dispatcher.close()
        self.runtime.shutdown()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --- calls and activations -------------------------------------------------------
    def get_grain(self, grain: type[Grain] | str, key: Any) -> Any:
        """A reference whose calls come from outside any grain (as a client's do)."""
        return self.refs.get_grain(grain, key)

    def activation(self, ref: Any) -> Activation | None:
        """The live activation of a reference's grain (or a GrainId's), if there is one."""
        grain = ref if isinstance(ref, GrainId) else ref.grain_id
        return self.catalog.get(grain)

    def instance(self, ref: Any) -> Any:
        """The grain object behind a reference (its activation must be live)."""
        act = self.activation(ref)
        if act is None:
            raise LookupError(f"{ref!r} has no live activation on this silo")
        return act.instance

    async def deactivate(self, ref: Any, reason: DeactivationReason = DeactivationReason.REQUESTED) -> None:
        """Deactivate a grain's activation now and wait until it is gone."""
        act = self.activation(ref)
        if act is not None:
            await self.catalog.deactivate(act, reason)
