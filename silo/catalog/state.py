"""The state handle behind ``self.state`` / ``write_state`` / ``read_state`` / ``clear_state``,
and behind each named state (``Grain.named_state``: :class:`NamedState` wraps one handle).

The handle keeps the etag of what it last read or wrote and the activation's
fencing token; the store refuses a write whose etag or token is stale
(StateConflictError, and the catalog deactivates the activation). A write that
fails for any other reason (Redis down or slow) also deactivates it: whether
the write landed is unknown, so the next call must reload rather than trust
memory.

The state is stored as a map of the model's fields (not as the registered
model) and loaded by :mod:`silo.catalog.evolution`: at every nesting level
added fields take their defaults, renamed fields keep their values through
declared aliases, renamed nested classes load, a field the model does not have
(a newer version's) is kept and written back unchanged, and a field whose value
no longer fits fails with a StorageError naming it.

With ``@write_behind(ms)`` ``write_state`` only marks the state dirty and
returns; a flush runs as a turn of the activation at most ``ms`` later and
commits whatever the state is then (several writes, one Redis write). The
flush is fenced like any write, so a zombie's flush is refused. Deactivation
flushes. The price: an acknowledged call's state change is durable only after
the next flush (a crash loses at most ``ms`` of writes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from grains.base import DeactivationReason
from silo import errors
from silo.catalog.activation_state import ActivationState
from silo.catalog.evolution import StateLoader
from silo.codec import Codec, Encoded
from silo.storage.store import DEFAULT_STATE, StateStore, StoredState

if TYPE_CHECKING:
    from silo.catalog.activation import Activation

log = logging.getLogger("redgrain.state")


class StateHandle:
    """One state of an activation: ``self.state`` (``name`` is DEFAULT_STATE) or a named one."""

    def __init__(
        self,
        activation: Activation,
        store: StateStore,
        codec: Codec,
        model: type[BaseModel] | None = None,
        name: str = DEFAULT_STATE,
        *,
        loader: StateLoader | None = None,
    ) -> None:
        model = model if model is not None or name != DEFAULT_STATE else activation.cls.State
        if model is None:
            raise errors.ConfigError(
                f"grain type {activation.grain_id.type_name} declares no State model; "
                "add `class State(BaseModel): ...` to use self.state"
            )
        self._act = activation
        self._model: type[BaseModel] = model
        self._store = store
        self._codec = codec
        self.name = name
        self._what = activation.grain_key if name == DEFAULT_STATE else f"{activation.grain_key} (state {name!r})"
        self._loader = loader if loader is not None else StateLoader(codec)
        """Shared by the silo's handles: it logs each dropped field once per grain type."""
        self.value: Any = model()
        self._unknown: dict[str, Any] | None = None
        """Top-level stored fields the model does not have, as last read (evolution.py keeps them)."""
        self.etag: str | None = None
        self.loaded = False
        wb = activation.options.write_behind_ms
        self._write_behind_s = wb / 1000.0 if wb else None
        self._dirty = False
        self._flusher: asyncio.TimerHandle | None = None
        self._refused: errors.StateConflictError | None = None

    # --- encode / decode (also used by checkpoints) ---------------------------
    def encode(self) -> Encoded:
        """The state as the codec's map of field values (nested models stay registered types)."""
        value = self.value
        if not isinstance(value, self._model):
            raise errors.StorageError(
                f"state of {self._what} is a {type(value).__name__}, not {self._model.__qualname__}"
            )
        fields = {name: getattr(value, name) for name in type(value).model_fields}
        extra = getattr(value, "__pydantic_extra__", None)
        if extra:
            fields.update(extra)
        elif extra is None and self._unknown:
            # The state was replaced (`self.state = State(...)`): the fields a newer version stored
            # still go back, as they would have with the object they were loaded into.
            fields = {**self._unknown, **fields}
        return self._codec.encode(fields)

    def decode(self, stored: StoredState) -> Any:
        """Build the State model from a stored value (current, older or newer schema: evolution.py)."""
        try:
            tree = self._codec.decode_fields(stored.meta, stored.buffers)
        except errors.CodecError as exc:
            raise errors.StorageError(
                f"stored state of {self._what} cannot be decoded as {self._model.__qualname__}: {exc}"
            ) from exc
        type_name = self._act.grain_id.type_name
        return self._loader.load(
            self._model, tree, grain=self._what,
            type_name=type_name if self.name == DEFAULT_STATE else f"{type_name} (state {self.name!r})",
        )

    # --- read / write ---------------------------------------------------------
    async def load(self) -> None:
        await self.read()

    async def read(self) -> None:
        stored = await self._store.read(self._act.grain_id, state=self.name)
        if stored is None:
            self.value, self.etag = self._model(), None
        else:
            self.value, self.etag = self.decode(stored), stored.etag
        allow = self._model.model_config.get("extra") == "allow"  # its extras are the user's to edit
        self._unknown = None if allow else dict(self.value.__pydantic_extra__ or {})
        self.loaded = True

    async def write(self) -> None:
        if self._write_behind_s is None:
            await self._write_now()
            return
        if self._refused is not None:
            raise self._refused
        self._dirty = True
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().call_later(
                self._write_behind_s, self._flush_soon
            )

    async def _write_now(self) -> None:
        try:
            self.etag = await self._store.write(
                self._act.grain_id, self.encode(), self.etag, self._act.token, state=self.name
            )
        except errors.StateConflictError as exc:
            self._refused = exc
            self._act.request_deactivation(DeactivationReason.STATE_CONFLICT)
            raise
        except Exception:
            # StorageError, or anything else a store let through: the write may or may not have
            # landed, so memory can no longer be trusted; the next activation reads it again.
            self._act.request_deactivation(DeactivationReason.ERROR)
            raise

    def _flush_soon(self) -> None:
        self._flusher = None
        if self._act.status is ActivationState.ACTIVE:
            # As a turn: no other (non-interleaved) turn mutates the state while it streams out.
            self._act.enqueue_internal(self._flush_turn)
        # Otherwise deactivation is under way and flushes itself.

    async def _flush_turn(self) -> None:
        try:
            await self.flush()
        except errors.StateConflictError:
            raise
        except errors.StorageError as exc:
            log.warning("%s: write-behind flush failed, retrying: %s", self._act.grain_key, exc)

    async def flush(self) -> None:
        """Commit a pending write-behind write now (deactivation calls it)."""
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        if not self._dirty or self._refused is not None:
            return
        self._dirty = False
        try:
            self.etag = await self._store.write(
                self._act.grain_id, self.encode(), self.etag, self._act.token, state=self.name
            )
        except errors.StateConflictError as exc:
            self._refused = exc
            self._act.request_deactivation(DeactivationReason.STATE_CONFLICT)
            raise
        except errors.StorageError:
            self._dirty = True  # acknowledged writes must not be dropped: try again later
            if self._act.status is ActivationState.ACTIVE and self._flusher is None and self._write_behind_s:
                self._flusher = asyncio.get_running_loop().call_later(
                    self._write_behind_s, self._flush_soon
                )
            raise

    @property
    def dirty(self) -> bool:
        """A write-behind write is waiting for its flush."""
        return self._dirty

    async def clear(self) -> None:
        try:
            await self._store.clear(self._act.grain_id, self.etag, self._act.token, state=self.name)
        except errors.StateConflictError as exc:
            self._refused = exc
            self._act.request_deactivation(DeactivationReason.STATE_CONFLICT)
            raise
        self.value, self.etag, self._dirty, self._unknown = self._model(), None, False, None
        self.loaded = True

    def adopt(self, value: Any) -> None:
        """Replace the in-memory state (a restored snapshot); the etag stays, so a write is fenced as usual."""
        self.value = value


