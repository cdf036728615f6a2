"""The auth callout's configuration: its keys, how long an admitted connection lives, and
how its revoker closes an ended job's.

Every field comes from ``PHALANX_CALLOUT_<FIELD>`` (or the constructor). The two key
files are items of the Secret ``phalanx-identities`` that ``phalanx auth kubernetes``
writes, mounted into the callout's pods alone (the token key into the agents' too).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from phalanx.schemas import settings
from phalanx.schemas.errors import ConfigError
from phalanx.services.auth.callout import GLOBAL_ACCOUNT


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalloutConfig:
    issuer_seed_file: str
    """The seed of the callout's account key (``callout-issuer.nk``): it signs every
    response and user JWT; the server's config names its public key as the issuer."""
    token_key_file: str
    """The cluster's rank token key (``rank-token.key``, hex): the agents mint rank
    tokens with it, the callout verifies them (:mod:`~phalanx.services.auth.rank_token`)."""
    connection_ttl_s: float | None = None
    """The longest an admitted rank connection lives before the server closes it. None
    (the default): until its token expires. nats-py, the ranks' client, does not
    reconnect after the server closes a connection at its expiry, so a cap shorter than a
    job cuts its ranks off the bus: set it only for clients that reconnect (docs/security.md)."""
    system_seed_file: str | None = None
    """The seed of a user of the servers' system account (``system.nk``): with it the
    callout also revokes, closing every open connection of a job that ended
    (:mod:`~phalanx.services.callout.revoker`). None: an ended job's open connections
    last until their tokens expire."""
    revoke_interval_s: float = 10.0
    """How often the revoker looks over every server's rank connections, besides
    looking at once when a job's record says it ended: the bound on how long an ended
    job's connection stays open (docs/security.md)."""
    account: str = GLOBAL_ACCOUNT
    """The account admitted connections land in: the server config's (``$G`` where it
    defines no accounts, as the chart's values do not)."""

    def __post_init__(self) -> None:
        for name in ("issuer_seed_file", "token_key_file"):
            if not getattr(self, name):
                raise ConfigError(f"callout.{name} is required ({settings.CALLOUT(name)})")
        if self.connection_ttl_s is not None and (not math.isfinite(self.connection_ttl_s)
                                                  or self.connection_ttl_s < 1):
            raise ConfigError(f"callout.connection_ttl_s must be at least 1 s, "
                              f"got {self.connection_ttl_s}")
        if not (math.isfinite(self.revoke_interval_s) and self.revoke_interval_s >= 1):
            raise ConfigError(f"callout.revoke_interval_s must be at least 1 s, "
                              f"got {self.revoke_interval_s}")
        if not self.account:
            raise ConfigError("callout.account must name an account")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> CalloutConfig:
        """Fields from ``PHALANX_CALLOUT_<FIELD>``, then ``overrides`` (None ignored).

        Raises:
            ConfigError: a field missing or bad, named.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(settings.CALLOUT(field.name))
            if raw:
                values[field.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name in ("connection_ttl_s", "revoke_interval_s"):
            if name in values:
                try:
                    values[name] = float(values[name])
                except (TypeError, ValueError):
                    raise ConfigError(f"callout.{name} must be a number, got "
                                      f"{values[name]!r}") from None
        for name in ("issuer_seed_file", "token_key_file"):
            values.setdefault(name, "")
        return cls(**values)
