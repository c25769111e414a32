"""Values to bytes and back: msgpack for the value tree, raw buffers for the bulk.

``Codec.encode`` gives ``Encoded(meta, buffers)``: ``meta`` is msgpack with
placeholders, ``buffers`` are memoryviews over the value's own memory (tensor
storage, ndarray data, big bytes) so the transport can ``writelines`` them
without a copy. ``pickle`` is never used: decoding builds only the types below
and classes registered in a ``TypeRegistry``, and checks every size against the
buffer before touching memory.

msgpack ExtType codes (-1 is msgpack's own Timestamp)::

    1  int outside int64/uint64   decimal ASCII
    2  tuple                      msgpack array of items
    3  set                        msgpack array of items
    4  frozenset                  msgpack array of items
    5  uuid.UUID                  16 raw bytes
    6  datetime.datetime          ISO 8601 text (UTC offset kept, zone name not)
    7  bytes, out of band         msgpack int: buffer index
    8  torch.Tensor               msgpack [dtype name, shape, buffer index]
    9  numpy.ndarray              msgpack [dtype.str, shape, buffer index]
    10 registered model/dataclass msgpack [registered name, {field: value}]
    11 registered Enum            msgpack [registered name, value]
    12 GrainId                    msgpack [type_name, key]
    13 SiloAddress                msgpack [host, port, generation]
    14 a local reference          msgpack int: index into the copy's references (never on the wire)
    15 ObserverRef                msgpack [owner, local id, [methods], [one-way methods], [gateways]]

An observer reference decodes bound to ``Codec.observers`` (the process's
observer hub, :mod:`silo.messaging.observer_hub`), so the receiver can call it;
the hub also says which gateways a reference made here carries.

``Codec.copy`` runs the same walk for a call to a grain on the caller's own
silo: the value comes back as the callee would decode it (registered types
rebuilt, tensors and arrays in fresh memory, an unencodable value the same
CodecError), so a call shares nothing with its caller at any distance. Values
marked ``@immutable`` (:mod:`grains.immutable`) and ``bytes`` are passed by
reference instead (code 14), and plain immutable arguments skip the walk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import enum
import inspect
import math
import re
import struct
import sys
import types
import typing
import uuid
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import msgpack
from msgpack import ExtType
from pydantic import BaseModel, ValidationError

from grains.ids import GrainId, SiloAddress
from grains.immutable import is_immutable
from grains.observer import ObserverId, ObserverRef
from silo.errors import CodecError, ConfigError

__all__ = ["Codec", "Encoded", "ObserverBinding", "StoredObject", "TypeRegistry"]

T = TypeVar("T")

(_BIGINT, _TUPLE, _SET, _FROZENSET, _UUID, _DATETIME, _BYTES, _TENSOR, _NDARRAY,
 _OBJECT, _ENUM, _GRAIN_ID, _SILO_ADDRESS, _LOCAL_REF, _OBSERVER) = range(1, 16)  # fmt: skip

_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1
_PASS = frozenset({str, float, bool, type(None)})  # msgpack packs these as they are
_TORCH_DTYPES = (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip
# Plain fixed-size numpy kinds only: no object, no structured, no zero itemsize.
_NP_DTYPE = re.compile(r"[<>|=]?[biufcmMSU][1-9][0-9]*(\[[0-9]*[a-zA-Z]+\])?")
_MAX_DIMS = 64  # numpy's own limit; also keeps math.prod on hostile shapes cheap
_BLOB_HEAD = struct.Struct("<BI")  # version, buffer count; then u64 lengths of meta, buffers
_BLOB_VERSION = 1
_ID_FIELDS: dict[int, tuple[type, list[type]]] = {
    _GRAIN_ID: (GrainId, [str, str]),
    _SILO_ADDRESS: (SiloAddress, [str, int, int]),
}
_Encoder = Callable[[Any, list[memoryview]], Any]
_unpackb = msgpack.unpackb


class ObserverBinding(Protocol):
    """What the codec needs of the process's observer hub."""

    def bind(
        self, observer_id: ObserverId, methods: frozenset[str], one_way: frozenset[str], gateways: tuple[str, ...]
    ) -> ObserverRef:
        """A reference, received here, that calls through this process."""
        ...

    def gateways(self, ref: ObserverRef) -> tuple[str, ...]:
        """The gateways ``ref`` travels with (for one made here: the silos we are connected to now)."""
        ...