class NamedState:
    """What ``Grain.named_state`` returns: one named state (``grains.context.PersistentState``).

    Its value cannot be read before it was loaded (at activation when asked for in
    ``__init__``, else by ``read``): a default-valued model there would be written over
    whatever is stored.
    """

    __slots__ = ("_handle",)

    def __init__(self, handle: StateHandle) -> None:
        self._handle = handle

    @property
    def name(self) -> str:
        return self._handle.name

    @property
    def model(self) -> type[BaseModel]:
        return self._handle._model

    @property
    def value(self) -> Any:
        if not self._handle.loaded:
            raise errors.StorageError(
                f"state {self._handle.name!r} of {self._handle._act.grain_key} is not loaded: ask for it"
                " with named_state() in __init__ (it loads before on_activate) or await its read() first"
            )
        return self._handle.value

    @value.setter
    def value(self, value: Any) -> None:
        self._handle.value = value

    state = value

    @property
    def etag(self) -> str | None:
        return self._handle.etag

    @property
    def loaded(self) -> bool:
        return self._handle.loaded

    async def write(self) -> None:
        if not self._handle.loaded:
            _ = self.value  # the same clear error: an unread state would overwrite what is stored
        await self._handle.write()

    async def read(self) -> None:
        await self._handle.read()

    async def clear(self) -> None:
        await self._handle.clear()

    def __repr__(self) -> str:
        return f"<NamedState {self._handle.name!r} of {self._handle._act.grain_key}>"
