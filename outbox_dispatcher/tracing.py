"""OpenTelemetry producer spans, linked to the trace context a writer stored in the row's headers.

The row's `traceparent`/`tracestate` headers reach Kafka unchanged whether or not tracing is on;
with OUTBOX_TRACING the dispatcher also records one PRODUCER span per record, from send to the
broker's acknowledgement, with a link to the writer's context (the relay is a hop of its own, not
a child of a transaction that committed long ago). OpenTelemetry is an optional extra.
"""

from __future__ import annotations

import asyncio
import atexit
import os
from typing import TYPE_CHECKING, Any

from outbox_dispatcher import __version__, errors
from outbox_dispatcher.models import OutboxRecord

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class Tracer:
    """Spans when enabled; otherwise every call is a no-op costing one attribute check."""

    def __init__(self, enabled: bool) -> None:
        self._tracer: Any = None
        if not enabled:
            return
        try:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            msg = (
                "OUTBOX_TRACING needs OpenTelemetry: install outbox-dispatcher[otel], "
                "or unset OUTBOX_TRACING"
            )
            raise errors.ConfigurationError(msg) from exc
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._tracer = trace.get_tracer("outbox_dispatcher", __version__)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(self, record: OutboxRecord, topic: str) -> Span | None:
        if self._tracer is None:
            return None
        trace = self._trace
        parent = trace.get_current_span(self._propagator.extract(record.headers))
        context = parent.get_span_context()
        links = [trace.Link(context)] if context.is_valid else []
        attributes: dict[str, str | int] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "send",
            "messaging.destination.name": topic,
            "messaging.message.id": str(record.event_id),
            "outbox.row_id": record.id,
        }
        if record.ordering_key is not None:
            attributes["messaging.kafka.message.key"] = record.ordering_key
        span: Span = self._tracer.start_span(
            f"send {topic}", kind=trace.SpanKind.PRODUCER, links=links, attributes=attributes
        )
        return span

    def end_on_ack(self, span: Span | None, future: asyncio.Future[object]) -> None:
        if span is None:
            return
        status = self._trace.Status

        def done(f: asyncio.Future[object]) -> None:
            if f.cancelled():
                span.set_status(status(self._trace.StatusCode.ERROR, "not acknowledged"))
            elif (exc := f.exception()) is not None:
                span.record_exception(exc)
                span.set_status(status(self._trace.StatusCode.ERROR, type(exc).__name__))
            span.end()

        future.add_done_callback(done)

    def fail(self, span: Span | None, problem: BaseException) -> None:
        if span is not None:
            span.record_exception(problem)
            span.set_status(
                self._trace.Status(self._trace.StatusCode.ERROR, type(problem).__name__)
            )
            span.end()


def configure_sdk() -> None:
    """For the CLI: a TracerProvider exporting as the standard OTEL_* variables say, unless the
    process already has one (e.g. under opentelemetry-instrument)."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": "outbox-dispatcher"}))
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp")
    exporter: SpanExporter | None = None
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError as exc:
            msg = "OTLP export needs outbox-dispatcher[otel]; or set OTEL_TRACES_EXPORTER=console"
            raise errors.ConfigurationError(msg) from exc
        exporter = OTLPSpanExporter()
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # flush the last spans
