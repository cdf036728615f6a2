"""The bus layer: NATS connection, typed publish/request/subscribe, KV, telemetry.

Imports only :mod:`phalanx.schemas` of phalanx, so the rank runtime and the
services share it. Importing the package loads nothing but :mod:`.transport`, whose
hook keeps nats-py's websocket transport from importing aiohttp (the services' and
the runtime's packages import this one first for it); the names below load on first
use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from phalanx.bus.transport import tcp_only

tcp_only()

_EXPORTS = {
    "Bus": "client", "Counters": "client", "Delivery": "client", "BusConfig": "config",
    "BusUnavailable": "errors", "Conflict": "errors", "NoResponders": "errors",
    "RemoteError": "errors", "RequestTimeout": "errors", "Entry": "kv", "TypedKV": "kv",
}

__all__ = ["Bus", "BusConfig", "BusUnavailable", "Conflict", "Counters", "Delivery", "Entry",
           "NoResponders", "RemoteError", "RequestTimeout", "TypedKV"]

if TYPE_CHECKING:
    from phalanx.bus.client import Bus, Counters, Delivery
    from phalanx.bus.config import BusConfig
    from phalanx.bus.errors import (
        BusUnavailable,
        Conflict,
        NoResponders,
        RemoteError,
        RequestTimeout,
    )
    from phalanx.bus.kv import Entry, TypedKV


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
