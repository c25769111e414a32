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
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from pydantic import BaseModel, Field, ValidationError

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


def decode_request(body: bytes, header_length: int | None) -> tuple[InferenceRequest, dict[str, torch.Tensor]]:
    """The request and its input tensors by name; BadInputError saying what is malformed."""
    if header_length is not None and not 0 <= header_length <= len(body):
        raise BadInputError(f"{HEADER} is {header_length}, the body has {len(body)} bytes")
    raw = bytearray(body)  # the one copy: binary inputs below are views of it
    head = memoryview(raw)[: header_length if header_length is not None else len(raw)]
    try:
        req = InferenceRequest.model_validate(json.loads(head.tobytes()))
    except (ValueError, ValidationError) as exc:
        raise BadInputError(f"malformed inference request: {exc}") from None
    offset = len(head)
    tensors: dict[str, torch.Tensor] = {}
    for inp in req.inputs:
        dtype = DTYPES.get(inp.datatype)
        if dtype is None:
            raise BadInputError(f"input {inp.name}: datatype {inp.datatype!r} is not served (numbers only: {sorted(DTYPES)})")
        if any(d < 0 for d in inp.shape):
            raise BadInputError(f"input {inp.name}: shape {inp.shape} has a negative dimension")
        count = math.prod(inp.shape)
        size = (inp.parameters or {}).get("binary_data_size")
        if size is not None:
            width = torch.empty((), dtype=dtype).element_size()
            if not isinstance(size, int) or size != count * width or offset + size > len(raw):
                raise BadInputError(f"input {inp.name}: binary_data_size {size} does not hold shape {inp.shape} of"
                                    f" {inp.datatype} ({count * width} bytes) within the body")  # fmt: skip
            if count == 0:
                t = torch.empty(inp.shape, dtype=dtype)
            else:
                t = torch.frombuffer(raw, dtype=dtype, count=count, offset=offset).reshape(inp.shape)
                if offset % width:  # unaligned in the body: give torch an aligned copy
                    t = t.clone()
            offset += size
        else:
            if inp.data is None:
                raise BadInputError(f"input {inp.name} has neither data nor binary_data_size")
            flat = _flatten(inp.data)
            if len(flat) != count:
                raise BadInputError(f"input {inp.name}: {len(flat)} values for shape {inp.shape} ({count})")
            try:
                t = torch.tensor(flat, dtype=dtype).reshape(inp.shape)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise BadInputError(f"input {inp.name}: data is not {inp.datatype}: {exc}") from None
        if inp.name in tensors:
            raise BadInputError(f"input {inp.name} is given twice")
        tensors[inp.name] = t
    return req, tensors


def _binary_wanted(req: InferenceRequest, name: str) -> bool:
    for out in req.outputs or []:
        if out.name == name and out.parameters and "binary_data" in out.parameters:
            return bool(out.parameters["binary_data"])
    return bool((req.parameters or {}).get("binary_data_output", False))


def encode_response(
    req: InferenceRequest, model: str, version: str, outputs: dict[str, torch.Tensor]
) -> tuple[bytes, int | None]:
    """The response body, and the JSON's length when binary tensors follow it (else None)."""
    names = [o.name for o in req.outputs] if req.outputs else list(outputs)
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise BadInputError(f"model {model} has no output {unknown[0]!r}; it has {sorted(outputs)}")
    described: list[ResponseOutput] = []
    blobs: list[bytes] = []
    for n in names:
        t = outputs[n].detach().to("cpu").contiguous()
        datatype = DATATYPES.get(t.dtype)
        if datatype is None:
            raise TypeError(f"output {n} has dtype {t.dtype}, which the protocol cannot carry")
        if _binary_wanted(req, n):
            raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
            blobs.append(raw)
            described.append(ResponseOutput(name=n, shape=list(t.shape), datatype=datatype,
                                            parameters={"binary_data_size": len(raw)}))  # fmt: skip
        else:
            described.append(ResponseOutput(name=n, shape=list(t.shape), datatype=datatype,
                                            data=t.float().flatten().tolist() if t.dtype == torch.bfloat16 else t.flatten().tolist()))  # fmt: skip
    resp = InferenceResponse(model_name=model, model_version=version, id=req.id, outputs=described)
    head = resp.model_dump_json(exclude_none=True).encode()
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)
