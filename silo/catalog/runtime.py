"""Silo services a grain reaches through its activation: calls, threads, state, reminders."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from grains.base import Grain
from grains.ids import GrainId
from grains.observer import ObserverRef
from grains.placement import grain_options
from grains.ref import GrainRef, Ref, build_by_name_ref_class, ref_class_for, stream_methods
from silo import errors
from silo.catalog.activation_state import ActivationState
from silo.catalog.evolution import StateLoader
from silo.catalog.pipeline import OutgoingFilter, filtered_caller
from silo.catalog.state import StateHandle
from silo.codec import Codec
from silo.storage.provider import REDIS, StorageProviders
from silo.storage.store import StateStore

if TYPE_CHECKING:
    from silo.catalog.activation import Activation
    from silo.cluster.reminders import ReminderService
    from silo.messaging.manifests import Manifests
    from silo.messaging.observer_hub import ObserverHub
    from silo.storage.checkpoint import Checkpoints
    from silo.streams.stream import RedisStream, Streams

R = TypeVar("R")
G = TypeVar("G", bound=Grain)


class RefFactory:
    """Builds grain references for a caller; shared by the silo runtime and the client."""

    def __init__(self, caller: Any, manifests: Manifests, codec: Codec) -> None:
        self._caller = caller
        self._manifests = manifests
        self._codec = codec
        self._by_name: dict[str, type[GrainRef]] = {}
        self._classes: dict[str, type[Grain]] = {}
        """Type name -> the grain class first used for it here (what a ref by that name falls back to)."""
        self._registered: set[type[Grain]] = set()

    @property
    def caller(self) -> Any:
        """What the references send their calls through."""
        return self._caller

    def with_caller(self, caller: Any) -> RefFactory:
        """The same factory sending through another caller (outgoing filters wrapped around it)."""
        return RefFactory(caller, self._manifests, self._codec)

    async def _resolve(self, type_name: str, method: str) -> bool:
        """A by-name reference's method it did not know when it was made: whether it is one-way,
        once the manifests (read again, bounded, if need be) have it."""
        info = await self._manifests.with_method(type_name, method)
        return method in info.one_way

    @overload
    def get_grain(self, grain: type[G], key: Any) -> Ref[G]: ...
    @overload
    def get_grain(self, grain: str, key: Any) -> GrainRef: ...
    def get_grain(self, grain: type[Grain] | str, key: Any) -> GrainRef:
        """``Ref[G]`` for a grain class; a plain ``GrainRef`` for a type name, whose methods
        are those the silos published for it (the static type cannot know them), looked up
        again when a name it lacks is called: a type published after it was made works then."""
        if isinstance(grain, str):
            info = self._manifests.get_nowait(grain)
            methods: frozenset[str] = frozenset()
            one_way: frozenset[str] = frozenset()
            streams: frozenset[str] = frozenset()
            if info is not None:
                methods, one_way, streams = info.methods, info.one_way, info.streams
            elif (known := self._classes.get(grain)) is not None:  # a class of that name used here
                methods, one_way = ref_class_for(known)._methods, frozenset(grain_options(known).one_way)
                streams = frozenset(stream_methods(known))
            ref_cls = self._by_name.get(grain)
            # Rebuilt when what we know changed (the known methods are the fast path); a name
            # the class lacks is looked up when called (a type or version published since).
            if ref_cls is None or ref_cls._methods != methods:
                ref_cls = self._by_name[grain] = build_by_name_ref_class(grain, methods, one_way, self._resolve, streams)
            return ref_cls(self._caller, GrainId.of(grain, key))
        if not (isinstance(grain, type) and issubclass(grain, Grain)):
            raise TypeError(f"get_grain wants a Grain subclass or a type name, not {grain!r}")
        name = grain_options(grain).type_name
        # Per class, not per type name: two versions of one type (a rolling upgrade) have
        # different methods, and each class's ref has exactly its own.
        if grain not in self._registered:
            self._codec.registry.register_annotations(grain)
            self._registered.add(grain)
            self._classes.setdefault(name, grain)
        return ref_class_for(grain)(self._caller, GrainId.of(name, key))


class SiloRuntime:
    """The ``Runtime`` of catalog.py for one silo."""

    def __init__(
        self,
        *,
        device: str,
        refs: RefFactory,
        store: StateStore | StorageProviders,
        codec: Codec,
        threads: int,
        view: Any = None,
        redis: Any = None,
        keys: Any = None,
        checkpoints: Checkpoints | None = None,
        reminders: ReminderService | None = None,
        outgoing_filters: list[OutgoingFilter] | None = None,
        observers: ObserverHub | None = None,
        streams: Streams | None = None,
    ) -> None:
        self.view = view
        """The silo's MembershipView (who is in the cluster)."""
        self.redis = redis
        """The silo's asyncio Redis client, for built-in grains that publish (training progress)."""
        self.keys = keys
        """The cluster's key builder (silo/keys.py)."""
        self.device = device
        self._refs = refs
        self.stores = store if isinstance(store, StorageProviders) else StorageProviders({REDIS: store})
        """The storage providers by name (a lone store given stands in for "redis")."""
        self._codec = codec
        self._outgoing = list(outgoing_filters or [])
        self._refs_by_type: dict[str, RefFactory] = {}
        self._state_loader = StateLoader(codec)
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="redgrain-grain")
        self._checkpoints = checkpoints
        self._reminders = reminders
        self.observers = observers
        """The silo's observer hub (grains' ``self.observer``)."""
        self._streams = streams

    def get_grain(self, grain: Any, key: Any, source: Activation | None = None) -> Any:
        """A reference for a call from ``source`` (an activation: its calls run the outgoing filters)."""
        if source is None:
            return self._refs.get_grain(grain, key)
        refs = self._refs_by_type.get(source.options.type_name)
        if refs is None:
            # Built once per calling grain type: a type with no outgoing filter, in a silo with
            # none, shares the plain factory and its calls cost nothing more.
            chain = [*source.options.outgoing_filters, *self._outgoing]
            refs = self._refs if not chain else self._refs.with_caller(filtered_caller(self._refs.caller, chain))
            self._refs_by_type[source.options.type_name] = refs
        return refs.get_grain(grain, key)

    def cluster_members(self, type_name: str | None = None) -> list[Any]:
        """Active silos' membership rows (those hosting ``type_name``, when given)."""
        if self.view is None:
            return []
        return list(self.view.hosting(type_name) if type_name else self.view.active())

    async def refresh_cluster_members(self) -> None:
        """Read the membership table now (the view otherwise refreshes on its own schedule)."""
        if self.view is not None:
            await self.view.refresh()

    async def run_in_thread(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, **kwargs) if kwargs else functools.partial(fn, *args)
        return await loop.run_in_executor(self._executor, call)

    def reminders(self) -> ReminderService:
        """The silo's reminder service (durable periodic calls)."""
        if self._reminders is None:
            raise errors.ConfigError("reminders are not available on this silo")
        return self._reminders

    def stream(self, namespace: str, key: Any) -> RedisStream:
        """A handle on stream ``(namespace, key)`` (silo/streams/)."""
        if self._streams is None:
            raise errors.ConfigError("streams need Redis: not available on this silo (the in-process harness)")
        return self._streams.stream(namespace, key)

    def checkpoints(self) -> Checkpoints:
        """The silo's ``silo.storage.checkpoint.Checkpoints`` (snapshots of grain groups)."""
        if self._checkpoints is None:
            raise errors.ConfigError("checkpoints are not available on this silo")
        return self._checkpoints

    def observer(self, activation: Activation, handler: object) -> ObserverRef:
        """An observer owned by ``activation``: gone once it stops (grains/observer.py)."""
        if self.observers is None:
            raise errors.ConfigError("observers are not available on this silo")
        live = (ActivationState.ACTIVATING, ActivationState.ACTIVE, ActivationState.DEACTIVATING)
        return self.observers.create(handler, alive=lambda: activation.status in live)

    def state_handle(self, activation: Activation) -> StateHandle:
        return StateHandle(activation, self.stores.get(activation.options.storage), self._codec, loader=self._state_loader)

    def named_state_handle(
        self, activation: Activation, name: str, model: type[Any], storage: str | None
    ) -> StateHandle:
        store = self.stores.get(storage if storage is not None else activation.options.storage)
        return StateHandle(activation, store, self._codec, model, name, loader=self._state_loader)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def resolve_device(setting: str) -> str:
    """``auto`` picks cuda when torch sees a GPU, else cpu."""
    if setting == "auto":
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            return "cpu"
    if setting not in ("cpu", "cuda") and not setting.startswith("cuda:"):
        raise errors.ConfigError(f"device must be auto, cpu or cuda, not {setting!r}")
    return setting


