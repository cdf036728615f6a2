"""OpenTelemetry set-up and the messaging spans every bus operation makes.

Tracing is configured from the standard ``OTEL_*`` variables and is off by
default: ``OTEL_TRACES_EXPORTER`` picks ``otlp``, ``console`` or ``none``; when
it is unset, OTLP/HTTP export is on exactly when ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``..._TRACES_ENDPOINT``) is set. Without an exporter no SDK is installed
and spans cost next to nothing, but the W3C ``traceparent``/``tracestate``
headers still pass through, so a trace started elsewhere is never broken by a
process that does not record.

Bus operations only continue traces, they never start one (parent-based): a
publish or request makes a span only while a span is active, and a delivery is
handled in a span only when it carries a ``traceparent`` (and outside any trace
when it does not). So periodic traffic — heartbeats, progress reports, anything a
process sends on its own — records nothing, while everything a traced decision
sends, and everything done on receipt of it, joins that decision's trace. Traces
start only at the spans the services open on purpose: a rank's exit, a fault
found by a timeout, a job's submission.

Span names and attributes follow the OpenTelemetry messaging semantic
conventions, ``<operation> <destination template>``: ``publish
phalanx.node.{node}.heartbeat`` (PRODUCER), ``send phalanx.agent.{node}.status``
(CLIENT, a request), ``process phalanx.job.{job}.fault`` (CONSUMER), with
``messaging.system = "nats"``. The subject itself, ids and all, is the attribute
``messaging.destination.name``; names stay few, whatever the number of nodes and
jobs (:func:`destination_template`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from phalanx.schemas import subjects

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


def destination_template(subject: str) -> str:
    """``subject`` with the ids in it named by what they are: ``phalanx.node.{node}.heartbeat``
    for ``phalanx.node.n7.heartbeat``, ``phalanx.health.rank.{job}.{rank}`` for a rank's
    progress subject; a subject without ids is its own template."""
    found = subjects.owner(subject)
    if found is None:
        return subject
    parts = subject.split(".")
    if parts[0] != subjects.PREFIX:  # a KV record: $KV.<bucket>.<key>
        return subjects.kv_subject(parts[1], f"{{{found[0]}}}")
    if parts[1] == "health":  # phalanx.health.rank.<job>.<rank>
        return ".".join((*parts[:3], "{job}", "{rank}"))
    return ".".join((*parts[:2], f"{{{found[0]}}}", *parts[3:]))


def _attributes(subject: str, template: str, operation: str, size: int,
                queue: str | None) -> dict[str, str | int]:
    attrs: dict[str, str | int] = {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.destination.template": template,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.message.body.size": size,
    }
    if queue:
        attrs["messaging.consumer.group.name"] = queue
    return attrs


def _messaging_span(operation: str, kind: SpanKind, subject: str, size: int,
                    queue: str | None) -> AbstractContextManager[Span]:
    template = destination_template(subject)
    return tracer().start_as_current_span(
        f"{operation} {template}", kind=kind,
        attributes=_attributes(subject, template, operation, size, queue))


def _in_trace(context: otel_context.Context | None = None) -> bool:
    return trace.get_current_span(context).get_span_context().is_valid


@contextmanager
def producer_span(subject: str, size: int, *, request: bool = False) -> Iterator[Span]:
    """Span around a publish (``request=False``) or a request/reply (``request=True``),
    in the active trace; outside any trace, no span (a non-recording one is yielded)."""
    if not _in_trace():
        yield INVALID_SPAN
        return
    operation = "send" if request else "publish"
    kind = SpanKind.CLIENT if request else SpanKind.PRODUCER
    with _messaging_span(operation, kind, subject, size, None) as span:
        yield span


@contextmanager
def consumer_span(subject: str, headers: Mapping[str, str] | None, size: int,
                  queue: str | None = None) -> Iterator[Span]:
    """Span around handling one received message, child of the sender's context.

    Only the message's own trace context counts: one without any is handled outside
    every trace (no span; a non-recording one is yielded), whatever the receiving
    task's context held, so a delivery never joins an unrelated trace.
    """
    parent = propagate.extract(dict(headers or {}), context=otel_context.Context())
    token = otel_context.attach(parent)
    try:
        if not _in_trace(parent):
            yield INVALID_SPAN
            return
        with _messaging_span("process", SpanKind.CONSUMER, subject, size, queue) as span:
            yield span
    finally:
        otel_context.detach(token)
