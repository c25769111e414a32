"""The codec: every supported kind round-trips bit-exact, buffers stay zero-copy, and
anything malformed comes back as CodecError and nothing else."""

import dataclasses
import datetime as dt
import enum
import math
import struct
import sys
import threading
import uuid
from typing import Annotated, Any, ClassVar, Optional

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pydantic import BaseModel, ConfigDict

from grains.ids import GrainId, SiloAddress
from silo.codec import Codec, Encoded, TypeRegistry
from silo.errors import CodecError, ConfigError

# --- helpers ------------------------------------------------------------------


def roundtrip(codec: Codec, value: Any, *, writable: bool = True) -> Any:
    """Encode, move the buffers as a transport would (into fresh bytearrays), decode."""
    enc = codec.encode(value)
    moved = [bytearray(b) if writable else bytes(b) for b in enc.buffers]
    return codec.decode(enc.meta, moved)


def canon(x: Any) -> Any:
    """A hashable, type-strict, bit-exact picture of a value (NaN-safe, 1 != 1.0 != True)."""
    if isinstance(x, float):
        return ("float", struct.pack("<d", x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(canon(i) for i in x))
    if isinstance(x, dict):
        return ("dict", tuple((canon(k), canon(v)) for k, v in x.items()))
    if isinstance(x, (set, frozenset)):
        return (type(x).__name__, frozenset(canon(i) for i in x))
    if isinstance(x, dt.datetime):
        return ("datetime", x, x.utcoffset())
    return (type(x).__name__, x)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(b) is torch.Tensor
    assert (b.dtype, b.shape, b.requires_grad) == (a.dtype, a.shape, False)
    assert torch.equal(bits(a), bits(b))


def assert_same_array(a: np.ndarray, b: np.ndarray) -> None:
    assert type(b) is np.ndarray
    assert (b.dtype, b.shape) == (a.dtype, a.shape)
    assert a.tobytes() == b.tobytes()


def buffer_address(buf: Any) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


# --- wire types used below ----------------------------------------------------


class Leaf(BaseModel):
    x: int


class Inner(BaseModel):
    leaves: list[Leaf]


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass
class Point:
    x: float
    color: Color


@dataclasses.dataclass(frozen=True)
class Tag:
    name: str


class Request(BaseModel):
    inner: Inner | None = None


class Deep(BaseModel):
    tags: dict[str, Tag]


class Weights(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    name: str
    tensor: torch.Tensor
    array: np.ndarray
    inner: Inner
    pair: tuple[int, str]
    extra: dict[str, Any] = {}


class Unused(BaseModel):
    y: int


async def handler(
    a: list[Request] | None,
    b: dict[str, Point],
    c: Annotated[tuple[Level, ...], "meta"],
    d: Optional[Deep] = None,  # noqa: UP045 - the old spelling must be walked too
) -> Inner:
    raise NotImplementedError


def half_resolvable(a: "NoSuchType", b: list[Tag]) -> None:  # type: ignore[name-defined]  # noqa: F821
    raise NotImplementedError


class CounterGrain:
    class State(BaseModel):
        points: list[Point] = []

    async def add(self, leaf: Leaf) -> None: ...

    async def _private(self, unused: Unused) -> None: ...


def full_registry() -> TypeRegistry:
    reg = TypeRegistry()
    for cls in (Leaf, Inner, Color, Level, Point, Tag, Request, Deep, Weights):
        reg.register(cls)
    return reg


CODEC = Codec(full_registry())
ALL_TORCH_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128,
    torch.complex64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip


# --- natives ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 10**100,
        -(10**100), 1.5, -0.0, math.inf, "", "héllo", b"", b"\x00\xff", [], (), {}, [1, [2, (3,)]],
        (1, "a", None), {"a": 1, 2: "b", (1, 2): [3], None: 0.5, b"k": frozenset({1})},
        {1, "x", (2, 3)}, frozenset(), frozenset({frozenset({1})}), set(),
        uuid.UUID(int=0), uuid.uuid4(),
        dt.datetime(2024, 2, 29, 12, 30, 1, 999999),
        dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
        dt.datetime(2024, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=-5, minutes=-30))),
        GrainId("Counter", "a/b"), SiloAddress("10.0.0.1", 11111, 7),
        {"id": GrainId.of("X", 1), "at": [SiloAddress("h", 1)]},
    ],
)  # fmt: skip
def test_native_and_builtin_values_round_trip_with_their_types(value: Any) -> None:
    assert canon(roundtrip(CODEC, value)) == canon(value)


