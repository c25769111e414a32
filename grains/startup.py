"""Startup tasks: ``@on_silo_start`` functions a silo runs once it has started.

::

    from grains import on_silo_start

    @on_silo_start
    async def warm_caches(silo) -> None:
        await silo.get_grain(Catalogue, "main").load()

A silo looks for them in the grain modules it loads (``--grains``), module
level, and runs them one after another (modules in the order given, functions
in definition order) once it is Active in the cluster, before its start
returns (so before ``redgrain silo`` prints its address and writes
``--ready-file``). A task that raises, or all of them together running past
``startup_timeout_s``, fails the start: the silo leaves the cluster and the
process exits with the error (Orleans' startup tasks do the same).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from grains.ids import SiloAddress

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


class StartingSilo(Protocol):
    """What a startup task is given: the silo that runs it."""

    @property
    def address(self) -> SiloAddress | None: ...

    def get_grain(self, grain: Any, key: Any) -> Any:
        """A reference to a grain, as ``ClusterClient.get_grain`` gives."""
        ...


def on_silo_start(fn: F) -> F:
    """Run this module-level ``async def fn(silo)`` (or ``fn()``) once a silo that loads this
    grain module has started; its failure fails the silo's start."""
    import inspect

    target: Any = fn  # checked untyped: iscoroutinefunction would narrow fn away from F
    if not inspect.iscoroutinefunction(target):
        raise TypeError(f"@on_silo_start wants an async function, not {fn!r}")
    target.__rg_on_silo_start__ = True
    return fn


def is_startup_task(obj: object) -> bool:
    return callable(obj) and getattr(obj, "__rg_on_silo_start__", False) is True
