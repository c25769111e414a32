"""The Open Inference Protocol (KServe V2 REST) on the wire: its JSON schemas and tensor codec.

A request body is JSON, or, with Triton's binary tensor extension, JSON
followed by raw tensor bytes: the ``Inference-Header-Content-Length`` header
gives the JSON's length, and each input carrying a ``binary_data_size``
parameter takes that many bytes of what follows, in the order of the inputs
(row-major, little-endian, the datatype's width). Outputs come back the same
way when the request asks for it: ``binary_data_output`` among the request's
parameters (``tritonclient`` sets it when it names no outputs) or
``binary_data`` on a requested output (its default). Tensors of datatype
``BYTES`` (strings) are not taken: a served model here takes numbers.

The whole body is copied once into a ``bytearray``; binary inputs are torch
views of it, so a big tensor is not copied again before it goes to a grain.

The pydantic models below document the schema (the OpenAPI page shows them)
and type the metadata answers; the infer path does not build them. Parsing a
request with ``InferenceRequest.model_validate`` and writing its answer with
``model_dump_json`` cost a third of the front's time per single-row request
(docs/serving.md, "Where the HTTP time goes"), so :func:`decode_request`
checks the few fields it reads by hand, with orjson, and says which one is
wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson
import torch
from pydantic import BaseModel, Field

from grains.serving.errors import BadInputError
from grains.serving.loader import DATATYPES, DTYPES

HEADER = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


class MetadataTensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str] = Field(default_factory=list)
    platform: str
    inputs: list[MetadataTensor]
    outputs: list[MetadataTensor]
    parameters: dict[str, Any] = Field(default_factory=dict)


class RequestInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: Any = None


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


@dataclass(frozen=True, slots=True)
class Wanted:
    """An output the request names, with its parameters (``binary_data``)."""

    name: str
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """What the answer needs of a request: its id, its parameters and the outputs it names."""

    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[Wanted] | None = None


_WIDTH = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPES.values()}


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, required: bool = True) -> Any:
    v = obj.get(key)
    if v is None:
        if required:
            raise BadInputError(f"malformed inference request: {where} has no {key!r}")
        return None
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadInputError(f"malformed inference request: {where}.{key} is {type(v).__name__}, not {_JSON_NAME.get(want, want)}")
    return v


_JSON_NAME = {"dict": "an object", "list": "an array", "str": "a string", "int": "an integer"}


def _shape(inp: dict[str, Any], where: str) -> list[int]:
    shape = _field(inp, "shape", list, where)
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool):
            raise BadInputError(f"malformed inference request: {where}.shape {shape} holds {d!r}, not an integer")
    return shape


def decode_request(body: bytes, header_length: int | None) -> tuple[Request, dict[str, torch.Tensor]]:
    """The request and its input tensors by name; BadInputError saying what is malformed."""
    if header_length is not None and not 0 <= header_length <= len(body):
        raise BadInputError(f"{HEADER} is {header_length}, the body has {len(body)} bytes")
    json_end = header_length if header_length is not None else len(body)
    try:
        doc = orjson.loads(memoryview(body)[:json_end])
    except orjson.JSONDecodeError as exc:
        raise BadInputError(f"malformed inference request: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadInputError(f"malformed inference request: a JSON object is expected, not {type(doc).__name__}")
    inputs = _field(doc, "inputs", list, "request")
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise BadInputError(f"malformed inference request: id is {type(rid).__name__}, not a string")
    params = _field(doc, "parameters", dict, "request", required=False)
    outputs = None
    if (outs := _field(doc, "outputs", list, "request", required=False)) is not None:
        outputs = []
        for k, o in enumerate(outs):
            if not isinstance(o, dict):
                raise BadInputError(f"malformed inference request: outputs[{k}] is not an object")
            outputs.append(Wanted(_field(o, "name", str, f"outputs[{k}]"), _field(o, "parameters", dict, f"outputs[{k}]", required=False)))
    # The binary tensors follow the JSON; they need their own copy only when the body is
    # immutable bytes (torch.frombuffer wants a writable buffer) and a binary input exists.
    raw: bytearray | None = None
    offset = json_end
    tensors: dict[str, torch.Tensor] = {}
    for k, inp in enumerate(inputs):
        if not isinstance(inp, dict):
            raise BadInputError(f"malformed inference request: inputs[{k}] is not an object")
        where = f"inputs[{k}]"
        name = _field(inp, "name", str, where)
        datatype = _field(inp, "datatype", str, where)
        shape = _shape(inp, where)
        dtype = DTYPES.get(datatype)
        if dtype is None:
            raise BadInputError(f"input {name}: datatype {datatype!r} is not served (numbers only: {sorted(DTYPES)})")
        if any(d < 0 for d in shape):
            raise BadInputError(f"input {name}: shape {shape} has a negative dimension")
        count = math.prod(shape)
        iparams = _field(inp, "parameters", dict, where, required=False)
        size = iparams.get("binary_data_size") if iparams else None
        if size is not None:
            width = _WIDTH[dtype]
            if not isinstance(size, int) or size != count * width or offset + size > len(body):
                raise BadInputError(f"input {name}: binary_data_size {size} does not hold shape {shape} of"
                                    f" {datatype} ({count * width} bytes) within the body")  # fmt: skip
            if count == 0:
                t = torch.empty(shape, dtype=dtype)
            else:
                if raw is None:
                    raw = body if isinstance(body, bytearray) else bytearray(body)
                t = torch.frombuffer(raw, dtype=dtype, count=count, offset=offset).reshape(shape)
                if offset % width:  # unaligned in the body: give torch an aligned copy
                    t = t.clone()
            offset += size
        else:
            data = inp.get("data")
            if data is None:
                raise BadInputError(f"input {name} has neither data nor binary_data_size")
            flat = _flatten(data)
            if len(flat) != count:
                raise BadInputError(f"input {name}: {len(flat)} values for shape {shape} ({count})")
            try:
                t = torch.tensor(flat, dtype=dtype).reshape(shape)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise BadInputError(f"input {name}: data is not {datatype}: {exc}") from None
        if name in tensors:
            raise BadInputError(f"input {name} is given twice")
        tensors[name] = t
    return Request(rid, params, outputs), tensors


def _binary_wanted(req: Request, name: str) -> bool:
    for out in req.outputs or []:
        if out.name == name and out.parameters and "binary_data" in out.parameters:
            return bool(out.parameters["binary_data"])
    return bool((req.parameters or {}).get("binary_data_output", False))


def encode_response(req: Request, model: str, version: str, outputs: dict[str, torch.Tensor]) -> tuple[bytes, int | None]:
    """The response body, and the JSON's length when binary tensors follow it (else None)."""
    names = [o.name for o in req.outputs] if req.outputs else list(outputs)
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise BadInputError(f"model {model} has no output {unknown[0]!r}; it has {sorted(outputs)}")
    described: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for n in names:
        t = outputs[n].detach().to("cpu").contiguous()
        datatype = DATATYPES.get(t.dtype)
        if datatype is None:
            raise TypeError(f"output {n} has dtype {t.dtype}, which the protocol cannot carry")
        shape = list(t.shape)
        if _binary_wanted(req, n):
            raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
            blobs.append(raw)
            described.append({"name": n, "shape": shape, "datatype": datatype, "parameters": {"binary_data_size": len(raw)}})
        else:
            # orjson writes a numpy array's values directly, without a Python float each.
            values = (t.float() if t.dtype == torch.bfloat16 else t).flatten().numpy()
            described.append({"name": n, "shape": shape, "datatype": datatype, "data": values})
    resp: dict[str, Any] = {"model_name": model, "model_version": version}
    if req.id is not None:
        resp["id"] = req.id
    resp["outputs"] = described
    head = orjson.dumps(resp, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)
