"""The admission service's configuration: its policy and its timings.

Read from the ``[admission]`` table of the TOML config file (``--config`` or
``PHALANX_CONFIG``); policy keys are described in :mod:`.policy`, the rest
here. ``PHALANX_ADMISSION_<FIELD>`` overrides a timing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.schemas import settings
from phalanx.schemas.errors import ConfigError
from phalanx.schemas.registry import DEFAULT_LOST_AFTER_S
from phalanx.services.admission.policy import AdmissionPolicy

_TIMINGS = ("lease_s", "tick_s", "lost_after_s", "forward_timeout_s")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    policy: AdmissionPolicy = dataclasses.field(default_factory=AdmissionPolicy)
    """Priority classes, team quotas and reservations."""
    lease_s: float = 3.0
    """Leader lease; a dead leader is replaced within about 1.3 x this."""
    tick_s: float = 0.25
    """How often timeouts and node liveness are checked."""
    lost_after_s: float = DEFAULT_LOST_AFTER_S
    """A node whose heartbeat is older than this offers no capacity."""
    forward_timeout_s: float = 5.0
    """How long an instance waits for the leader to answer a forwarded request."""

    def __post_init__(self) -> None:
        for name in _TIMINGS:
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"admission.{name} must be a positive number, got {value}")

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None,
             env: Mapping[str, str] | None = None) -> AdmissionConfig:
        """From the ``[admission]`` table of ``path`` (or ``PHALANX_CONFIG``) and the env.

        Raises:
            ConfigError: unreadable file or a bad value, named.
        """
        env = os.environ if env is None else env
        table: dict[str, Any] = {}
        path = path or env.get(settings.CONFIG)
        if path:
            try:
                table = dict(tomllib.loads(Path(path).read_text()).get("admission", {}))
            except OSError as exc:
                raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        timings: dict[str, float] = {}
        for name in _TIMINGS:
            raw = env.get(settings.ADMISSION(name), table.pop(name, None))
            if raw is not None:
                try:
                    timings[name] = float(raw)
                except (TypeError, ValueError):
                    raise ConfigError(f"admission.{name} must be a number, got {raw!r}") from None
        return cls(policy=AdmissionPolicy.from_mapping(table), **timings)
