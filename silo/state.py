"""The state handle behind ``self.state`` / ``write_state`` / ``read_state`` / ``clear_state``.

The handle keeps the etag of what it last read or wrote and the activation's
fencing token; the store refuses a write whose etag or token is stale. With
``@write_behind(ms)`` writes are coalesced: ``write_state`` marks the state
dirty and returns once the next periodic flush has committed it, so a caller
never sees an acknowledgement for a write that is not durable.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from grains.base import DeactivationReason
from silo import errors
from silo.codec import Codec
from silo.storage import StateStore

if TYPE_CHECKING:
    from silo.catalog import Activation

log = logging.getLogger("redgrain.state")


class StateHandle:
    def __init__(self, activation: Activation, store: StateStore, codec: Codec) -> None:
        model = activation.cls.State
        if model is None:
            raise errors.ConfigError(
                f"grain type {activation.grain_id.type_name} declares no State model; "
                "add `class State(BaseModel): ...` to use self.state"
            )
        self._act = activation
        self._model: type[BaseModel] = model
        self._store = store
        self._codec = codec
        self.value: Any = model()
        self.etag: str | None = None
        self._write_behind_s = (
            activation.options.write_behind_ms / 1000.0 if activation.options.write_behind_ms else None
        )
        self._dirty = False
        self._flush_waiters: list[asyncio.Future[None]] = []
        self._flusher: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task[None] | None = None

    async def load(self) -> None:
        await self.read()

    async def read(self) -> None:
        stored = await self._store.read(self._act.grain_id)
        if stored is None:
            self.value, self.etag = self._model(), None
            return
        try:
            value = self._codec.decode(stored.meta, stored.buffers)
        except errors.CodecError as exc:
            raise errors.StorageError(
                f"stored state of {self._act.grain_key} does not fit {self._model.__qualname__}: {exc}"
            ) from exc
        if isinstance(value, dict):  # stored before the model was registered under this name
            try:
                value = self._model.model_validate(value)
            except ValueError as exc:
                raise errors.StorageError(
                    f"stored state of {self._act.grain_key} does not fit {self._model.__qualname__}: {exc}"
                ) from exc
        if not isinstance(value, self._model):
            raise errors.StorageError(
                f"stored state of {self._act.grain_key} is a {type(value).__name__}, "
                f"not {self._model.__qualname__}"
            )
        self.value, self.etag = value, stored.etag

    async def write(self) -> None:
        if self._write_behind_s is None:
            await self._write_now()
            return
        self._dirty = True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(fut)
        if self._flusher is None and self._flushing is None:
            self._flusher = asyncio.get_running_loop().call_later(self._write_behind_s, self._start_flush)
        await fut

    async def _write_now(self) -> None:
        encoded = self._codec.encode(self.value)
        self.etag = await self._store.write(self._act.grain_id, encoded, self.etag, self._act.token)

    def _start_flush(self) -> None:
        self._flusher = None
        self._flushing = asyncio.get_running_loop().create_task(self.flush())

    async def flush(self) -> None:
        """Commit a pending write-behind write now (also called on deactivation)."""
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        waiters, self._flush_waiters = self._flush_waiters, []
        try:
            if self._dirty:
                self._dirty = False
                await self._write_now()
        except BaseException as exc:
            for w in waiters:
                if not w.done():
                    w.set_exception(exc)
            if isinstance(exc, errors.StateConflictError):
                self._act.request_deactivation(DeactivationReason.STATE_CONFLICT)
            if not isinstance(exc, Exception):
                raise
        else:
            for w in waiters:
                if not w.done():
                    w.set_result(None)
        finally:
            self._flushing = None
            if self._flush_waiters and self._flusher is None:
                self._flusher = asyncio.get_running_loop().call_later(
                    self._write_behind_s or 0.0, self._start_flush
                )

    async def clear(self) -> None:
        await self._store.clear(self._act.grain_id, self.etag, self._act.token)
        self.value, self.etag = self._model(), None
