"""Every kind of call leaves through the one header encoder and comes back whole through the one decoder."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from grains.call import Call
from grains.ids import GrainId
from silo.catalog.internal import REMINDER_METHOD, STREAM_METHOD
from silo.codec import Codec
from silo.messaging.frame import ONEWAY, REQUEST, Frame, packb, unpackb
from silo.messaging.observer_hub import OBSERVER_TYPE
from silo.messaging.request import decode_request, encode_request, request_body
from silo.tracing import carrier_from_header

CODEC = Codec()

names = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=20)
values = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20) | st.binary(max_size=20)
args = st.lists(values, max_size=4).map(tuple)
kwargs = st.none() | st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), values, max_size=3)
chains = st.lists(names, max_size=3).map(tuple)
trace = st.none() | st.just({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})


def _kinds() -> st.SearchStrategy[tuple[str, int, Call]]:
    """(what it is, frame kind, call) for each kind of call the runtime sends."""

    def call(type_name: str, key: str, method: str, a: tuple[Any, ...], kw: dict[str, Any] | None, chain: tuple[str, ...], hops: int) -> Call:
        return Call(GrainId(type_name, key), method, a, kw, 1.0, chain, hops)

    hops = st.integers(0, 2)
    two_way = st.builds(call, names, names, names, args, kwargs, chains, hops).map(lambda c: ("two-way", REQUEST, c))
    one_way = st.builds(call, names, names, names, args, kwargs, chains, hops).map(lambda c: ("one-way", ONEWAY, c))
    tick = st.builds(call, names, names, st.just(REMINDER_METHOD), names.map(lambda n: (n,)), st.none(), chains, hops)
    item = st.builds(
        call, names, names, st.just(STREAM_METHOD), st.tuples(names, values, st.from_regex(r"[0-9]{1,13}-[0-9]{1,3}", fullmatch=True)),
        st.none(), chains, hops,
    )  # fmt: skip
    observer = st.builds(call, st.just(OBSERVER_TYPE), st.just("client:c1/ab12"), names, args, kwargs, chains, st.integers(0, 1))
    return (
        two_way
        | one_way
        | tick.map(lambda c: ("reminder tick", REQUEST, c))
        | item.map(lambda c: ("stream item", REQUEST, c))
        | observer.map(lambda c: ("observer notification", REQUEST, c))
        | observer.map(lambda c: ("one-way observer notification", ONEWAY, c))
    )


@settings(max_examples=300, deadline=None)
@given(kind=_kinds(), timeout_ms=st.integers(1, 10**7), carrier=trace)
def test_every_kind_of_call_round_trips_through_the_one_header_encoder_and_decoder(
    kind: tuple[str, int, Call], timeout_ms: int, carrier: dict[str, str] | None
) -> None:
    _, frame_kind, call = kind
    grain = call.grain
    header = encode_request(
        frame_kind, grain.type_name, grain.key, call.method, timeout_ms / 1000, call.chain, call.hops, carrier
    )
    body = CODEC.encode(request_body(call.args, call.kwargs))
    wire = unpackb(packb(header))  # as the transport writes and reads it
    got = decode_request(wire, Frame(wire, body.meta, list(body.buffers)), CODEC)
    # A one-way caller does not wait: its frame carries no chain (calling back to it is no cycle).
    chain = () if frame_kind == ONEWAY else call.chain
    assert wire[0] == frame_kind
    assert got == call._replace(timeout_s=got.timeout_s, chain=chain, kwargs=call.kwargs or None)
    assert got.timeout_s is not None
    assert abs(got.timeout_s - timeout_ms / 1000) <= 0.0011  # whole milliseconds on the wire
    assert carrier_from_header(wire) == carrier
