"""The event loop a long-lived object runs on, read once.

On Python 3.11 every ``asyncio.get_running_loop()`` (and ``asyncio.current_task()``
without a loop) makes a ``getpid()`` system call, a fork check that 3.12 dropped:
~0.2 µs each on a virtual machine, and a same-silo call made five of them (strace:
5.5 ``getpid`` a call). An object that lives on one loop (an activation, a
router, a dispatcher) reads it once with :func:`running_loop` and falls back to
``asyncio.get_running_loop()`` where it was made outside any loop.
"""

from __future__ import annotations

import asyncio


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The running loop, or None outside one (then read it when first needed)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
