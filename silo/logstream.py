"""Live logs: a silo's log records, published to a capped Redis stream for the dashboard.

``LogStream`` is a ``logging.Handler`` on the root logger. ``emit`` formats
the record and appends it to a bounded in-memory queue: no I/O, no lock
beyond the handler's own, so logging never blocks the event loop. One
background task of the silo drains the queue in pipelined ``XADD MAXLEN ~``
batches to ``keys.logs`` (fields: time, level, logger, message, silo, exc).
When the queue is full the oldest record goes; a batch Redis refuses is
dropped too. Both are counted (``statistics().dropped``), never logged.

Whose records: a silo publishes the records logged in its own context. Its
``logs`` stage (before it listens or builds anything) sets a context
variable to its stream, so every task it creates from then on (connections,
activations, turns, timers, its services) inherits it and each record
carries the silo whose work logged it, even with several silos in one
process. A record logged outside any silo's context (a thread started
without copying context, code that runs before a silo) goes to the stream
installed first in the process: in a silo process, its one silo. The caller
of ``Silo.start()`` inherits the variable too (the stage runs in its task):
a test that starts several silos has its own records published by the silo
it started last.

No recursion: the writer task runs with a second context variable set, and
a record logged inside it (by redis-py, say) is not taken; the writer's own
Redis failures are counted, never logged.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from silo.keys import Keys
from silo.settings import LogStreamSettings

MAX_MESSAGE_CHARS = 8192
"""A longer message is cut: the stream is for reading, and it is capped by count, not size."""
MAX_EXC_CHARS = 16384

_OWNER: contextvars.ContextVar[LogStream | None] = contextvars.ContextVar(
    "redgrain_log_stream", default=None
)
_WRITING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "redgrain_log_stream_writing", default=False
)


@dataclass(frozen=True, slots=True)
class LogStreamStatistics:
    published: int
    """Records written to the stream."""
    dropped: int
    """Records lost: the queue was full, or Redis refused their batch."""
    pending: int
    """Records waiting for the writer."""
    write_failures: int
    """Batches Redis refused (unreachable, timed out)."""


class LogStream(logging.Handler):
    """Publishes one silo's log records at ``settings.level`` and above; see the module docstring."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        silo: Callable[[], str],
        settings: LogStreamSettings,
        *,
        flush_interval_s: float = 0.25,
        batch: int = 200,
    ) -> None:
        super().__init__(level=settings.level)
        self._redis = redis
        self._keys = keys
        self._silo = silo
        self._max_len = settings.max_len
        self._interval_s = flush_interval_s
        self._batch = batch
        self._queue: deque[dict[str, str]] = deque(maxlen=settings.queue)
        self._exc_formatter = logging.Formatter()
        self._logger: logging.Logger | None = None
        self._loop_thread: int | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._published = self._dropped = self._failures = 0
        self._stopping = False

    # --- install / stop ---------------------------------------------------------
    def install(self, logger: logging.Logger | None = None) -> None:
        """Attach to ``logger`` (the root), own the current context, start the writer.

        Call it from the silo's task: the context set here is what its later tasks inherit.
        """
        loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        _OWNER.set(self)
        writer = contextvars.copy_context()
        writer.run(_WRITING.set, True)
        self._task = loop.create_task(self._write_forever(), name="log-stream", context=writer)
        self._logger = logger if logger is not None else logging.getLogger()
        self._logger.addHandler(self)

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Detach, then write what is queued (one bounded try: Redis may be gone)."""
        if self._logger is not None:
            self._logger.removeHandler(self)
        self._stopping = True  # the writer's loop ends at its next check (see _write_forever)
        task, self._task = self._task, None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if task is not None:
            # Woken, not cancelled: a cancel landing inside a pipeline's execute left records
            # written to Redis but counted nowhere. Cancelled only if it overruns the bound.
            if self._wake is not None:
                self._wake.set()
            _, running = await asyncio.wait({task}, timeout=timeout_s)
            for t in running:
                t.cancel()
            await asyncio.gather(task, return_exceptions=True)
        try:
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                await self._write_pending()
        except TimeoutError:
            pass
        self._dropped += len(self._queue)
        self._queue.clear()
        self.close()

    # --- logging.Handler --------------------------------------------------------
    def emit(self, record: logging.LogRecord) -> None:
        if _WRITING.get():
            return  # logged while writing to Redis: taking it could feed itself
        owner = _OWNER.get()
        if owner is not self and (owner is not None or not self._is_first()):
            return
        try:
            fields = self._fields(record)
        except Exception:  # noqa: BLE001 - a bad record (format args) must not break the caller
            self.handleError(record)
            return
        if len(self._queue) == self._queue.maxlen:
            self._dropped += 1  # deque(maxlen) drops the oldest as we append
        self._queue.append(fields)
        if self._wake is not None and threading.get_ident() == self._loop_thread:
            self._wake.set()  # other threads' records wait for the writer's interval

    def _is_first(self) -> bool:
        handlers = self._logger.handlers if self._logger is not None else []
        return next((h for h in handlers if isinstance(h, LogStream)), None) is self

    def _fields(self, record: logging.LogRecord) -> dict[str, str]:
        exc = ""
        if record.exc_info:
            exc = self._exc_formatter.formatException(record.exc_info)
        elif record.exc_text:
            exc = record.exc_text
        if record.stack_info:
            exc = f"{exc}\n{record.stack_info}" if exc else record.stack_info
        return {
            "time": repr(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage()[:MAX_MESSAGE_CHARS],
            "exc": exc[:MAX_EXC_CHARS],
        }

    # --- the writer -------------------------------------------------------------
    async def _write_forever(self) -> None:
        wake = self._wake
        assert wake is not None
        while not self._stopping:
            try:
                # Not wait_for: on 3.11 it can swallow a cancel that lands as the event is set.
                async with asyncio.timeout(self._interval_s):
                    await wake.wait()
            except TimeoutError:
                pass
            wake.clear()
            if self._silo():  # records from before the address is known wait for it
                await self._write_pending()

    async def _write_pending(self) -> None:
        silo = self._silo()
        while self._queue:
            batch: list[dict[str, str]] = []
            while self._queue and len(batch) < self._batch:
                batch.append(self._queue.popleft())
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for fields in batch:
                        pipe.xadd(
                            self._keys.logs,
                            {**fields, "silo": silo},  # type: ignore[dict-item]
                            maxlen=self._max_len,
                            approximate=True,
                        )
                    await pipe.execute()
            except (RedisError, OSError):
                # Counted, not logged (see the module docstring); the next wake tries again.
                self._dropped += len(batch)
                self._failures += 1
                return
            self._published += len(batch)

    def statistics(self) -> LogStreamStatistics:
        return LogStreamStatistics(
            published=self._published,
            dropped=self._dropped,
            pending=len(self._queue),
            write_failures=self._failures,
        )
