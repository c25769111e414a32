"""Ending background work when its event loop ends, even if nobody stopped it.

Two failures made a script that raised after ``ClusterClient.connect`` (and
never closed the client) hang in ``asyncio.run``'s shutdown in 2 of 3 runs:

- ``asyncio.run`` cancels every task once and waits for all of them. A
  cancellation that lands inside a redis-py command can be swallowed: on
  Python 3.11 ``asyncio.timeout(0)`` (what ``PubSub.get_message(timeout=0)``
  runs) turns the cancel into a ``TimeoutError``, which redis-py reads as "no
  message". The task goes on as if never cancelled, and a polling loop never
  ends. The request is still counted (``Task.cancelling()``), so a loop that
  calls :func:`raise_if_cancelled` after each Redis command ends on time.
- Nothing closed the client, so its loops had no reason to stop.
  :class:`ShutdownHook` is a task that waits forever; when the loop's
  shutdown cancels it, it runs its owner's close (which stops the loops by
  their flags as well as by cancelling them), so the owner closes itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("redgrain.shutdown")


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if this task was asked to cancel and the request got lost."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class ShutdownHook:
    """Runs ``close()`` when its task is cancelled: by ``asyncio.run`` ending, or a test loop closing.

    The owner calls :meth:`disarm` when it closes on its own (then nothing runs).
    ``timeout_s`` bounds the close: a loop that is going away must not wait forever.
    """

    def __init__(self, close: Callable[[], Awaitable[object]], *, name: str, timeout_s: float = 10.0) -> None:
        self._close = close
        self._timeout_s = timeout_s
        self._armed = True
        self._task = asyncio.get_running_loop().create_task(self._wait(), name=f"{name} shutdown hook")

    def disarm(self) -> None:
        self._armed = False
        if self._task is not asyncio.current_task():
            self._task.cancel()

    async def _wait(self) -> None:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            if self._armed:
                self._armed = False
                # The close runs in this task on Python 3.12+ (wait_for no longer makes
                # one); a pending cancel request would end its loops' first waits.
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                try:
                    await asyncio.wait_for(self._close(), self._timeout_s)
                except Exception:
                    log.exception("closing at event loop shutdown failed")
            raise
