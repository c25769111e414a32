"""The Open Inference Protocol's gRPC messages to tensors and back (the gRPC twin of :mod:`oip`).

An input's values come one of two ways, never both in one request: typed,
in the ``contents`` field of its datatype (``fp32_contents``,
``int64_contents``, ...), or raw, as the ``raw_input_contents`` entry of
the same index: its elements row-major, little-endian, unpadded. Raw is
what ``tritonclient`` sends, and the only way FP16 and BF16 travel (no
typed field holds a 16-bit float).

A raw input becomes a torch view of the bytes protobuf hands out (its own
copy out of the message, owned by nobody else), so a big tensor is not
copied again before it goes to a grain.

A response is raw or typed as a whole (the protocol forbids mixing them):
raw when the request's ``binary_data_output`` parameter says so, else when
its inputs came raw -- tritonclient's ``as_numpy`` reads only raw outputs
-- and always when an output is FP16 or BF16.
"""

from __future__ import annotations

import math
import warnings

import torch

from grains.serving.errors import BadInputError
from grains.serving.loader import DATATYPES, DTYPES
from grains.serving.proto import grpc_predict_v2_pb2 as pb

CONTENTS: dict[str, str] = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
}  # fmt: skip
"""The ``InferTensorContents`` field that carries each served datatype; FP16 and BF16 have none."""

_quiet = False
"""Whether torch's one read-only-buffer warning has been spent (by a first raw input)."""


def _from_raw(inp: pb.ModelInferRequest.InferInputTensor, data: bytes, dtype: torch.dtype) -> torch.Tensor:
    shape = list(inp.shape)
    want = math.prod(shape) * dtype.itemsize
    if len(data) != want:
        raise BadInputError(f"input {inp.name}: {len(data)} raw bytes for shape {shape} of {inp.datatype}"
                            f" ({want} bytes)")  # fmt: skip
    if not data:
        return torch.empty(shape, dtype=dtype)
    global _quiet
    if _quiet:
        return torch.frombuffer(data, dtype=dtype).reshape(shape)
    # torch warns, once per process, that ``bytes`` is read-only; nothing else holds this copy, so
    # a model writing into its input would harm no one. The first call silences that one warning;
    # later calls skip the catch_warnings block (about 2 us a request).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        t = torch.frombuffer(data, dtype=dtype).reshape(shape)
    _quiet = True
    return t


def _from_contents(inp: pb.ModelInferRequest.InferInputTensor, dtype: torch.dtype) -> torch.Tensor:
    shape = list(inp.shape)
    field = CONTENTS.get(inp.datatype)
    if field is None:
        raise BadInputError(f"input {inp.name}: {inp.datatype} travels only in raw_input_contents")
    values = getattr(inp.contents, field)
    if len(values) != math.prod(shape):
        raise BadInputError(f"input {inp.name}: {len(values)} values in {field} for shape {shape}"
                            f" ({math.prod(shape)})")  # fmt: skip
    try:
        return torch.tensor(values, dtype=dtype).reshape(shape)
    except (TypeError, ValueError, RuntimeError) as exc:  # an INT8 of 300, say
        raise BadInputError(f"input {inp.name}: {field} is not {inp.datatype}: {exc}") from None


def decode_request(req: pb.ModelInferRequest) -> dict[str, torch.Tensor]:
    """The request's input tensors by name; BadInputError saying what is malformed."""
    raw = req.raw_input_contents
    if raw and len(raw) != len(req.inputs):
        raise BadInputError(f"raw_input_contents has {len(raw)} entries for {len(req.inputs)} inputs")
    tensors: dict[str, torch.Tensor] = {}
    for i, inp in enumerate(req.inputs):
        dtype = DTYPES.get(inp.datatype)
        if dtype is None:
            raise BadInputError(f"input {inp.name}: datatype {inp.datatype!r} is not served (numbers only: {sorted(DTYPES)})")
        if any(d < 0 for d in inp.shape):
            raise BadInputError(f"input {inp.name}: shape {list(inp.shape)} has a negative dimension")
        if raw and inp.HasField("contents"):
            raise BadInputError(f"input {inp.name} has contents in a request with raw_input_contents: one or the other")
        if inp.name in tensors:
            raise BadInputError(f"input {inp.name} is given twice")
        tensors[inp.name] = _from_raw(inp, raw[i], dtype) if raw else _from_contents(inp, dtype)
    return tensors


def _raw_wanted(req: pb.ModelInferRequest, datatypes: list[str]) -> bool:
    if any(d not in CONTENTS for d in datatypes):
        return True
    if "binary_data_output" in req.parameters:
        return req.parameters["binary_data_output"].bool_param
    return bool(req.raw_input_contents)


def _raw_bytes(t: torch.Tensor) -> bytes:
    # numpy has no bfloat16: its bits go out as int16, which is the same bytes.
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def encode_response(
    req: pb.ModelInferRequest, version: str, outputs: dict[str, torch.Tensor]
) -> pb.ModelInferResponse:
    """The response to ``req``: the outputs it names (all when it names none), raw or typed."""
    names = [o.name for o in req.outputs] or list(outputs)
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise BadInputError(f"model {req.model_name} has no output {unknown[0]!r}; it has {sorted(outputs)}")
    tensors = [(n, outputs[n].detach().to("cpu").contiguous()) for n in names]
    datatypes: list[str] = []
    for n, t in tensors:
        datatype = DATATYPES.get(t.dtype)
        if datatype is None:  # the model's fault, not the request's: let it raise
            raise TypeError(f"output {n} has dtype {t.dtype}, which the protocol cannot carry")
        datatypes.append(datatype)
    raw = _raw_wanted(req, datatypes)
    resp = pb.ModelInferResponse(model_name=req.model_name, model_version=version, id=req.id)
    for (n, t), dt in zip(tensors, datatypes, strict=True):
        out = resp.outputs.add(name=n, datatype=dt, shape=list(t.shape))
        if raw:
            resp.raw_output_contents.append(_raw_bytes(t))
        else:
            getattr(out.contents, CONTENTS[dt]).extend(t.flatten().tolist())
    return resp