def test_nan_round_trips_bit_exact() -> None:
    nan = struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]
    assert canon(roundtrip(CODEC, [nan])) == canon([nan])


def test_bytearray_and_memoryview_decode_as_bytes() -> None:
    strided = memoryview(bytes(range(10)))[::2]
    assert roundtrip(CODEC, [bytearray(b"ab"), memoryview(b"cd"), strided]) == [
        b"ab",
        b"cd",
        bytes(range(0, 10, 2)),
    ]


def test_small_call_arguments_need_no_buffers() -> None:
    enc = CODEC.encode(("hello", 42, {"a": 1}))
    assert enc.buffers == [] and enc.nbytes == len(enc.meta) < 32
    assert CODEC.decode(enc.meta) == ("hello", 42, {"a": 1})


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_big_bytes_travel_out_of_band_without_a_copy(kind: type) -> None:
    payload = kind(bytes(range(256)) * 256)  # 64 KiB, right at the threshold
    enc = CODEC.encode({"blob": payload, "n": 1})
    assert len(enc.meta) < 100 and len(enc.buffers) == 1
    assert enc.nbytes == len(enc.meta) + 65536
    assert buffer_address(enc.buffers[0]) == buffer_address(payload)
    assert roundtrip(CODEC, payload) == bytes(payload)


def test_oob_threshold_is_configurable() -> None:
    codec = Codec(oob_threshold=4)
    assert len(codec.encode(b"abc").buffers) == 0
    assert len(codec.encode(b"abcd").buffers) == 1
    assert roundtrip(codec, (b"abcd", b"abc")) == (b"abcd", b"abc")


def test_big_native_values_still_encode() -> None:
    value = {"xs": list(range(50_000)), "s": "x" * 100_000}
    enc = CODEC.encode(value)
    assert enc.buffers == []
    assert CODEC.decode(enc.meta) == value


# --- tensors and arrays -------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (5,), (2, 3, 4)], ids=str)
def test_tensor_of_every_dtype_and_shape_round_trips(dtype: torch.dtype, shape: tuple) -> None:
    t = (torch.arange(math.prod(shape)) % 2).to(dtype).reshape(shape)
    out = roundtrip(CODEC, t)
    assert_same_tensor(t, out)
    enc = CODEC.encode(t)
    assert len(enc.buffers) == 1 and enc.buffers[0].nbytes == t.numel() * t.element_size()