class _Unbound:
    """The caller of a reference decoded where no hub is bound (a codec outside a silo or client)."""

    async def invoke_observer(self, ref: ObserverRef, method: str, *_: Any) -> Any:
        raise CodecError(f"observer {ref.observer_id} was decoded outside a silo or client: it cannot be called here")

    async def dispose_observer(self, ref: ObserverRef) -> None:
        raise CodecError(f"observer {ref.observer_id} was decoded outside a silo or client: it cannot be disposed here")

    def is_gone(self, exc: BaseException) -> bool:
        return False


_UNBOUND = _Unbound()


def _ext(code: int, data: bytes) -> ExtType:
    # ExtType.__new__ re-validates in Python (0.7 us); our codes and payloads are known good.
    return tuple.__new__(ExtType, (code, data))


class Encoded(NamedTuple):
    """A value as msgpack ``meta`` plus out-of-band ``buffers`` (a tuple: built once per call,
    and a frozen dataclass's ``__init__`` cost more than the rest of encoding a small call)."""

    meta: bytes
    buffers: list[memoryview]

    @property
    def nbytes(self) -> int:
        return len(self.meta) + sum(b.nbytes for b in self.buffers)


def _qualname(cls: object) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"


def _is_wire_class(cls: object) -> bool:
    return isinstance(cls, type) and (
        issubclass(cls, (BaseModel, enum.Enum)) or dataclasses.is_dataclass(cls)
    )


