"""The auth callout's settings: both keys required, a sane connection cap when one is set."""

from __future__ import annotations

import pytest

from phalanx.schemas.errors import ConfigError
from phalanx.services.callout.config import CalloutConfig

KEYS = {"PHALANX_CALLOUT_ISSUER_SEED_FILE": "/id/callout-issuer.nk",
        "PHALANX_CALLOUT_TOKEN_KEY_FILE": "/id/rank-token.key"}


def test_the_keys_come_from_the_environment_and_the_cap_is_off_by_default() -> None:
    config = CalloutConfig.from_env(KEYS)
    assert (config.issuer_seed_file, config.token_key_file) == ("/id/callout-issuer.nk",
                                                                "/id/rank-token.key")
    assert config.connection_ttl_s is None and config.account == "$G"
    capped = CalloutConfig.from_env({**KEYS, "PHALANX_CALLOUT_CONNECTION_TTL_S": "600"})
    assert capped.connection_ttl_s == 600.0
    assert (config.system_seed_file, config.revoke_interval_s) == (None, 10.0)
    revoking = CalloutConfig.from_env({**KEYS, "PHALANX_CALLOUT_SYSTEM_SEED_FILE": "/id/sys.nk",
                                       "PHALANX_CALLOUT_REVOKE_INTERVAL_S": "2.5"})
    assert (revoking.system_seed_file, revoking.revoke_interval_s) == ("/id/sys.nk", 2.5)


@pytest.mark.parametrize(("env", "said"), [
    ({}, "issuer_seed_file is required"),
    ({"PHALANX_CALLOUT_ISSUER_SEED_FILE": "/x"}, "token_key_file is required"),
    ({**KEYS, "PHALANX_CALLOUT_CONNECTION_TTL_S": "soon"}, "must be a number"),
    ({**KEYS, "PHALANX_CALLOUT_CONNECTION_TTL_S": "0.5"}, "at least 1 s"),
    ({**KEYS, "PHALANX_CALLOUT_REVOKE_INTERVAL_S": "often"}, "revoke_interval_s must be a number"),
    ({**KEYS, "PHALANX_CALLOUT_REVOKE_INTERVAL_S": "nan"}, "revoke_interval_s must be at least"),
    ({**KEYS, "PHALANX_CALLOUT_REVOKE_INTERVAL_S": "0"}, "revoke_interval_s must be at least"),
])
def test_bad_settings_are_refused_by_name(env: dict[str, str], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        CalloutConfig.from_env(env)