def test_non_contiguous_grad_and_conjugate_tensors_round_trip_as_plain_values() -> None:
    base = torch.randn(4, 6, requires_grad=True)
    cases = [
        base.t(),
        base[:, ::2],
        torch.nn.Parameter(torch.randn(3)),
        torch.randn(3, dtype=torch.complex64).conj(),
        -torch.randn(3, dtype=torch.complex64).conj(),
        torch.randn(8)[2:5],
    ]
    for t in cases:
        out = roundtrip(CODEC, t)
        assert_same_tensor(t.detach().resolve_conj().resolve_neg(), out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_decodes_on_the_cpu() -> None:
    t = torch.randn(3, 5, device="cuda", dtype=torch.bfloat16)
    out = roundtrip(CODEC, t)
    assert out.device.type == "cpu"
    assert_same_tensor(t.cpu(), out)


def test_64mb_tensor_is_zero_copy_both_ways() -> None:
    t = torch.randn(16 * 1024 * 1024)
    enc = CODEC.encode({"w": t})
    (buf,) = enc.buffers
    assert buf.nbytes == 64 * 1024 * 1024
    assert buffer_address(buf) == t.data_ptr()
    assert np.shares_memory(np.asarray(buf), t.numpy())
    received = bytearray(buf)  # what recv_into fills
    out = CODEC.decode(enc.meta, [received])["w"]
    assert out.data_ptr() == buffer_address(received)
    assert torch.equal(out, t)
    out[0] = 1234.0  # writable, and it is the bytearray's memory
    assert struct.unpack_from("<f", received)[0] == 1234.0


def test_tensor_from_read_only_buffer_is_copied_and_writable() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    out = roundtrip(CODEC, t, writable=False)
    assert_same_tensor(t, out)
    out += 1  # would fail (or warn) on read-only memory


def test_tensor_keeps_its_memory_alive_after_the_source_is_dropped() -> None:
    enc = CODEC.encode(torch.full((1000,), 7, dtype=torch.int32))
    # the only reference to the tensor is now inside enc.buffers
    assert CODEC.decode(enc.meta, [bytearray(enc.buffers[0])]).sum().item() == 7000


@pytest.mark.parametrize(
    "array",
    [
        np.arange(10, dtype=np.float32),
        np.array(3.5),
        np.zeros((0, 4), dtype=np.int64),
        np.arange(24, dtype=">i4").reshape(2, 3, 4),
        np.array([True, False]),
        np.array(["ab", "c"]),
        np.array([b"xy"]),
        np.array(["2024-01-01", "NaT"], dtype="datetime64[ns]"),
        np.array([1, 2], dtype="timedelta64[s]"),
        np.arange(12, dtype=np.complex128).reshape(3, 4).T,
        np.arange(20, dtype=np.uint16)[::3],
    ],
    ids=lambda a: f"{a.dtype}{a.shape}",
)
def test_ndarray_round_trips(array: np.ndarray) -> None:
    assert_same_array(array, roundtrip(CODEC, array))


def test_contiguous_ndarray_is_zero_copy_and_decodes_writable_from_a_bytearray() -> None:
    a = np.arange(100_000, dtype=np.float64)
    enc = CODEC.encode(a)
    assert np.shares_memory(np.asarray(enc.buffers[0]), a)
    received = bytearray(enc.buffers[0])
    out = CODEC.decode(enc.meta, [received])
    assert out.flags.writeable and buffer_address(received) == out.ctypes.data
    assert not roundtrip(CODEC, a, writable=False).flags.writeable


# --- registered types ---------------------------------------------------------


def test_pydantic_model_with_tensor_array_and_nested_models_round_trips() -> None:
    w = Weights(
        name="layer0",
        tensor=torch.randn(4, 4, dtype=torch.bfloat16),
        array=np.arange(5, dtype=np.int8),
        inner=Inner(leaves=[Leaf(x=1), Leaf(x=2)]),
        pair=(1, "a"),
        extra={"at": uuid.UUID(int=5), "big": torch.ones(2)},
    )
    enc = CODEC.encode(w)
    assert len(enc.buffers) == 3
    out = CODEC.decode(enc.meta, [bytearray(b) for b in enc.buffers])
    assert type(out) is Weights and out.name == "layer0" and out.pair == (1, "a")
    assert out.inner == w.inner and type(out.inner.leaves[0]) is Leaf
    assert_same_tensor(w.tensor, out.tensor)
    assert_same_array(w.array, out.array)
    assert out.extra["at"] == uuid.UUID(int=5)
    assert_same_tensor(w.extra["big"], out.extra["big"])


def test_pydantic_extra_fields_survive() -> None:
    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")
        a: int

    codec = Codec()
    codec.registry.register(Open)
    out = roundtrip(codec, Open(a=1, b=(2, 3)))  # type: ignore[call-arg]
    assert out.a == 1 and out.b == (2, 3)


def test_dataclasses_and_enums_round_trip() -> None:
    value = [Point(1.5, Color.BLUE), Tag("t"), {Tag("k"): Level.HIGH}, Color.RED]
    out = roundtrip(CODEC, value)
    assert out == value
    assert type(out[2][Tag("k")]) is Level and type(out[3]) is Color


def test_int_and_str_enums_are_not_sent_as_plain_values() -> None:
    out = roundtrip(CODEC, (Level.LOW, [Level.HIGH]))
    assert type(out[0]) is Level and type(out[1][0]) is Level


def test_explicit_wire_name_is_used() -> None:
    reg = TypeRegistry()
    reg.register(Leaf, name="app.Leaf")
    enc = Codec(reg).encode(Leaf(x=3))
    assert b"app.Leaf" in enc.meta
    assert Codec(reg).decode(enc.meta) == Leaf(x=3)


# --- registry -----------------------------------------------------------------


def test_register_is_idempotent_and_returns_the_class() -> None:
    reg = TypeRegistry()
    assert reg.register(Leaf) is Leaf
    assert reg.register(Leaf) is Leaf
    assert reg.register(Leaf, "Leaf") is Leaf
    assert reg.names() == ["Leaf"]


def test_register_rejects_a_taken_name_a_second_name_and_unsupported_classes() -> None:
    reg = TypeRegistry()
    reg.register(Leaf, "shared")
    with pytest.raises(ConfigError, match="'shared' is taken by .*Leaf"):
        reg.register(Tag, "shared")
    with pytest.raises(ConfigError, match="already registered as 'shared'"):
        reg.register(Leaf, "other")
    with pytest.raises(ConfigError, match="only pydantic models, dataclasses and Enums"):
        reg.register(dict)


class Renamed(BaseModel):
    """``Leaf`` after a rename: values stored under the old name still decode, as this class."""

    __wire_aliases__: ClassVar[tuple[str, ...]] = ("Leaf",)
    x: int


def test_a_renamed_class_reads_values_stored_under_its_alias_and_writes_its_new_name() -> None:
    old = TypeRegistry()
    old.register(Leaf)
    stored = Codec(old).encode(Leaf(x=7))
    new = TypeRegistry()
    new.register(Renamed)
    codec = Codec(new)
    assert codec.decode(stored.meta, stored.buffers) == Renamed(x=7)
    assert b"Renamed" in codec.encode(Renamed(x=7)).meta and b"Leaf" not in codec.encode(Renamed(x=7)).meta
    assert new.names() == ["Renamed"]


def test_an_alias_taken_by_another_class_is_refused() -> None:
    reg = TypeRegistry()
    reg.register(Leaf)
    with pytest.raises(ConfigError, match="wire alias 'Leaf' of .*Renamed is taken by .*Leaf"):
        reg.register(Renamed)


def test_grain_ids_need_no_registration() -> None:
    reg = TypeRegistry()
    reg.register(GrainId)
    assert reg.names() == []


def test_registries_are_isolated_and_copies_are_independent() -> None:
    a, b = TypeRegistry(), TypeRegistry()
    a.register(Leaf)
    with pytest.raises(CodecError, match="Leaf.*register it"):
        Codec(b).encode(Leaf(x=1))
    enc = Codec(a).encode(Leaf(x=1))
    with pytest.raises(CodecError, match="unknown wire type 'Leaf'"):
        Codec(b).decode(enc.meta)
    c = a.copy()
    c.register(Tag)
    assert a.names() == ["Leaf"] and c.names() == ["Leaf", "Tag"]


def test_registering_after_the_codec_is_built_takes_effect() -> None:
    codec = Codec()
    with pytest.raises(CodecError):
        codec.encode(Tag("a"))
    codec.registry.register(Tag)
    assert roundtrip(codec, Tag("a")) == Tag("a")


def test_register_annotations_finds_types_nested_anywhere_in_a_signature() -> None:
    reg = TypeRegistry()
    reg.register_annotations(handler)
    assert reg.names() == sorted(
        ["Request", "Inner", "Leaf", "Point", "Color", "Level", "Deep", "Tag"]
    )


def test_register_annotations_skips_unresolvable_hints_but_keeps_the_rest() -> None:
    reg = TypeRegistry()
    reg.register_annotations(half_resolvable)
    assert reg.names() == ["Tag"]
    reg.register_annotations(lambda x: x)
    reg.register_annotations(len)


def test_register_annotations_walks_public_methods_and_the_state_model() -> None:
    reg = TypeRegistry()
    reg.register_annotations(CounterGrain)
    assert reg.names() == ["Color", "CounterGrain.State", "Leaf", "Point"]


# --- errors -------------------------------------------------------------------


def array_meta(kind: int, dtype: str, shape: Any, index: Any = 0) -> bytes:
    return msgpack.packb(msgpack.ExtType(kind, msgpack.packb([dtype, shape, index])))


BAD_MESSAGES = [
    (b"\xc1", [], "malformed message"),
    (b"\x92\x01", [], "malformed message"),
    (msgpack.packb(1) + b"\x00", [], "malformed message"),
    (msgpack.packb(msgpack.ExtType(99, b"")), [], "unknown ext type code 99"),
    (array_meta(8, "float32", [4]), [bytearray(8)], "needs 16 bytes, buffer 0 holds 8"),
    (array_meta(9, "<f4", [4]), [bytearray(20)], "needs 16 bytes, buffer 0 holds 20"),
    (array_meta(8, "float32", [2], 3), [bytearray(8)], "buffer index 3 out of range"),
    (array_meta(8, "float32", [2]), [], "buffer index 0 out of range"),
    (array_meta(8, "float128", [1]), [bytearray(16)], "unknown tensor dtype 'float128'"),
    (array_meta(9, "|O8", [1]), [bytearray(8)], "unsupported numpy dtype"),
    (array_meta(9, "V8", [1]), [bytearray(8)], "unsupported numpy dtype"),
    (array_meta(8, "float32", [-1, -4]), [bytearray(16)], "ints >= 0"),
    (array_meta(8, "float32", [2**62, 2**62]), [bytearray(16)], "needs .* bytes"),
    (array_meta(8, "float32", "4"), [bytearray(16)], "array header"),
    (msgpack.packb(msgpack.ExtType(10, msgpack.packb(["Nope", {}]))), [], "unknown wire"),
    (msgpack.packb(msgpack.ExtType(2, msgpack.packb(7))), [], "should be a list"),
    (msgpack.packb(msgpack.ExtType(5, b"short")), [], "malformed message"),
    (msgpack.packb(msgpack.ExtType(12, msgpack.packb(["T", 5]))), [], "GrainId fields"),
]


@pytest.mark.parametrize(
    ("meta", "buffers", "message"), [pytest.param(*case, id=case[2]) for case in BAD_MESSAGES]
)
def test_bad_messages_raise_codec_error_with_the_reason(
    meta: bytes, buffers: list, message: str
) -> None:
    with pytest.raises(CodecError, match=message):
        CODEC.decode(meta, buffers)


def test_pydantic_validation_failure_on_decode_is_a_codec_error() -> None:
    class LeafV2(BaseModel):
        x: list[int]

    sender, receiver = TypeRegistry(), TypeRegistry()
    sender.register(Leaf, "Leaf")
    receiver.register(LeafV2, "Leaf")
    enc = Codec(sender).encode(Leaf(x=1))
    with pytest.raises(CodecError, match="invalid 'Leaf' on the wire"):
        Codec(receiver).decode(enc.meta)


def test_dataclass_and_enum_mismatches_on_decode_are_codec_errors() -> None:
    @dataclasses.dataclass
    class Other:
        y: int

    class Shade(enum.Enum):
        DARK = "dark"

    sender, receiver = TypeRegistry(), TypeRegistry()
    sender.register(Tag, "T")
    sender.register(Color, "C")
    receiver.register(Other, "T")
    receiver.register(Shade, "C")
    with pytest.raises(CodecError, match="cannot build 'T'"):
        Codec(receiver).decode(Codec(sender).encode(Tag("x")).meta)
    with pytest.raises(CodecError, match="cannot build 'C'"):
        Codec(receiver).decode(Codec(sender).encode(Color.RED).meta)


class Stranger:
    pass


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (Stranger(), "tests.silo.test_codec.Stranger: register it"),
        ([1, {"k": (Unused(y=1),)}], "Unused: register it"),
        (object(), "builtins.object"),
        (np.float64(1.0), "numpy.float64"),
        (np.array([object()]), "dtype object"),
        (np.zeros(2, dtype=[("a", "i4")]), "structured"),
        (torch.randn(3, 3).to_sparse(), "layout torch.sparse_coo"),
        (dt.date(2024, 1, 1), "datetime.date"),
        pytest.param(10**5000, "int too large", id="huge-int"),
    ],
)
def test_unsupported_values_raise_codec_error_naming_the_type(value: Any, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        CODEC.encode(value)


def test_a_value_that_contains_itself_is_a_codec_error() -> None:
    loop: list[Any] = [(1,)]
    loop.append(loop)
    with pytest.raises(CodecError, match="nested too deeply"):
        CODEC.encode(loop)


# --- dumps / loads --------------------------------------------------------------


def test_dumps_loads_round_trips_values_with_buffers() -> None:
    value: dict[str, Any] = {"t": torch.arange(5.0), "a": np.ones(3), "b": b"z" * 70_000, "s": "x"}
    blob = CODEC.dumps(value)
    assert isinstance(blob, bytes)
    out = CODEC.loads(blob)
    assert_same_tensor(value["t"], out["t"])
    assert_same_array(value["a"], out["a"])
    assert out["b"] == value["b"] and out["s"] == "x"
    assert CODEC.loads(memoryview(CODEC.dumps(("a", 1)))) == ("a", 1)


def test_loads_from_a_bytearray_is_zero_copy() -> None:
    blob = bytearray(CODEC.dumps(torch.arange(4096, dtype=torch.int64)))
    out = CODEC.loads(blob)
    start = buffer_address(blob)
    assert start <= out.data_ptr() < start + len(blob)


@pytest.mark.parametrize(
    "blob", [b"", b"\x01", b"\x02" + bytes(12), b"\x01\xff\xff\xff\xff", b"\x01" + bytes(12) + b"x"]
)
def test_loads_rejects_broken_blobs(blob: bytes) -> None:
    with pytest.raises(CodecError):
        CODEC.loads(blob)


# --- concurrency ----------------------------------------------------------------


def test_one_codec_is_safe_to_share_between_threads() -> None:
    # Tiny switch interval: a packer that ran Python code mid-pack would mix up outputs here.
    codec = Codec(full_registry())
    failures: list[Any] = []

    def work(i: int) -> None:
        for j in range(1000):
            # even j: all natives, msgpack's fast path; odd j: the walker, with a dataclass
            value = (i, j, {"k": [Point(j, Color.RED) if j % 2 else "p" * (j % 7)]})
            if codec.decode(codec.encode(value).meta) != value:
                failures.append(value)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []


# --- properties -----------------------------------------------------------------

hashable_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.uuids(),
)
hashables = st.recursive(
    hashable_scalars,
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
values = st.recursive(
    hashable_scalars
    | st.datetimes(timezones=st.none() | st.just(dt.UTC))
    | st.builds(GrainId, st.text(max_size=5), st.text(max_size=5)),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(hashables, inner, max_size=4)
        | st.sets(hashables, max_size=4)
    ),
    max_leaves=25,
)


