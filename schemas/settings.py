"""The environment variables that configure phalanx's own processes: the bus client, the
config file, the state and data dirs, the metrics endpoint and each service's
``PHALANX_<SERVICE>_<FIELD>`` overrides.

Every variable phalanx reads is named in ``schemas/`` alone: here, and the rank's
contract with its agent in :mod:`phalanx.schemas.environment`
(``tests/unit/schemas/test_environment_names.py`` fails on a ``PHALANX_`` literal
anywhere else). A service's override is its scope called with the field's name
(``AGENT("stop_is_restart")`` is ``PHALANX_AGENT_STOP_IS_RESTART``), so a config field
needs no constant of its own; ``AGENT.prefix`` is what they all start with.
"""

from __future__ import annotations

import dataclasses

#: What every variable phalanx reads starts with.
PREFIX = "PHALANX_"

# The bus client's (phalanx.bus.config.BusConfig): every process that connects reads
# them, a rank too.
NATS_URL = "PHALANX_NATS_URL"
NATS_USER = "PHALANX_NATS_USER"
NATS_PASSWORD = "PHALANX_NATS_PASSWORD"
NATS_TOKEN = "PHALANX_NATS_TOKEN"
NATS_NKEY = "PHALANX_NATS_NKEY"
NATS_CREDS = "PHALANX_NATS_CREDS"
NATS_CA = "PHALANX_NATS_CA"
NATS_CERT = "PHALANX_NATS_CERT"
NATS_KEY = "PHALANX_NATS_KEY"
NATS_CONNECT_TIMEOUT_S = "PHALANX_NATS_CONNECT_TIMEOUT_S"
NATS_INBOX_PREFIX = "PHALANX_NATS_INBOX_PREFIX"
NATS_REPLICAS = "PHALANX_NATS_REPLICAS"

#: The TOML config file (``[bus]``, ``[admission]`` …) a process reads.
CONFIG = "PHALANX_CONFIG"
#: The state dir (default ``$XDG_STATE_HOME/phalanx``).
STATE_DIR = "PHALANX_STATE_DIR"
#: The data dir (default: the state dir).
DATA_DIR = "PHALANX_DATA_DIR"

#: The port a process serves ``/metrics`` on (:mod:`phalanx.services.metrics`).
METRICS_PORT = "PHALANX_METRICS_PORT"
#: The address it binds that port on.
METRICS_ADDR = "PHALANX_METRICS_ADDR"
#: An inherited listening socket to serve ``/metrics`` on instead.
METRICS_FD = "PHALANX_METRICS_FD"


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The ``PHALANX_<SCOPE>_<FIELD>`` variables that set one service's settings."""

    scope: str

    @property
    def prefix(self) -> str:
        """What all of them start with: ``PHALANX_<SCOPE>_``."""
        return f"{PREFIX}{self.scope.upper()}_"

    def __call__(self, field: str) -> str:
        """The variable of the setting ``field`` (a config field's name)."""
        return self.prefix + field.upper()


#: The node agent's config (``AgentConfig``); a rank never inherits them.
AGENT = Overrides("agent")
#: Admission's timings (``AdmissionConfig``).
ADMISSION = Overrides("admission")
#: The auth callout's config (``CalloutConfig``).
CALLOUT = Overrides("callout")
#: Health's policy (``HealthPolicy``) and its lease.
HEALTH = Overrides("health")
#: Elasticity's timings and its lease.
ELASTICITY = Overrides("elasticity")
#: The checkpoint service's lease.
CHECKPOINT = Overrides("checkpoint")
