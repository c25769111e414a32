"""The grain classes one silo may host: its allow-list, built from module names.

A call for a type the silo was not started with is refused with
UnknownGrainError; nothing is imported on demand.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

from grains.base import Grain
from grains.placement import GrainOptions, grain_options
from grains.ref import public_methods, stream_methods
from silo import errors


class GrainTypes:
    """Type name -> grain class, for one silo or client (never process-global)."""

    def __init__(self, classes: Iterable[type[Grain]] = ()) -> None:
        self._classes: dict[str, type[Grain]] = {}
        self._methods: dict[str, frozenset[str]] = {}
        self._streams: dict[str, frozenset[str]] = {}
        self._awaited: dict[str, frozenset[str]] = {}
        self._options: dict[str, GrainOptions] = {}
        for cls in classes:
            self.add(cls)

    @classmethod
    def from_modules(cls, modules: Iterable[str]) -> GrainTypes:
        types = cls()
        for name in modules:
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                raise errors.ConfigError(f"cannot import grain module {name!r}: {exc}") from exc
            # A module's own Grain classes, plus those its __all__ names: a package may
            # export grains defined in its submodules, loaded on first use (PEP 562).
            exported = [getattr(module, n, None) for n in getattr(module, "__all__", ())]
            found = list(
                dict.fromkeys(
                    obj
                    for obj in [*vars(module).values(), *exported]
                    if inspect.isclass(obj)
                    and issubclass(obj, Grain)
                    and obj is not Grain
                    and (obj.__module__ == module.__name__ or obj in exported)
                    and not inspect.isabstract(obj)
                )
            )
            if not found:
                raise errors.ConfigError(f"module {name!r} defines no Grain subclasses")
            for grain_cls in found:
                types.add(grain_cls)
        return types

    def add(self, cls: type[Grain]) -> None:
        name = grain_options(cls).type_name
        existing = self._classes.get(name)
        if existing is not None and existing is not cls:
            raise errors.ConfigError(
                f"two grain classes claim type name {name!r}: "
                f"{existing.__module__}.{existing.__qualname__} and {cls.__module__}.{cls.__qualname__}"
            )
        self._classes[name] = cls

    def resolve(self, type_name: str) -> type[Grain]:
        try:
            return self._classes[type_name]
        except KeyError:
            raise errors.UnknownGrainError(type_name, "not hosted by this silo") from None

    def options(self, type_name: str) -> GrainOptions:
        # Read on every call a silo serves: one dict lookup, not two calls.
        cached = self._options.get(type_name)
        if cached is None:
            cached = self._options[type_name] = grain_options(self.resolve(type_name))
        return cached

    def methods(self, type_name: str) -> frozenset[str]:
        cached = self._methods.get(type_name)
        if cached is None:
            cached = self._methods[type_name] = frozenset(public_methods(self.resolve(type_name)))
        return cached

    def awaited(self, type_name: str) -> frozenset[str]:
        """The type's methods that are awaited (all but the streamed ones): a silo's fast path
        takes these, a streamed call goes the full way."""
        cached = self._awaited.get(type_name)
        if cached is None:
            cached = self._awaited[type_name] = self.methods(type_name) - self.streams(type_name)
        return cached

    def streams(self, type_name: str) -> frozenset[str]:
        """The type's methods written as async generators (their results are streamed)."""
        cached = self._streams.get(type_name)
        if cached is None:
            cached = self._streams[type_name] = stream_methods(self.resolve(type_name))
        return cached

    def names(self) -> list[str]:
        return sorted(self._classes)

    def versions(self) -> dict[str, int]:
        """Type name -> the ``@version`` hosted here (published in the membership row)."""
        return {name: grain_options(cls).version for name, cls in sorted(self._classes.items())}

    def classes(self) -> list[type[Grain]]:
        return list(self._classes.values())

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._classes

    def manifest(self, type_name: str) -> dict[str, Any]:
        """What clients need to call a type they only know by name."""
        cls = self.resolve(type_name)
        opts = grain_options(cls)
        return {
            "type": type_name,
            "version": opts.version,
            "class": f"{cls.__module__}:{cls.__qualname__}",
            "methods": sorted(public_methods(cls)),
            "one_way": sorted(opts.one_way),
            "streams": sorted(self.streams(type_name)),
            "placement": opts.placement.strategy,
            "role": opts.placement.role,
            "reentrant": opts.reentrant,
            "stateless_worker": opts.stateless_worker,
            "keep_alive": opts.keep_alive,
            "has_state": cls.State is not None,
        }
