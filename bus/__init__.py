"""The bus layer: NATS connection, typed publish/request/subscribe, KV, telemetry.

Imports only :mod:`phalanx.schemas` of phalanx, so the rank runtime and the
services share it.
"""

from phalanx.bus.client import Bus, Counters, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import BusUnavailable, Conflict, NoResponders, RemoteError, RequestTimeout
from phalanx.bus.kv import Entry, TypedKV

__all__ = [
    "Bus",
    "BusConfig",
    "BusUnavailable",
    "Conflict",
    "Counters",
    "Delivery",
    "Entry",
    "NoResponders",
    "RemoteError",
    "RequestTimeout",
    "TypedKV",
]