@given(values)
def test_property_any_native_tree_round_trips_exactly(value: Any) -> None:
    assert canon(roundtrip(CODEC, value)) == canon(value)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(ALL_TORCH_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=4))
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype is torch.bool:
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    t = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    t = t.reshape(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, -1)
    return t


@given(st.lists(tensors(), min_size=1, max_size=3))
def test_property_tensors_of_any_dtype_and_shape_round_trip_bit_exact(ts: list) -> None:
    for writable in (True, False):
        out = roundtrip(CODEC, ts, writable=writable)
        for a, b in zip(ts, out, strict=True):
            assert_same_tensor(a, b)


numpy_dtypes = st.sampled_from(
    ["<f8", "<f4", "<f2", ">f8", "<c16", "<i8", "<i4", "<u2", "|i1", "|u1", "|b1", "<M8[us]",
     "<m8[ns]", "<U3", "|S2"]
)  # fmt: skip


@given(
    hnp.arrays(
        dtype=numpy_dtypes,
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    ),
    st.booleans(),
)
def test_property_numpy_arrays_round_trip_bit_exact(array: np.ndarray, strided: bool) -> None:
    if strided and array.ndim >= 1:
        array = array[::-1]
    assert_same_array(array, roundtrip(CODEC, array))


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64), st.lists(st.binary(max_size=32).map(bytearray), max_size=2))
def test_fuzz_random_bytes_only_ever_raise_codec_error(meta: bytes, buffers: list) -> None:
    try:
        CODEC.decode(meta, buffers)
    except CodecError:
        pass


