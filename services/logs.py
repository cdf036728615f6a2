"""Structured logs: one JSON object per line on stderr.

Each line has ``ts`` (UNIX seconds), ``level``, ``logger``, ``msg``, the
``service`` and its ``instance``, the trace id when a span is active, any
``extra={...}`` fields, and ``exc`` for exceptions, so logs can be joined
with traces and grepped by field.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from opentelemetry import trace

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, instance: str) -> None:
        super().__init__()
        self.service = service
        self.instance = instance

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "service": self.service,
            "instance": self.instance,
        }
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            line["trace_id"] = f"{span_context.trace_id:032x}"
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(service: str, instance: str, level: str = "INFO") -> None:
    """Send every ``phalanx`` log line to stderr as JSON (replaces earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service, instance))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
