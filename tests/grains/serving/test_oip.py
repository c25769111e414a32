"""The V2 codec: requests parsed by hand (no pydantic per request) still say what is wrong, exactly."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grains.serving import oip
from grains.serving.errors import BadInputError


def body(**request: Any) -> bytes:
    return json.dumps(request).encode()


def test_json_tensor_is_parsed_with_its_shape_dtype_and_the_request_id():
    req, tensors = oip.decode_request(
        body(id="7", inputs=[{"name": "x", "datatype": "INT32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}]), None
    )
    assert req.id == "7"
    assert tensors["x"].dtype == torch.int32 and tensors["x"].tolist() == [[1, 2], [3, 4]]


def test_binary_tensor_is_a_view_of_the_body_not_a_copy():
    head = body(inputs=[{"name": "x", "datatype": "FP32", "shape": [1, 3], "parameters": {"binary_data_size": 12}}])
    raw = bytearray(head + struct.pack("<3f", 1.0, 2.0, 3.0))
    _, tensors = oip.decode_request(raw, len(head))  # type: ignore[arg-type]
    assert tensors["x"].tolist() == [[1.0, 2.0, 3.0]]
    raw[len(head) : len(head) + 4] = struct.pack("<f", 9.0)
    assert tensors["x"][0, 0].item() == 9.0


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        ([1], "a JSON object is expected"),
        ({}, "request has no 'inputs'"),
        ({"inputs": {"name": "x"}}, "request.inputs is dict, not an array"),
        ({"inputs": [3]}, "inputs[0] is not an object"),
        ({"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}, "inputs[0] has no 'name'"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": "1", "data": [1]}]}, "inputs[0].shape is str, not an array"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1.5], "data": [1]}]}, "holds 1.5, not an integer"),
        ({"inputs": [{"name": "x", "datatype": 32, "shape": [1], "data": [1]}]}, "inputs[0].datatype is int, not a string"),
        ({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}, "datatype 'BYTES' is not served"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}, "1 values for shape [2]"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}, "data is not FP32"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}, "neither data nor binary_data_size"),
        ({"id": 5, "inputs": []}, "id is int, not a string"),
        ({"inputs": [], "outputs": [{"parameters": {}}]}, "outputs[0] has no 'name'"),
    ],
)
def test_malformed_request_is_a_bad_input_naming_the_field(request_: Any, says: str):
    with pytest.raises(BadInputError) as err:
        oip.decode_request(json.dumps(request_).encode(), None)
    assert says in str(err.value)


def test_binary_size_that_does_not_fit_the_shape_or_the_body_is_refused():
    head = body(inputs=[{"name": "x", "datatype": "FP32", "shape": [1, 3], "parameters": {"binary_data_size": 8}}])
    with pytest.raises(BadInputError, match="binary_data_size 8 does not hold shape"):
        oip.decode_request(head + bytes(8), len(head))
    with pytest.raises(BadInputError, match="is 999, the body has"):
        oip.decode_request(head, 999)


def test_response_is_binary_only_where_asked_and_json_values_round_trip():
    out = {"a": torch.tensor([[1.5, -2.0]]), "b": torch.tensor([[3]], dtype=torch.int64)}
    req = oip.Request(id="r", outputs=[oip.Wanted("a", {"binary_data": True}), oip.Wanted("b")])
    payload, json_length = oip.encode_response(req, "m", "v1", out)
    assert json_length is not None
    head = json.loads(payload[:json_length])
    assert head["id"] == "r" and head["model_version"] == "v1"
    assert head["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert head["outputs"][1] == {"name": "b", "shape": [1, 1], "datatype": "INT64", "data": [3]}
    assert struct.unpack("<2f", payload[json_length:]) == (1.5, -2.0)
    plain, none = oip.encode_response(oip.Request(), "m", "v1", {"a": out["a"]})
    assert none is None and json.loads(plain)["outputs"][0]["data"] == [1.5, -2.0]
    with pytest.raises(BadInputError, match="has no output 'c'"):
        oip.encode_response(oip.Request(outputs=[oip.Wanted("c")]), "m", "v1", out)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["inputs", "name", "datatype", "shape", "data", "parameters", "binary_data_size", "outputs", "id"]), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(json_values, st.binary(max_size=16))
def test_any_json_body_is_parsed_or_refused_as_bad_input_never_another_error(doc: Any, tail: bytes):
    head = json.dumps(doc).encode()
    for raw, length in ((head, None), (head + tail, len(head))):
        try:
            oip.decode_request(raw, length)
        except BadInputError:
            pass
