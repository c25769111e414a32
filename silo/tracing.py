"""Tracing: W3C trace context on grain calls, and an OpenTelemetry span per call.

A traced call carries its trace context in the REQUEST header, as the map a
W3C propagator writes (``{"traceparent": "00-<trace id>-<span id>-<flags>"}``,
plus ``tracestate`` when there is one): header item 8 (the ninth, after ``hops``). The
item is optional both ways: a peer that sends none is served as before, and
a peer that predates it reads only the first eight items.

Who makes which span:

* a client with tracing makes a CLIENT span per call (a child of whatever
  span is current in the caller) and sends its context;
* the silo that runs the call makes a SERVER span around the turn (grain
  type, key, method, silo, outcome), a child of the context that came in, and
  makes it current for the turn, so a call the grain makes from it sends that
  span's context: client → A → B is one trace, B a child of A's span;
* a silo that only forwards a call passes the context on unchanged.

Off is the default and costs one ``is None`` test per call on the router and
the dispatcher (``benchmarks calls`` prints the figure): nothing here imports
OpenTelemetry until a :class:`Tracing` is built, so the runtime loads without
it (``pip install redgrain[otel]`` brings the SDK and the OTLP exporter).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from grains import request_context
from silo import errors

if TYPE_CHECKING:
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.trace import Span, TracerProvider

    from grains.call import Call
    from grains.ids import GrainId
    from silo.settings import TracingSettings

T = TypeVar("T")

Carrier = dict[str, str]
"""Trace context as a W3C propagator writes it: ``traceparent`` and, optionally, ``tracestate``."""

_MAX_CARRIER = 8
"""Entries a received carrier may hold (traceparent, tracestate, baggage): more is not trace context."""

# Span attribute names (with OpenTelemetry's ``rpc.system``; the span's name is ``Type/method``).
GRAIN_TYPE = "redgrain.grain.type"
GRAIN_KEY = "redgrain.grain.key"
METHOD = "redgrain.method"
SILO = "redgrain.silo"
OUTCOME = "redgrain.outcome"
"""``ok``, ``error`` (the method or the runtime raised) or ``cancelled`` (the caller gave up)."""


CONTEXT_KEY = "redgrain-context"
"""The carrier entry that holds the caller's request context (grains/request_context.py) as JSON:
the call's context map carries both, and passes forwarding silos unchanged."""


def call_carrier(tracing: Tracing | None) -> Carrier | None:
    """What a call made now carries: the current span's trace context (tracing on) and the
    task's request context entries; None when there is neither (one context-variable read)."""
    entries = request_context.outgoing()
    carrier = None if tracing is None else tracing.current_carrier()
    if entries is None:
        return carrier
    return {**carrier, CONTEXT_KEY: entries} if carrier else {CONTEXT_KEY: entries}


def context_entries(carrier: Carrier | None) -> Mapping[str, request_context.Value] | None:
    """The request context a call carried (None: none); CodecError when a peer sent one no
    caller may set (the call is refused, as one with a bad argument is)."""
    text = None if carrier is None else carrier.get(CONTEXT_KEY)
    if text is None:
        return None
    try:
        return request_context.incoming(text)
    except ValueError as exc:
        raise errors.CodecError(f"the call's request context: {exc}") from None


def carrier_from_header(header: list[Any]) -> Carrier | None:
    """The trace context of a REQUEST header, or None (none sent, or not a map of strings)."""
    if len(header) <= 8:
        return None
    raw = header[8]
    if type(raw) is not dict or not raw or len(raw) > _MAX_CARRIER:
        return None
    # An invalid context starts a new trace (W3C): drop it rather than fail the call.
    if not all(type(k) is str and type(v) is str for k, v in raw.items()):
        return None
    return raw


