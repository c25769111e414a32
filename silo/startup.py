"""Startup tasks (``grains.on_silo_start``): found in the grain modules, run as the last start stage.

They run once the silo is Active (its grains callable from anywhere, its own
included) and before ``Silo.start`` returns, one after another, all within
``startup_timeout_s``. One that raises or times out fails the start, which
unwinds like any failed stage: the silo leaves the cluster and the error
(StartupTaskError, naming the task) reaches whoever started it; ``redgrain
silo`` prints it and exits 1 without ever writing its ready file.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from grains.startup import is_startup_task
from silo import errors

log = logging.getLogger("redgrain.silo")

StartupTask = Callable[..., Awaitable[Any]]


def find_startup_tasks(modules: Iterable[str]) -> list[StartupTask]:
    """The ``@on_silo_start`` functions defined at module level in ``modules``, in order."""
    found: list[StartupTask] = []
    for name in modules:
        module = importlib.import_module(name)  # already imported by GrainTypes: no new failure here
        for obj in vars(module).values():
            # Defined there, not imported: a task shared by two grain modules runs once.
            if is_startup_task(obj) and getattr(obj, "__module__", None) == module.__name__ and obj not in found:
                found.append(obj)
    return found


def task_name(task: StartupTask) -> str:
    return f"{getattr(task, '__module__', '?')}:{getattr(task, '__qualname__', repr(task))}"


async def run_startup_tasks(tasks: list[StartupTask], silo: Any, timeout_s: float) -> None:
    """Run ``tasks`` in order, each given ``silo`` (when it takes a parameter), within ``timeout_s`` in all."""
    if not tasks:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for task in tasks:
        name = task_name(task)
        takes_silo = bool(inspect.signature(task).parameters)
        log.info("silo %s: startup task %s", silo.address, name)
        try:
            async with asyncio.timeout_at(deadline):
                await (task(silo) if takes_silo else task())
        except TimeoutError as exc:
            raise errors.StartupTaskError(name, f"still running after startup_timeout_s={timeout_s:g}") from exc
        except Exception as exc:
            raise errors.StartupTaskError(name, f"{type(exc).__name__}: {exc}") from exc
