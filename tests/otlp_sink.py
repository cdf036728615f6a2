"""A local OTLP/HTTP trace receiver standing in for Jaeger's collector port (4318).

It decodes each export with the OTLP protobuf definitions (``opentelemetry-proto``,
which the exporter itself depends on) and keeps, per ``service.name``, the span
names received, so a test can say which processes exported what, and every span
whole (:class:`SpanRecord`: ids, parent, attributes), so a test can follow a trace
from parent to child as Jaeger would draw it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclasses.dataclass(frozen=True)
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    attributes: dict[str, Any]


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class OtlpSink:
    def __init__(self) -> None:
        self.spans: dict[str, list[str]] = defaultdict(list)
        self.records: list[SpanRecord] = []
        self._lock = threading.Condition()
        self.bad_requests: list[str] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    sink.bad_requests.append(f"POST {self.path}")
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    service = next((a.value.string_value for a in
                                    resource_spans.resource.attributes
                                    if a.key == "service.name"), "?")
                    for scope in resource_spans.scope_spans:
                        with sink._lock:
                            sink.spans[service].extend(s.name for s in scope.spans)
                            sink.records.extend(SpanRecord(
                                service, s.name, s.trace_id.hex(), s.span_id.hex(),
                                s.parent_span_id.hex(),
                                {a.key: _value(a.value) for a in s.attributes})
                                for s in scope.spans)
                            sink._lock.notify_all()
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def received(self) -> list[SpanRecord]:
        """Every span received so far."""
        with self._lock:
            return list(self.records)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Return once ``predicate()`` holds, checked at every export received.

        Raises:
            TimeoutError: it did not hold within ``timeout_s``.
        """
        with self._lock:
            if not self._lock.wait_for(predicate, timeout_s):
                raise TimeoutError(f"no export made it true within {timeout_s:g} s")

    def __enter__(self) -> OtlpSink:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
