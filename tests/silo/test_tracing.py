"""Tracing: a call's W3C trace context crosses the client and silos, and each call is a span.

The silos here are this process's (the ``cluster`` fixture), their spans and the
client's going to one SDK provider with an in-memory exporter.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from grains import Grain
from grains.ids import GrainId
from silo import errors
from silo.client import ClusterClient
from silo.settings import ClientSettings, TracingSettings
from silo.silo import Silo
from silo.tracing import GRAIN_TYPE, METHOD, OUTCOME, SILO, Tracing, carrier_from_header

REPO = Path(__file__).resolve().parents[2]
GRAINS = ("tests.silo.test_tracing",)


class Front(Grain):
    """Grain A: calls a Back grain, wherever it lives."""

    async def relay(self, key: str, value: int) -> str:
        return await self.get_grain(Back, key).echo(value)

    async def relay_failing(self, key: str) -> str:
        return await self.get_grain(Back, key).fail()


class Back(Grain):
    """Grain B."""

    async def echo(self, value: int) -> str:
        return f"{value}@{self.silo}"

    async def fail(self) -> str:
        raise ValueError("back refuses")


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter: InMemorySpanExporter) -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider)


def traced(silo: Silo, tracing: Tracing) -> Silo:
    # The silo's router sends the context of the span its turn runs in; its dispatcher runs
    # each turn in a SERVER span. (Silo(settings, tracing=...) is to pass it to both.)
    silo.router.tracing = tracing
    silo.dispatcher.tracing = tracing
    return silo


@pytest.fixture
async def two_silos(cluster: Callable[..., Awaitable[list[Silo]]]) -> list[Silo]:
    return await cluster(2, grains=GRAINS)


@pytest.fixture
async def traced_client(redis_url: str, cluster_name: str, tracing: Tracing) -> AsyncIterator[ClusterClient]:
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, tracing=tracing) as c:
        yield c


async def place(silo: Silo, grain: type[Grain], key: str) -> None:
    name = grain.__name__
    assert await silo.router.activate(GrainId(name, key), target=silo.address) == str(silo.address)


def by_kind(spans: tuple[ReadableSpan, ...], kind: SpanKind, type_name: str) -> ReadableSpan:
    (span,) = [s for s in spans if s.kind is kind and s.attributes and s.attributes[GRAIN_TYPE] == type_name]
    return span


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_client_to_grain_to_grain_on_another_silo_is_one_trace_with_parent_links(
    two_silos: list[Silo], tracing: Tracing, traced_client: ClusterClient, exporter: InMemorySpanExporter
) -> None:
    one, two = (traced(s, tracing) for s in two_silos)
    await place(one, Front, "a")
    await place(two, Back, "b")

    assert await traced_client.get_grain(Front, "a").relay("b", 7) == f"7@{two.address}"

    spans = exporter.get_finished_spans()
    client = by_kind(spans, SpanKind.CLIENT, "Front")
    a = by_kind(spans, SpanKind.SERVER, "Front")
    b = by_kind(spans, SpanKind.SERVER, "Back")
    assert len(spans) == 3
    assert {s.context.trace_id for s in spans} == {client.context.trace_id}
    assert client.parent is None
    assert parent_of(a) == client.context.span_id
    assert parent_of(b) == a.context.span_id
    assert a.attributes is not None and b.attributes is not None and client.attributes is not None
    assert (a.attributes[METHOD], a.attributes[SILO], a.attributes[OUTCOME]) == ("relay", str(one.address), "ok")
    assert (b.attributes[METHOD], b.attributes[SILO], b.attributes[OUTCOME]) == ("echo", str(two.address), "ok")
    assert client.attributes[OUTCOME] == "ok" and client.name == "Front/relay"
    assert all(s.status.status_code is StatusCode.UNSET for s in spans)


async def test_a_failing_call_marks_its_span_and_every_caller_s_as_errors(
    two_silos: list[Silo], tracing: Tracing, traced_client: ClusterClient, exporter: InMemorySpanExporter
) -> None:
    one, two = (traced(s, tracing) for s in two_silos)
    await place(one, Front, "a")
    await place(two, Back, "b")

    with pytest.raises(errors.RemoteGrainError, match="back refuses"):
        await traced_client.get_grain(Front, "a").relay_failing("b")

    spans = exporter.get_finished_spans()
    b = by_kind(spans, SpanKind.SERVER, "Back")
    a = by_kind(spans, SpanKind.SERVER, "Front")
    client = by_kind(spans, SpanKind.CLIENT, "Front")
    assert parent_of(b) == a.context.span_id and parent_of(a) == client.context.span_id
    for span in (b, a, client):
        assert span.attributes is not None and span.attributes[OUTCOME] == "error"
        assert span.status.status_code is StatusCode.ERROR
    assert b.attributes is not None and b.attributes["error.type"] == "ValueError"
    assert [e.name for e in b.events] == ["exception"]


async def test_a_call_from_a_grain_to_one_on_its_own_silo_is_a_child_too(
    two_silos: list[Silo], tracing: Tracing, traced_client: ClusterClient, exporter: InMemorySpanExporter
) -> None:
    one, _ = (traced(s, tracing) for s in two_silos)
    await place(one, Front, "a")
    await place(one, Back, "b")

    assert await traced_client.get_grain(Front, "a").relay("b", 1) == f"1@{one.address}"

    spans = exporter.get_finished_spans()
    a = by_kind(spans, SpanKind.SERVER, "Front")
    b = by_kind(spans, SpanKind.SERVER, "Back")
    assert parent_of(b) == a.context.span_id and b.context.trace_id == a.context.trace_id


async def test_a_call_forwarded_by_a_silo_keeps_its_trace(
    two_silos: list[Silo], tracing: Tracing, traced_client: ClusterClient, exporter: InMemorySpanExporter
) -> None:
    one, two = two_silos  # the forwarding silo traces nothing: it only passes the context on
    traced(two, tracing)
    await place(two, Back, "b")
    # The client believes the grain lives on `one`, which forwards the call to its owner.
    traced_client.router._remember(GrainId("Back", "b"), one.address)

    assert await traced_client.get_grain(Back, "b").echo(3) == f"3@{two.address}"

    spans = exporter.get_finished_spans()
    client = by_kind(spans, SpanKind.CLIENT, "Back")
    b = by_kind(spans, SpanKind.SERVER, "Back")
    assert one.dispatcher.statistics().forwarded == 1
    assert parent_of(b) == client.context.span_id


async def test_with_tracing_off_calls_work_and_make_no_span(
    redis_url: str, cluster_name: str, two_silos: list[Silo], exporter: InMemorySpanExporter
) -> None:
    one, two = two_silos
    await place(one, Front, "a")
    await place(two, Back, "b")
    assert one.router.tracing is None and one.dispatcher.tracing is None
    async with await ClusterClient.connect(redis_url, cluster=cluster_name) as client:
        assert await client.get_grain(Front, "a").relay("b", 5) == f"5@{two.address}"
    assert exporter.get_finished_spans() == ()


async def test_a_traced_client_s_calls_work_on_silos_that_trace_nothing(
    two_silos: list[Silo], traced_client: ClusterClient, exporter: InMemorySpanExporter
) -> None:
    one, two = two_silos
    await place(one, Front, "a")
    await place(two, Back, "b")
    assert await traced_client.get_grain(Front, "a").relay("b", 2) == f"2@{two.address}"
    (client,) = exporter.get_finished_spans()
    assert client.kind is SpanKind.CLIENT


@pytest.mark.parametrize(
    ("header", "carrier"),
    [
        ([1, 1, "T", "k", "m", 1000, [], 0], None),
        ([1, 1, "T", "k", "m", 1000, [], 0, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}],
         {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}),
        ([1, 1, "T", "k", "m", 1000, [], 0, "00-1-2-01"], None),
        ([1, 1, "T", "k", "m", 1000, [], 0, {"traceparent": 5}], None),
        ([1, 1, "T", "k", "m", 1000, [], 0, {f"k{i}": "v" for i in range(9)}], None),
    ],
)
def test_trace_context_is_an_optional_ninth_header_item_of_strings(header: list[Any], carrier: Any) -> None:
    assert carrier_from_header(header) == carrier


def test_the_runtime_imports_no_opentelemetry_of_its_own() -> None:
    # redis-py imports parts of OpenTelemetry for its own metrics where they are installed:
    # what counts is what the runtime adds to that.
    code = (
        "import sys, redis, redis.asyncio\n"
        "before = {m for m in sys.modules if m.startswith('opentelemetry')}\n"
        "from silo import ClusterClient, Silo\n"
        "import silo.tracing, silo.messaging.router, silo.messaging.dispatcher\n"
        "print(','.join(m for m in sys.modules if m.startswith('opentelemetry') and m not in before))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"imported eagerly: {proc.stdout.strip()}"


async def test_a_client_whose_settings_enable_tracing_exports_over_otlp_and_closes(
    redis_url: str, cluster_name: str, two_silos: list[Silo]
) -> None:
    settings = ClientSettings(tracing=TracingSettings(enabled=True, otlp_endpoint="localhost:1"))
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=settings) as client:
        assert isinstance(client.tracing, Tracing)
    assert client.closed
