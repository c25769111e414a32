"""Silo services a grain reaches through its activation: calls, threads, state, reminders."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from grains.base import Grain
from grains.ids import GrainId
from grains.placement import grain_options
from grains.ref import GrainRef, build_ref_class, ref_class_for
from silo import errors
from silo.catalog.evolution import StateLoader
from silo.catalog.state import StateHandle
from silo.codec import Codec
from silo.storage.store import StateStore

if TYPE_CHECKING:
    from silo.catalog.activation import Activation
    from silo.cluster.reminders import ReminderService
    from silo.messaging.manifests import Manifests
    from silo.storage.checkpoint import Checkpoints

R = TypeVar("R")


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

    def get_grain(self, grain: type[Grain] | str, key: Any) -> Any:
        if isinstance(grain, str):
            info = self._manifests.get_nowait(grain)
            if info is None:
                known = self._classes.get(grain)  # a class of that name was used here already
                if known is None:
                    raise errors.UnknownGrainError(grain, "no silo has published it yet")
                return ref_class_for(known)(self._caller, GrainId.of(grain, key))
            ref_cls = self._by_name.get(grain)
            # Rebuilt when the manifests changed: a version that joined since may add methods.
            if ref_cls is None or ref_cls._methods != info.methods:
                ref_cls = self._by_name[grain] = build_ref_class(grain, info.methods, one_way=info.one_way)
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
        store: StateStore,
        codec: Codec,
        threads: int,
        view: Any = None,
        redis: Any = None,
        keys: Any = None,
        checkpoints: Checkpoints | None = None,
        reminders: ReminderService | None = None,
    ) -> None:
        self.view = view
        """The silo's MembershipView (who is in the cluster)."""
        self.redis = redis
        """The silo's asyncio Redis client, for built-in grains that publish (training progress)."""
        self.keys = keys
        """The cluster's key builder (silo/keys.py)."""
        self.device = device
        self._refs = refs
        self._store = store
        self._codec = codec
        self._state_loader = StateLoader(codec)
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="redgrain-grain")
        self._checkpoints = checkpoints
        self._reminders = reminders

    def get_grain(self, grain: Any, key: Any) -> Any:
        return self._refs.get_grain(grain, key)

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

    def checkpoints(self) -> Checkpoints:
        """The silo's ``silo.storage.checkpoint.Checkpoints`` (snapshots of grain groups)."""
        if self._checkpoints is None:
            raise errors.ConfigError("checkpoints are not available on this silo")
        return self._checkpoints

    def state_handle(self, activation: Activation) -> StateHandle:
        return StateHandle(activation, self._store, self._codec, self._state_loader)

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