ext_payloads = st.recursive(
    st.one_of(
        st.none(),
        st.integers(-3, 2**40),
        st.text(max_size=6),
        st.binary(max_size=6),
        st.sampled_from(["float32", "bool", "bfloat16", "<f4", "|b1", "<M8[ns]", "Leaf", "Tag"]),
    ),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        | st.builds(
            lambda code, payload: msgpack.ExtType(code, msgpack.packb(payload)),
            st.integers(0, 15),
            inner,
        )
    ),
    max_leaves=10,
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 15),
    ext_payloads,
    st.lists(st.binary(max_size=48).map(bytearray), max_size=2),
)
def test_fuzz_well_formed_but_hostile_ext_payloads_only_raise_codec_error(
    code: int, payload: Any, buffers: list
) -> None:
    meta = msgpack.packb(msgpack.ExtType(code, msgpack.packb(payload)))
    try:
        CODEC.decode(meta, buffers)
    except CodecError:
        pass


@given(st.binary(max_size=64))
def test_fuzz_random_blobs_only_raise_codec_error(blob: bytes) -> None:
    try:
        CODEC.loads(blob)
    except CodecError:
        pass


def test_encoded_reports_its_size() -> None:
    enc = Encoded(b"abc", [memoryview(b"12345")])
    assert enc.nbytes == 8


