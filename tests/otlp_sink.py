"""A local OTLP/HTTP trace receiver standing in for Jaeger's collector port (4318).

It decodes each export with the OTLP protobuf definitions (``opentelemetry-proto``,
which the exporter itself depends on) and keeps, per ``service.name``, the span
names received, so a test can say which processes exported what.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpSink:
    def __init__(self) -> None:
        self.spans: dict[str, list[str]] = defaultdict(list)
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
                        sink.spans[service].extend(s.name for s in scope.spans)
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

    def __enter__(self) -> OtlpSink:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