class Tracing:
    """Spans for grain calls from one OpenTelemetry ``TracerProvider``.

    :param provider: where spans go; None takes OpenTelemetry's global provider
        (what ``opentelemetry-instrument`` or the application configured).
    :param propagator: how context is written into and read from headers;
        None takes OpenTelemetry's global one (W3C trace context and baggage
        unless ``OTEL_PROPAGATORS`` says otherwise).

    One instance may serve several silos and clients in a process: the silo a
    span ran on is an attribute of the span, not of this object.
    """

    def __init__(
        self,
        provider: TracerProvider | None = None,
        *,
        propagator: TextMapPropagator | None = None,
    ) -> None:
        try:
            from opentelemetry import context, propagate, trace
        except ImportError as exc:
            raise errors.ConfigError("tracing needs OpenTelemetry: pip install 'redgrain[otel]'") from exc

        self._trace = trace
        self._context = context
        self._tracer = (provider or trace.get_tracer_provider()).get_tracer("redgrain")
        self._propagator = propagator or propagate.get_global_textmap()
        self._server = trace.SpanKind.SERVER
        self._client = trace.SpanKind.CLIENT
        self._error = trace.StatusCode.ERROR
        self._owned: Any = None
        """The provider this object built (``otlp``), flushed and shut down by :meth:`shutdown`."""

    @classmethod
    def from_settings(cls, settings: TracingSettings) -> Tracing | None:
        """What the ``tracing`` section asks for: None when off, else spans over OTLP."""
        if not settings.enabled:
            return None
        return cls.otlp(settings.otlp_endpoint, service_name=settings.service_name)

    @classmethod
    def otlp(cls, endpoint: str | None = None, *, service_name: str = "redgrain") -> Tracing:
        """Spans exported over OTLP/gRPC in batches (``redgrain[otel]``); endpoint None: the OTEL_* defaults."""
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider as SdkProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = SdkProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        tracing = cls(provider)
        tracing._owned = provider
        return tracing

    def shutdown(self) -> None:
        """Export what is batched and stop, if this object built its provider (a given one is its owner's)."""
        if self._owned is not None:
            self._owned.shutdown()
            self._owned = None

    # --- the caller's side ---------------------------------------------------
    def current_carrier(self) -> Carrier | None:
        """The current span's context as a header item; None outside any span."""
        carrier: Carrier = {}
        self._propagator.inject(carrier)
        return carrier or None

    def caller(self, inner: Any) -> TracedCaller:
        """Wrap a router (a ``Caller``) so that every call is a CLIENT span."""
        return TracedCaller(inner, self)

    async def client_call(self, call: Call, send: Callable[[Call], Awaitable[T]]) -> T:
        grain = call.grain
        span = self._tracer.start_span(
            f"{grain.type_name}/{call.method}",
            kind=self._client,
            attributes=self._attributes(grain, call.method),
        )
        # Current for the send: the router writes this span's context into the header.
        token = self._context.attach(self._trace.set_span_in_context(span))
        try:
            result = await send(call)
        except BaseException as exc:
            self._failed(span, exc)
            raise
        else:
            span.set_attribute(OUTCOME, "ok")
            return result
        finally:
            self._context.detach(token)
            span.end()

    # --- the serving side ----------------------------------------------------
    def server_turn(
        self,
        silo: str,
        grain: GrainId,
        method: str,
        carrier: Carrier | None,
        run: Callable[[], Awaitable[T]],
    ) -> Callable[[], Coroutine[Any, Any, T]]:
        """What the turn runs instead of ``run``: the SERVER span around it, current meanwhile."""

        async def turn() -> T:
            from opentelemetry.context import Context

            # Never the ambient context: an activation's mailbox task may have been created
            # inside another traced turn, and would make every later call its child.
            parent = self._propagator.extract(carrier or {}, context=Context())
            attributes = self._attributes(grain, method)
            attributes[SILO] = silo
            span = self._tracer.start_span(
                f"{grain.type_name}/{method}", context=parent, kind=self._server, attributes=attributes
            )
            token = self._context.attach(self._trace.set_span_in_context(span, parent))
            try:
                result = await run()
            except BaseException as exc:
                self._failed(span, exc)
                raise
            else:
                span.set_attribute(OUTCOME, "ok")
                return result
            finally:
                self._context.detach(token)
                span.end()

        return turn

    # --- both ------------------------------------------------------------------
    @staticmethod
    def _attributes(grain: GrainId, method: str) -> dict[str, Any]:
        # The SDK validates every attribute value of every span (a large part of a span's cost):
        # no duplicates under OpenTelemetry's rpc.service / rpc.method, the span's name says both.
        return {
            "rpc.system": "redgrain",
            GRAIN_TYPE: grain.type_name,
            GRAIN_KEY: grain.key,
            METHOD: method,
        }

    def _failed(self, span: Span, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            span.set_attribute(OUTCOME, "cancelled")
            return
        span.set_attribute(OUTCOME, "error")
        span.set_attribute("error.type", type(exc).__qualname__)
        span.record_exception(exc)
        span.set_status(self._error, f"{type(exc).__name__}: {exc}")


class TracedCaller:
    """A ``Caller`` whose every call is a CLIENT span around the wrapped caller's."""

    __slots__ = ("_inner", "_tracing")

    def __init__(self, inner: Any, tracing: Tracing) -> None:
        self._inner = inner
        self._tracing = tracing

    def invoke(self, call: Call, one_way: bool = False, stream: Any = None) -> Coroutine[Any, Any, Any]:
        if one_way:
            return self._tracing.client_call(call, lambda c: self._inner.invoke(c, True))
        if stream is not None:  # the span covers the opening: the call until its first item
            return self._tracing.client_call(call, lambda c: self._inner.invoke(c, False, stream))
        return self._tracing.client_call(call, self._inner.invoke)