def test_a_received_tensor_frees_its_buffer_when_dropped_without_the_garbage_collector() -> None:
    # A reference cycle in decoding would keep every received buffer alive until the
    # collector's next pass (hundreds of MB in a silo receiving tensors, each new one on
    # fresh pages): decoding must leave the buffer owned by the tensor alone.
    import gc
    import weakref

    enc = Codec().encode({"t": torch.arange(1 << 16, dtype=torch.float32), "n": [torch.ones(3)]})
    received = [np.frombuffer(bytes(b), np.uint8).copy() for b in enc.buffers]  # as the transport gets them
    alive = [weakref.ref(a) for a in received]
    gc.disable()
    try:
        value = Codec().decode(enc.meta, [memoryview(a) for a in received])
        assert torch.equal(value["t"], torch.arange(1 << 16, dtype=torch.float32))
        del received
        assert any(r() is not None for r in alive)  # the tensors hold them
        del value
        assert all(r() is None for r in alive)
    finally:
        gc.enable()


# --- Codec.copy: what a call to a grain on the same silo passes ----------------------------


class _Part(BaseModel):
    items: list[int]
    t: torch.Tensor
    model_config = ConfigDict(arbitrary_types_allowed=True)


def test_copy_is_the_decoded_encoding_in_memory_of_its_own() -> None:
    reg = TypeRegistry()
    reg.register(_Part)
    codec = Codec(reg)
    value = {"part": _Part(items=[1, 2], t=torch.arange(4.0)), "a": np.arange(3), "l": [[1], (2, 3)]}
    got = codec.copy(value)
    assert got["part"] is not value["part"] and got["part"].items == [1, 2] and torch.equal(got["part"].t, value["part"].t)
    assert got["l"] == [[1], (2, 3)] and got["l"][0] is not value["l"][0]
    got["part"].items.append(9)
    got["part"].t[0] = 100.0
    got["a"][0] = 100
    assert value["part"].items == [1, 2] and value["part"].t[0] == 0.0 and value["a"][0] == 0
    # A value the wire cannot carry fails here as it would there.
    with pytest.raises(CodecError, match="register it"):
        codec.copy([object()])
    # Immutable leaves need no copy at all.
    args = ("x", 1, 2.5, None, b"raw")
    assert codec.copy(args) is args


