"""The bus layer: NATS connection, typed publish/request/subscribe, KV, telemetry.

Imports only :mod:`phalanx.schemas` of phalanx, so the rank runtime and the
services share it. Import its modules (:mod:`.client`, :mod:`.kv`, :mod:`.stream` …):
the package itself loads nothing but :mod:`.transport`, whose hook keeps nats-py's
websocket transport from importing aiohttp (the services' and the runtime's packages
import this one first for it), so importing it stays cheap.
"""

from phalanx.bus.transport import tcp_only

tcp_only()