class TypeRegistry:
    """Per-instance table of wire-visible types.

    Never module-global: several silos share a process in tests, each with its own table.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, type] = {}
        self._by_class: dict[type, str] = {}
        self._errors: dict[str, type[Exception]] = {}
        """Exception classes an error frame may name (``module.Qualname``): a remote error is
        rebuilt as one of them too (silo/messaging/wire_errors.py). Nothing else is looked up."""

    def register(self, cls: type, name: str | None = None) -> type:
        if cls is GrainId or cls is SiloAddress:
            return cls  # always known, under their own ext codes
        if not _is_wire_class(cls):
            raise ConfigError(f"cannot register {_qualname(cls)}: only pydantic models,"
                              " dataclasses and Enums travel as registered types")  # fmt: skip
        known = self._by_class.get(cls)
        if known is not None and name in (None, known):
            return cls
        if known is not None:
            raise ConfigError(f"{_qualname(cls)} is already registered as {known!r}, not {name!r}")
        name = name or cls.__qualname__
        if name in self._by_name:
            raise ConfigError(f"wire type name {name!r} is taken by {_qualname(self._by_name[name])};"
                              f" register {_qualname(cls)} with register(cls, name=...)")  # fmt: skip
        aliases = tuple(getattr(cls, "__wire_aliases__", ()))
        for alias in aliases:
            if alias in self._by_name or alias == name:
                raise ConfigError(f"wire alias {alias!r} of {_qualname(cls)} is taken by "
                                  f"{_qualname(self._by_name.get(alias, cls))}")  # fmt: skip
        self._by_name[name] = cls
        self._by_class[cls] = name
        # A renamed class keeps reading what was stored under its old names; it is written only
        # under the new one (values in Redis outlive the code that wrote them).
        for alias in aliases:
            self._by_name[alias] = cls
        return cls

    def register_annotations(self, obj: object) -> None:
        seen: set[int] = set()
        if not isinstance(obj, type):
            self._collect_hints(obj, seen)
            return
        if _is_wire_class(obj):
            self._collect(obj, seen)
            return
        self._collect_errors(sys.modules.get(obj.__module__))
        for attr in dir(obj):
            if attr.startswith("_"):
                continue
            try:
                member = getattr(obj, attr)
            except Exception:  # noqa: BLE001, S112 - a descriptor may raise anything; skip it
                continue
            if attr == "State" and isinstance(member, type):
                self._collect(member, seen)
            elif callable(member) and not isinstance(member, type):
                self._collect_hints(member, seen)

    def names(self) -> list[str]:
        """The names values are written under (aliases only read)."""
        return sorted(self._by_class.values())

    def register_error(self, cls: type[Exception]) -> type[Exception]:
        """Make an exception class known by name, so a remote error of that class is caught by
        it here too. A grain class's own module's exception classes (defined or imported there)
        are known once the grain class is (``register_annotations``)."""
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            raise ConfigError(f"cannot register {_qualname(cls)} as an error: not an Exception subclass")
        self._errors[_qualname(cls)] = cls
        return cls

    def error_class(self, name: str) -> type[Exception] | None:
        """The exception class registered under ``module.Qualname``, or None: never imported."""
        return self._errors.get(name)

    def copy(self) -> TypeRegistry:
        other = TypeRegistry()
        other._by_name, other._by_class = dict(self._by_name), dict(self._by_class)
        other._errors = dict(self._errors)
        return other

    def _collect_errors(self, module: types.ModuleType | None) -> None:
        # The exceptions a grain's code can raise by name: those its module defines or imports.
        for value in vars(module).values() if module is not None else ():
            if isinstance(value, type) and issubclass(value, Exception) and value.__module__ != "builtins":
                self._errors.setdefault(_qualname(value), value)

    def _collect_hints(self, obj: object, seen: set[int]) -> None:
        for hint in _hints(getattr(obj, "__func__", obj)):
            self._collect(hint, seen)

    def _collect(self, tp: Any, seen: set[int]) -> None:
        if id(tp) in seen:
            return
        seen.add(id(tp))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Literal:
            return
        if origin is typing.Annotated:
            args = args[:1]
        elif origin is not None:
            self._collect(origin, seen)  # a parametrised generic model or dataclass
        for arg in args:
            for a in arg if isinstance(arg, list) else (arg,):  # Callable[[A], B]
                self._collect(a, seen)
        if origin is not None or not _is_wire_class(tp) or tp is GrainId or tp is SiloAddress:
            return
        self.register(tp)
        if issubclass(tp, BaseModel):
            for field in tp.model_fields.values():
                self._collect(field.annotation, seen)
        elif dataclasses.is_dataclass(tp):
            for hint in _hints(tp):
                self._collect(hint, seen)


def _hints(obj: Any) -> list[Any]:
    with contextlib.suppress(Exception):  # one unresolvable hint spoils the lot: then go one by one
        return list(typing.get_type_hints(obj, include_extras=True).values())
    try:
        annotations = inspect.get_annotations(obj)
        module = sys.modules.get(obj.__module__) if isinstance(obj, type) else None
        globalns = vars(module) if module else getattr(inspect.unwrap(obj), "__globals__", {})
    except Exception:  # noqa: BLE001 - not a function or class after all
        return []
    found: list[Any] = []
    for hint in annotations.values():
        shim = types.SimpleNamespace(__annotations__={"h": hint}, __globals__=globalns)
        with contextlib.suppress(Exception):
            found.extend(typing.get_type_hints(shim, include_extras=True).values())
    return found


@cache
def _torch_dtypes() -> dict[str, Any]:
    import torch  # only when a tensor shows up: silos without tensors skip the import

    found = {n: getattr(torch, n, None) for n in _TORCH_DTYPES}
    return {n: d for n, d in found.items() if isinstance(d, torch.dtype)}


@cache
def _torch_names() -> dict[Any, str]:
    return {d: n for n, d in _torch_dtypes().items()}


class _BufferHook:
    """msgpack's ext hook for one message with out-of-band buffers (no reference cycle:
    it passes itself down for nested values instead of keeping a reference to itself)."""

    __slots__ = ("buffers", "codec", "refs")

    def __init__(self, codec: Codec, buffers: Sequence[bytearray | memoryview | bytes], refs: list[Any] | None = None) -> None:
        self.codec, self.buffers, self.refs = codec, buffers, refs

    def __call__(self, code: int, data: bytes) -> Any:
        return self.codec._decode_ext(code, data, self.buffers, self)


class _FieldsHook(_BufferHook):
    """The hook of :meth:`Codec.decode_fields`: registered models and dataclasses come back as
    their field maps (:class:`StoredObject`), not built."""

    __slots__ = ()


class StoredObject(dict):  # type: ignore[type-arg]
    """A registered model or dataclass as :meth:`Codec.decode_fields` gives it: its stored field
    map, plus the name it was written under (the class may have been renamed since)."""

    __slots__ = ("wire_name",)

    def __init__(self, wire_name: str, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self.wire_name = wire_name


_BYTES_TYPES = (bytes, bytearray, memoryview)
SCALARS = frozenset({str, int, float, bool, type(None), bytes})
"""Immutable leaves: arguments made only of these (the usual call) need no copy."""


class _NotPlain(Exception):
    """Raised by :func:`_plain_copy` at the first value it cannot copy by structure alone."""


_PLAIN_DEPTH = 32
_CONTAINERS = frozenset({dict, list, tuple})


def _plain_copy(v: Any, depth: int) -> Any:
    """``v`` copied as :meth:`Codec.copy`'s walk would copy it, when it is made only of dicts,
    lists and tuples (new containers), scalars and marked values (the same objects): what the
    walk's msgpack round trip gives back for these, without it. Anything else (a model, a
    tensor to copy, a set, a subclass) raises :class:`_NotPlain`, and the walk does it all."""
    t = type(v)
    if t in SCALARS:
        return v
    if depth > _PLAIN_DEPTH:
        raise _NotPlain
    if t is dict:
        out = {}
        for k, x in v.items():
            if type(k) not in SCALARS:
                raise _NotPlain  # a tuple key: the walk's
            out[k] = x if type(x) in SCALARS else _plain_copy(x, depth + 1)
        return out
    if t is list:
        return [x if type(x) in SCALARS else _plain_copy(x, depth + 1) for x in v]
    if t is tuple:
        return tuple([x if type(x) in SCALARS else _plain_copy(x, depth + 1) for x in v])
    if is_immutable(v):
        return v
    raise _NotPlain


class _CopyBuffers(list):  # type: ignore[type-arg]
    """The buffer list of a :meth:`Codec.copy` walk: its type tells the walker to pass marked
    values by reference (into ``refs``) instead of encoding them."""

    __slots__ = ("refs",)

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[Any] = []


def _holds_big_bytes(value: object, threshold: int) -> bool:
    """Whether ``value`` is, or directly holds, bytes that will go out of band (0.1 µs a call)."""
    if type(value) in _BYTES_TYPES:
        return len(value) >= threshold  # type: ignore[arg-type]
    if type(value) is list or type(value) is tuple:
        for item in value:  # type: ignore[attr-defined]
            if type(item) in _BYTES_TYPES and len(item) >= threshold:
                return True
    return False


class Codec:
    def __init__(self, registry: TypeRegistry | None = None, *, oob_threshold: int = 65536) -> None:
        self.registry = registry if registry is not None else TypeRegistry()
        self.oob_threshold = oob_threshold
        self.observers: ObserverBinding | None = None
        """Binds received observer references to this process (set by the silo or client that owns
        the codec); None: they decode, but cannot be called."""
        # Packers are shared, so no pack() may run Python code that lets another thread in
        # mid-pack: the walker hands over only natives and ExtType, and the native fast path
        # bails out through NoneType(x), a C callable that raises TypeError for any argument.
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._pack_native = msgpack.Packer(
            use_bin_type=True, strict_types=True, default=type(None)
        ).pack
        self._hook0 = self._no_buffers_hook
        pack, items = self._pack, self._items
        self._encoders: dict[type, _Encoder] = {
            set: lambda v, b: _ext(_SET, pack(items(v, b))),
            frozenset: lambda v, b: _ext(_FROZENSET, pack(items(v, b))),
            bytes: self._encode_bytes,
            bytearray: self._encode_bytes,
            memoryview: self._encode_bytes,
            uuid.UUID: lambda v, b: _ext(_UUID, v.bytes),
            dt.datetime: lambda v, b: _ext(_DATETIME, v.isoformat().encode()),
            GrainId: lambda v, b: _ext(_GRAIN_ID, pack([v.type_name, v.key])),
            SiloAddress: lambda v, b: _ext(_SILO_ADDRESS, pack([v.host, v.port, v.generation])),
            ObserverRef: self._encode_observer,
        }

    # --- encode ---------------------------------------------------------------

    def encode(self, value: object) -> Encoded:
        # Most messages hold only natives (call args are a tuple of them): msgpack's C packer
        # does those whole, 3x faster than the walker. Anything else bails out to the walker,
        # as does a result big enough that it might hold bytes that belong out of band.
        # Big bytes at the top (a bytes result, or an argument) skip the native try: packing
        # them only to throw the copy away cost a cold 1 MB memcpy per call when pipelined.
        if not _holds_big_bytes(value, self.oob_threshold):
            try:
                if type(value) is tuple:
                    meta = self._pack(_ext(_TUPLE, self._pack_native(list(value))))
                else:
                    meta = self._pack_native(value)
                if len(meta) < self.oob_threshold:
                    return Encoded(meta, [])
            except (TypeError, OverflowError, ValueError, BufferError):
                pass
        buffers: list[memoryview] = []
        return Encoded(self._meta(value, buffers), buffers)

    def _meta(self, value: object, buffers: list[memoryview]) -> bytes:
        """The walk of ``value`` packed (its bulk appended to ``buffers``); CodecError if it cannot travel."""
        try:
            return self._pack(self._walk(value, buffers))  # type: ignore[no-any-return]
        except RecursionError as exc:
            raise CodecError("value is nested too deeply (or contains itself)") from exc
        except (ValueError, TypeError, OverflowError) as exc:
            raise CodecError(f"cannot encode value: {exc}") from exc

    def dumps(self, value: object) -> bytes:
        enc = self.encode(value)
        parts: list[bytes | memoryview] = [enc.meta, *enc.buffers]
        lengths = struct.pack(f"<{len(parts)}Q", *(len(p) for p in parts))
        return b"".join([_BLOB_HEAD.pack(_BLOB_VERSION, len(enc.buffers)), lengths, *parts])

    def copy(self, value: T) -> T:
        """``value`` as a grain on another silo would receive it (see the module doc): what a
        call to a grain on this silo passes, so it behaves the same at every distance."""
        t = type(value)
        if t in SCALARS or (t is tuple and SCALARS.issuperset(map(type, value))):  # type: ignore[call-overload]
            return value
        if t in _CONTAINERS or is_immutable(value):
            try:
                # Containers of scalars and marked tensors (a gradient push: 41 of them, 64 µs
                # through the walk's round trip, 14 µs here), the common local call with bulk.
                # A model or an unmarked tensor goes straight to the walk, with no raise.
                return _plain_copy(value, 0)  # type: ignore[no-any-return]
            except _NotPlain:
                pass
        bufs = _CopyBuffers()
        meta = self._meta(value, bufs)
        # Each buffer copied once: decoded tensors and arrays are views of the copy.
        own = [memoryview(bytearray(b)) for b in bufs]
        try:
            return _unpackb(meta, ext_hook=_BufferHook(self, own, bufs.refs), raw=False, strict_map_key=False)  # type: ignore[no-any-return]
        except CodecError:
            raise
        except Exception as exc:  # a registered type that cannot be rebuilt from its fields
            raise CodecError(f"cannot copy value: {type(exc).__name__}: {exc}") from exc

    def _walk(self, v: Any, bufs: list[memoryview]) -> Any:
        # Exact type checks keep subclasses (IntEnum, StrEnum, ...) off the native path.
        t = type(v)
        if t in _PASS:
            return v
        if t is int:
            return v if _INT_MIN <= v <= _UINT_MAX else self._encode_bigint(v)
        if t is list:
            return self._items(v, bufs)
        if t is tuple:
            return _ext(_TUPLE, self._pack(self._items(v, bufs)))
        if t is dict:
            walk = self._walk
            return {(k if type(k) in _PASS else walk(k, bufs)): (
                x if type(x) in _PASS else walk(x, bufs)) for k, x in v.items()}  # fmt: skip
        if bufs.__class__ is _CopyBuffers and (t is bytes or is_immutable(v)):
            refs = bufs.refs  # type: ignore[attr-defined]
            refs.append(v)
            return _ext(_LOCAL_REF, self._pack(len(refs) - 1))
        enc = self._encoders.get(t) or self._encoder_for(t, v)
        return enc(v, bufs)

    def _items(self, v: Any, bufs: list[memoryview]) -> list[Any]:
        walk = self._walk  # skipping natives inline saves a call per element
        return [x if type(x) in _PASS else walk(x, bufs) for x in v]

    def _encoder_for(self, t: type, v: Any) -> _Encoder:
        enc: _Encoder
        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
        name = self.registry._by_class.get(t)
        if name is not None:
            enc = self._object_encoder(t, name)
        elif t is StoredObject:
            # A stored value kept unread (a field this version of a state does not know): written
            # back under the name it was stored as, so the version that knows it reads it the same.
            enc = lambda v, b: _ext(_OBJECT, self._pack([v.wire_name, self._walk(dict(v), b)]))
        elif torch is not None and isinstance(v, torch.Tensor):
            enc = self._encode_tensor
        elif np is not None and (t is np.ndarray or isinstance(v, np.memmap)):
            enc = self._encode_ndarray
        elif isinstance(v, dt.datetime):
            enc = self._encoders[dt.datetime]
        else:
            raise CodecError(f"cannot encode a value of type {_qualname(t)}: register it with"
                             " TypeRegistry.register (pydantic model, dataclass or Enum)"
                             " or send a supported type")  # fmt: skip
        self._encoders[t] = enc  # registrations only ever add, so a cached answer stays right
        return enc

    def _object_encoder(self, cls: type, name: str) -> _Encoder:
        if issubclass(cls, enum.Enum):
            return lambda v, b: _ext(_ENUM, self._pack([name, self._walk(v.value, b)]))
        if issubclass(cls, BaseModel):
            fields = tuple(cls.model_fields)
        else:
            fields = tuple(f.name for f in dataclasses.fields(cast(Any, cls)) if f.init)

        def encode(v: Any, bufs: list[memoryview]) -> ExtType:
            data = {f: self._walk(getattr(v, f), bufs) for f in fields}
            extra = getattr(v, "__pydantic_extra__", None)
            if extra:
                data.update({k: self._walk(x, bufs) for k, x in extra.items()})
            return _ext(_OBJECT, self._pack([name, data]))

        return encode

    def _encode_observer(self, v: ObserverRef, bufs: list[memoryview]) -> ExtType:
        gateways = self.observers.gateways(v) if self.observers is not None else v.gateways
        oid = v.observer_id
        return _ext(_OBSERVER, self._pack([oid.owner, oid.local_id, sorted(v.methods), sorted(v.one_way_methods), list(gateways)]))

    def _encode_bigint(self, v: int) -> ExtType:
        try:
            return _ext(_BIGINT, str(v).encode())
        except ValueError as exc:  # over sys.get_int_max_str_digits()
            raise CodecError(f"int too large to encode: {exc}") from exc

    def _out_of_band(self, code: int, header: Any, view: memoryview, bufs: list) -> ExtType:
        bufs.append(view)
        return _ext(code, self._pack([*header, len(bufs) - 1] if header else len(bufs) - 1))

    def _encode_bytes(self, v: Any, bufs: list[memoryview]) -> Any:
        view = memoryview(v)
        if view.nbytes < self.oob_threshold:
            return v if type(v) is not memoryview else view.tobytes()
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        return self._out_of_band(_BYTES, None, view.cast("B"), bufs)

    def _encode_tensor(self, v: Any, bufs: list[memoryview]) -> ExtType:
        import torch

        t = v.detach()
        name = _torch_names().get(t.dtype)
        if name is None or t.layout != torch.strided or t.device.type == "meta":
            raise CodecError(f"cannot encode a {t.dtype} tensor with layout {t.layout} on"
                             f" {t.device}: only dense tensors of plain dtypes travel")  # fmt: skip
        t = t.cpu().resolve_conj().resolve_neg().contiguous()  # each a no-op when not needed
        # The numpy view holds the tensor, so its memory lives as long as the memoryview.
        flat = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        return self._out_of_band(_TENSOR, [name, list(t.shape)], flat, bufs)

    def _encode_ndarray(self, v: Any, bufs: list[memoryview]) -> ExtType:
        import numpy as np

        if not _NP_DTYPE.fullmatch(v.dtype.str):
            raise CodecError(f"cannot encode a numpy array of dtype {v.dtype}: object, structured"
                             " and zero-size dtypes do not travel")  # fmt: skip
        a = v if v.flags.c_contiguous else v.copy(order="C")
        flat = memoryview(a.reshape(-1).view(np.uint8))
        return self._out_of_band(_NDARRAY, [v.dtype.str, list(v.shape)], flat, bufs)

    # --- decode ---------------------------------------------------------------

    def decode(
        self,
        meta: bytes | bytearray | memoryview,
        buffers: Sequence[bytearray | memoryview | bytes] = (),
    ) -> Any:
        # Most messages have no buffers and share one hook. A closure calling itself
        # would be a reference cycle holding the received buffers until the garbage
        # collector's next pass: hundreds of MB of tensors kept alive, and every new one
        # landing on fresh (zero-filled) pages.
        hook: Any = _BufferHook(self, buffers) if buffers else self._hook0
        try:
            return _unpackb(meta, ext_hook=hook, raw=False, strict_map_key=False)
        except CodecError:
            raise
        except Exception as exc:  # msgpack raises ValueError, TypeError, StackError, ...
            raise CodecError(f"malformed message: {type(exc).__name__}: {exc}") from exc

    def decode_fields(
        self,
        meta: bytes | bytearray | memoryview,
        buffers: Sequence[bytearray | memoryview | bytes] = (),
    ) -> Any:
        """As :meth:`decode`, but every registered model or dataclass stays its field map
        (:class:`StoredObject`), and an Enum whose name is not registered stays its value: for
        stored state, which the current schema then validates field by field, whatever the
        classes are called now (silo/catalog/evolution.py)."""
        try:
            return _unpackb(meta, ext_hook=_FieldsHook(self, buffers), raw=False, strict_map_key=False)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"malformed message: {type(exc).__name__}: {exc}") from exc

    def build(self, stored: StoredObject) -> Any:
        """The registered class a :class:`StoredObject` was written as, built from its fields."""
        return self._build(stored.wire_name, dict(stored))

    def _no_buffers_hook(self, code: int, data: bytes) -> Any:
        return self._decode_ext(code, data, (), self._hook0)

    def loads(self, data: bytes | bytearray | memoryview) -> Any:
        view = memoryview(data).cast("B")
        version, count = _BLOB_HEAD.unpack_from(view) if len(view) >= _BLOB_HEAD.size else (0, 0)
        start = _BLOB_HEAD.size + 8 * (count + 1)
        if version != _BLOB_VERSION or start > len(view):
            raise CodecError(f"not a codec blob ({len(view)} bytes, version {version})")
        lengths = struct.unpack_from(f"<{count + 1}Q", view, _BLOB_HEAD.size)
        if start + sum(lengths) != len(view):
            raise CodecError(f"blob holds {len(view) - start} bytes of payload but its header"
                             f" describes {sum(lengths)}")  # fmt: skip
        parts = []
        for n in lengths:
            parts.append(view[start : start + n])
            start += n
        return self.decode(parts[0], parts[1:])

    def _unpack(self, data: bytes, hook: Any, kind: type = list) -> Any:
        if hook is None:  # a header we wrote ourselves: natives only, ExtType stays inert
            value = _unpackb(data, raw=False, strict_map_key=False)
        else:
            value = _unpackb(data, ext_hook=hook, raw=False, strict_map_key=False)
        if type(value) is not kind:
            raise CodecError(f"ext payload should be a {kind.__name__}, got {type(value).__name__}")
        return value

    def _decode_ext(self, code: int, data: bytes, bufs: Sequence[Any], hook: Any) -> Any:
        if code == _TUPLE:
            return tuple(self._unpack(data, hook))
        if code == _OBJECT or code == _ENUM:
            items = self._unpack(data, hook)
            if len(items) != 2 or type(items[0]) is not str:
                raise CodecError("registered value should be [name: str, fields]")
            if type(hook) is _FieldsHook:
                name, fields = items
                if code == _ENUM:
                    # Unknown (renamed) or no longer a member: the value, for the schema to judge.
                    try:
                        return self._build(name, fields)
                    except CodecError:
                        return fields
                if type(fields) is not dict:
                    raise CodecError(f"fields of {name!r} should be a map")
                return StoredObject(name, fields)
            return self._build(*items)
        if code == _TENSOR or code == _NDARRAY:
            return self._decode_array(data, bufs, tensor=code == _TENSOR)
        if code == _BYTES:
            return bytes(self._buffer(self._unpack(data, None, int), bufs))
        if code == _SET or code == _FROZENSET:
            return (set if code == _SET else frozenset)(self._unpack(data, hook))
        if code == _UUID:
            return uuid.UUID(bytes=data)
        if code == _DATETIME:
            return dt.datetime.fromisoformat(data.decode())
        if code == _BIGINT:
            return int(data.decode())  # at most 4300 digits: the interpreter's own limit
        if code in _ID_FIELDS:
            cls, kinds = _ID_FIELDS[code]
            items = self._unpack(data, None)
            if list(map(type, items)) != kinds:
                raise CodecError(f"{cls.__name__} fields should be {kinds}, got {items!r:.200}")
            return cls(*items)
        if code == _OBSERVER:
            return self._decode_observer(self._unpack(data, None))
        if code == _LOCAL_REF:
            refs = getattr(hook, "refs", None)
            index = self._unpack(data, None, int)
            if refs is None or not 0 <= index < len(refs):
                raise CodecError("a local reference outside a copy (it never travels)")
            return refs[index]
        raise CodecError(f"unknown ext type code {code}")

    def _decode_observer(self, items: list[Any]) -> ObserverRef:
        if not (
            len(items) == 5 and type(items[0]) is str and type(items[1]) is str and items[0] and items[1]
            and all(type(x) is list and all(type(n) is str for n in x) for x in items[2:])
        ):  # fmt: skip
            raise CodecError(f"observer reference should be [owner, id, [methods], [one-way], [gateways]], got {items!r:.200}")
        oid = ObserverId(items[0], items[1])
        methods, one_way, gateways = frozenset(items[2]), frozenset(items[3]), tuple(items[4])
        if self.observers is None:
            return ObserverRef(_UNBOUND, oid, methods, one_way, gateways)
        return self.observers.bind(oid, methods, one_way, gateways)

    def _build(self, name: str, fields: Any) -> Any:
        cls = self.registry._by_name.get(name)
        if cls is None:
            raise CodecError(f"unknown wire type {name!r}: register it in this codec's registry")
        try:
            if issubclass(cls, enum.Enum):
                return cls(fields)
            if type(fields) is not dict:
                raise CodecError(f"fields of {name!r} should be a map")
            if issubclass(cls, BaseModel):
                return cls.model_validate(fields)  # keeps tensors and arrays as they are
            return cls(**fields)
        except ValidationError as exc:
            raise CodecError(f"invalid {name!r} on the wire: {exc}") from exc
        except (CodecError, RecursionError):
            raise
        except Exception as exc:  # Enum lookup, dataclass __init__ / __post_init__
            raise CodecError(f"cannot build {name!r} from the wire: {exc!r}") from exc

    @staticmethod
    def _buffer(index: int, bufs: Sequence[Any]) -> memoryview:
        if not 0 <= index < len(bufs):
            raise CodecError(f"buffer index {index} out of range: message has {len(bufs)} buffers")
        return memoryview(bufs[index]).cast("B")

    def _sized_buffer(
        self, index: int, bufs: Sequence[Any], shape: list, size: int, dtype: str
    ) -> memoryview:
        buf = self._buffer(index, bufs)
        if math.prod(shape) * size != buf.nbytes:
            raise CodecError(f"{dtype} array of shape {shape} needs {math.prod(shape) * size}"
                             f" bytes, buffer {index} holds {buf.nbytes}")  # fmt: skip
        return buf

    def _decode_array(self, data: bytes, bufs: Sequence[Any], *, tensor: bool) -> Any:
        header = self._unpack(data, None)
        dtype_name, shape, index = header if len(header) == 3 else (None, None, None)
        if not (type(dtype_name) is str and type(index) is int and type(shape) is list
                and len(shape) <= _MAX_DIMS and all(type(d) is int and d >= 0 for d in shape)):  # fmt: skip
            raise CodecError(f"array header should be [dtype: str, shape: up to {_MAX_DIMS} ints"
                             f" >= 0, buffer index: int], got {header!r:.200}")  # fmt: skip
        if tensor:
            import torch

            tdtype = _torch_dtypes().get(dtype_name)
            if tdtype is None:
                raise CodecError(f"unknown tensor dtype {dtype_name!r}")
            buf = self._sized_buffer(index, bufs, shape, tdtype.itemsize, dtype_name)
            if not buf.nbytes:
                return torch.empty(shape, dtype=tdtype)
            if buf.readonly:  # torch.frombuffer warns on read-only memory
                buf = memoryview(bytearray(buf))
            return torch.frombuffer(buf, dtype=tdtype).view(shape)
        import numpy as np

        if not _NP_DTYPE.fullmatch(dtype_name):
            raise CodecError(f"unknown or unsupported numpy dtype {dtype_name!r}")
        ndtype = np.dtype(dtype_name)
        buf = self._sized_buffer(index, bufs, shape, ndtype.itemsize, dtype_name)
        if not buf.nbytes:
            return np.empty(shape, dtype=ndtype)
        return np.frombuffer(buf, dtype=ndtype).reshape(shape)
