"""How to reach the NATS server: URLs, credentials and TLS.

Values come, highest precedence first, from explicit arguments, ``PHALANX_NATS_*``
environment variables, the ``[bus]`` table of a TOML config file
(``PHALANX_CONFIG`` or an explicit path), and the defaults here. The config is
validated when built: a named credentials file that does not exist, a user
without a password or a certificate without its key is refused at once with
the field named, not at the first reconnect.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.schemas import settings
from phalanx.schemas.errors import ConfigError

DEFAULT_URL = "nats://127.0.0.1:4222"
_SUBJECT_PREFIX = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")

# field name -> environment variable
_ENV = {
    "servers": settings.NATS_URL,
    "user": settings.NATS_USER,
    "password": settings.NATS_PASSWORD,
    "token": settings.NATS_TOKEN,
    "nkey_seed_file": settings.NATS_NKEY,
    "creds_file": settings.NATS_CREDS,
    "tls_ca_file": settings.NATS_CA,
    "tls_cert_file": settings.NATS_CERT,
    "tls_key_file": settings.NATS_KEY,
    "connect_timeout_s": settings.NATS_CONNECT_TIMEOUT_S,
    "inbox_prefix": settings.NATS_INBOX_PREFIX,
    "jetstream_replicas": settings.NATS_REPLICAS,
}
#: Most replicas JetStream keeps of a stream.
MAX_REPLICAS = 5
#: The variables that say who a process is on the bus (not where the bus is).
CREDENTIAL_VARS = frozenset(_ENV[f] for f in (
    "user", "password", "token", "nkey_seed_file", "creds_file", "tls_cert_file",
    "tls_key_file", "inbox_prefix"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BusConfig:
    servers: tuple[str, ...] = (DEFAULT_URL,)
    """NATS URLs (``nats://``, ``tls://``); the env variable takes a comma-separated list."""
    user: str | None = None
    """User name for user/password authentication (needs ``password``)."""
    password: str | None = None
    """Password for ``user``."""
    token: str | None = None
    """Authentication token."""
    nkey_seed_file: str | None = None
    """Path of an nkey seed file."""
    creds_file: str | None = None
    """Path of a decentralised-auth ``.creds`` file (JWT + nkey seed)."""
    tls_ca_file: str | None = None
    """CA bundle to verify the server; setting it turns TLS on."""
    tls_cert_file: str | None = None
    """Client certificate for mutual TLS (needs ``tls_key_file``)."""
    tls_key_file: str | None = None
    """Private key of ``tls_cert_file``."""
    connect_timeout_s: float = 5.0
    """How long the first connection may take before :class:`BusUnavailable` is raised."""
    reconnect_wait_s: float = 0.25
    """Pause between reconnect attempts after a connection was lost (reconnects never stop)."""
    inbox_prefix: str = "_INBOX"
    """Prefix of this connection's reply subjects. On a bus with permissions each identity
    may subscribe only under its own (``_INBOX.<identity>``), so none reads another's."""
    jetstream_replicas: int = 1
    """How many servers keep each KV bucket and stream phalanx *creates* (1 to 5): 3 on a
    3-server NATS cluster survives the loss of any one. Existing ones keep theirs."""

    def __post_init__(self) -> None:
        if not isinstance(self.servers, tuple) or not all(isinstance(s, str) for s in self.servers):
            raise ConfigError(f"bus.servers must be a list of URL strings, got {self.servers!r}")
        for name in ("user", "password", "token", "nkey_seed_file", "creds_file", "tls_ca_file",
                     "tls_cert_file", "tls_key_file", "inbox_prefix"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"bus.{name} must be a string, got {type(value).__name__}")
        if not self.servers or any(not s.strip() for s in self.servers):
            raise ConfigError("bus.servers: at least one non-empty NATS URL is required")
        websockets = [s for s in self.servers if s.startswith(("ws://", "wss://"))]
        if websockets:
            raise ConfigError(f"bus.servers: {websockets[0]!r}: phalanx connects over nats:// "
                              "or tls:// only (a NATS server's client port, not its websocket "
                              "port)")
        if (self.user is None) != (self.password is None):
            raise ConfigError("bus.user and bus.password must be given together")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("bus.tls_cert_file and bus.tls_key_file must be given together")
        for name in ("nkey_seed_file", "creds_file", "tls_ca_file", "tls_cert_file",
                     "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"bus.{name}: no such file {path!r}")
        if not _SUBJECT_PREFIX.fullmatch(self.inbox_prefix):
            raise ConfigError(f"bus.inbox_prefix must be dot-separated tokens of letters, "
                              f"digits, '-' and '_', got {self.inbox_prefix!r}")
        replicas = self.jetstream_replicas
        if (not isinstance(replicas, int) or isinstance(replicas, bool)
                or not 1 <= replicas <= MAX_REPLICAS):
            raise ConfigError(f"bus.jetstream_replicas must be an integer from 1 to "
                              f"{MAX_REPLICAS}, got {self.jetstream_replicas!r}")
        if not math.isfinite(self.connect_timeout_s) or self.connect_timeout_s <= 0:
            raise ConfigError(f"bus.connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if not math.isfinite(self.reconnect_wait_s) or self.reconnect_wait_s < 0:
            raise ConfigError(f"bus.reconnect_wait_s must be >= 0, got {self.reconnect_wait_s}")

    @property
    def uses_tls(self) -> bool:
        return self.tls_ca_file is not None or any(s.startswith("tls://") for s in self.servers)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None,
             env: Mapping[str, str] | None = None, **overrides: Any) -> BusConfig:
        """Build a config from file, environment and ``overrides`` (``None`` values ignored).

        Raises:
            ConfigError: the file is unreadable or a value is invalid.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        path = path or env.get(settings.CONFIG)
        if path:
            values.update(_read_file(Path(path)))
        for field, var in _ENV.items():
            if env.get(var):
                values[field] = env[var]
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown bus option(s) {unknown}; known: {sorted(known)}")
        servers = values.get("servers")
        if isinstance(servers, str):
            values["servers"] = tuple(s.strip() for s in servers.split(","))
        elif isinstance(servers, list | tuple):
            values["servers"] = tuple(servers)
        for name in ("connect_timeout_s", "reconnect_wait_s"):
            if name in values:
                try:
                    values[name] = float(values[name])
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"bus.{name} must be a number, got {values[name]!r}") from None
        if isinstance(values.get("jetstream_replicas"), str):  # from the environment
            try:
                values["jetstream_replicas"] = int(values["jetstream_replicas"])
            except ValueError:
                raise ConfigError(f"bus.jetstream_replicas must be an integer, got "
                                  f"{values['jetstream_replicas']!r}") from None
        return cls(**values)


def with_identity(env: Mapping[str, str], identity: Mapping[str, str]) -> dict[str, str]:
    """The environment for a child process that must connect as ``identity`` (its
    ``PHALANX_NATS_*`` credential variables): every credential variable of ``env`` is
    dropped first, so the child can never connect as its parent."""
    return {**{k: v for k, v in env.items() if k not in CREDENTIAL_VARS}, **identity}


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    bus = data.get("bus", {})
    if not isinstance(bus, dict):
        raise ConfigError(f"config file {path}: [bus] must be a table")
    return bus