_PLAIN_LEAVES = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=5) | st.binary(max_size=5)
)  # fmt: skip
_PLAIN = st.recursive(
    _PLAIN_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3) | st.integers() | st.booleans(), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


def _shape(v: object) -> object:
    """``v`` with each container's type written out, to compare two copies' types, not only values."""
    if isinstance(v, dict):
        return ("dict", sorted(((type(k).__name__, repr(k)), _shape(x)) for k, x in v.items()))
    if isinstance(v, list | tuple):
        return (type(v).__name__, [_shape(x) for x in v])
    return (type(v).__name__, v)


@settings(max_examples=200, deadline=None)
@given(_PLAIN)
def test_a_copy_of_plain_containers_is_what_the_wire_gives_back_in_new_containers(value: object) -> None:
    # Codec.copy copies dicts, lists and tuples of scalars by structure, without the walk's
    # msgpack round trip: it must give what the wire gives, and share no container.
    codec = Codec()
    got = codec.copy(value)
    assert _shape(got) == _shape(codec.loads(codec.dumps(value)))
    if isinstance(value, list | dict) or (isinstance(value, tuple) and any(isinstance(x, list | dict | tuple) for x in value)):
        assert got is not value
    if isinstance(value, list) and value and isinstance(value[0], list):
        n = len(value[0])
        got[0].append("x")
        assert len(value[0]) == n


def test_immutable_values_are_passed_by_reference_in_a_copy_and_encoded_on_the_wire() -> None:
    from grains import immutable

    @immutable
    @dataclasses.dataclass
    class Weights:
        w: list[float]

    reg = TypeRegistry()
    reg.register(Weights)
    codec = Codec(reg)
    w, t, a = Weights([1.0]), immutable(torch.ones(3)), immutable(np.ones(2))
    big = b"x" * 100_000
    got = codec.copy([w, t, a, big, torch.ones(2)])
    assert got[0] is w and got[1] is t and got[2] is a and got[3] is big
    assert not a.flags.writeable
    # On the wire the same values are encoded as always: the decoded copy is new.
    enc = codec.encode([w, t])
    back = codec.decode(enc.meta, [bytearray(b) for b in enc.buffers])
    assert back[0] == w and back[0] is not w and torch.equal(back[1], t)


def test_a_local_reference_never_decodes_from_the_wire() -> None:
    codec = Codec()
    forged = msgpack.packb([msgpack.ExtType(14, msgpack.packb(0))])
    with pytest.raises(CodecError, match="local reference"):
        codec.decode(forged)
