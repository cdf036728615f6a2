"""OpenTelemetry set-up and the messaging spans every bus operation makes.

Tracing is configured from the standard ``OTEL_*`` variables and is off by
default: ``OTEL_TRACES_EXPORTER`` picks ``otlp``, ``console`` or ``none``; when
it is unset, OTLP/HTTP export is on exactly when ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``..._TRACES_ENDPOINT``) is set. Without an exporter no SDK is installed
and spans cost next to nothing, but the W3C ``traceparent``/``tracestate``
headers still pass through, so a trace started elsewhere is never broken by a
process that does not record.

Span names and attributes follow the OpenTelemetry messaging semantic
conventions: ``publish <subject>`` (PRODUCER), ``send <subject>`` (CLIENT, a
request), ``process <subject>`` (CONSUMER), with ``messaging.system = "nats"``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind

_TRACER_NAME = "phalanx"
_setup_lock = threading.Lock()
_configured = False
_provider = None


def setup_tracing(service_name: str, env: Mapping[str, str] | None = None) -> str:
    """Install a tracer provider as the environment asks, once per process.

    Returns:
        The exporter in use: ``"otlp"``, ``"console"`` or ``"none"``.
    """
    global _configured, _provider
    env = os.environ if env is None else env
    with _setup_lock:
        exporter_name = _exporter_name(env)
        if _configured or exporter_name == "none":
            return exporter_name
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", service_name)})
        provider = TracerProvider(resource=resource)
        if exporter_name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _provider = provider
        _configured = True
        return exporter_name


def shutdown_tracing() -> None:
    """Flush and stop the exporter, if one was installed (idempotent)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def _exporter_name(env: Mapping[str, str]) -> str:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return "none"
    chosen = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if chosen:
        return chosen if chosen in ("otlp", "console") else "none"
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return "otlp"
    return "none"


def tracer() -> trace.Tracer:
    # The API's proxy tracer follows a provider installed later, so one is enough.
    return _tracer


_tracer = trace.get_tracer(_TRACER_NAME)


def inject(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """Return ``headers`` with the current trace context added (W3C trace context).

    Returns None when there is nothing to send, so nats-py sends a plain
    message instead of parsing an empty header block on the other side.
    """
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers or None


def traceparent() -> str:
    """The current span's W3C ``traceparent``, or "" when nothing is traced."""
    return (inject() or {}).get("traceparent", "")


def within(parent: str) -> otel_context.Context | None:
    """The context whose spans continue the trace named by ``parent`` (a ``traceparent``);
    None for "" (spans then start from the current context, as without it)."""
    return propagate.extract({"traceparent": parent}) if parent else None


def _attributes(subject: str, operation: str, size: int,
                queue: str | None) -> dict[str, str | int]:
    attrs: dict[str, str | int] = {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.message.body.size": size,
    }
    if queue:
        attrs["messaging.consumer.group.name"] = queue
    return attrs


@contextmanager
def producer_span(subject: str, size: int, *, request: bool = False) -> Iterator[Span]:
    """Span around a publish (``request=False``) or a request/reply (``request=True``)."""
    operation = "send" if request else "publish"
    kind = SpanKind.CLIENT if request else SpanKind.PRODUCER
    with tracer().start_as_current_span(
        f"{operation} {subject}", kind=kind, attributes=_attributes(subject, operation, size, None)
    ) as span:
        yield span


@contextmanager
def consumer_span(subject: str, headers: Mapping[str, str] | None, size: int,
                  queue: str | None = None) -> Iterator[Span]:
    """Span around handling one received message, child of the sender's context."""
    parent = propagate.extract(dict(headers or {}))
    token = otel_context.attach(parent)
    try:
        with tracer().start_as_current_span(
            f"process {subject}", kind=SpanKind.CONSUMER,
            attributes=_attributes(subject, "process", size, queue),
        ) as span:
            yield span
    finally:
        otel_context.detach(token)
