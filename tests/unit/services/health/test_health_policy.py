"""HealthPolicy: defaults and validation, each message naming the field."""

from __future__ import annotations

import math

import pytest

from phalanx.schemas.errors import ConfigError
from phalanx.services.health.model import HealthPolicy


def test_defaults() -> None:
    policy = HealthPolicy()
    assert (policy.node_timeout_s, policy.straggler_factor, policy.straggler_steps,
            policy.straggler_min_ranks, policy.cordon_faults, policy.cordon_window_s) == (
        3.0, 2.0, 5, 3, 3, 300.0)


@pytest.mark.parametrize("field", ["node_timeout_s", "straggler_factor", "cordon_window_s"])
@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.inf, math.nan, True, "3"])
def test_float_fields_must_be_positive_and_finite(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"health.{field} must be a positive finite number"):
        HealthPolicy(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["straggler_steps", "straggler_min_ranks", "cordon_faults"])
@pytest.mark.parametrize("value", [0, -1, 1.5, 2.0, True, "3"])
def test_int_fields_must_be_integers_from_one(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"health.{field} must be an integer >= 1"):
        HealthPolicy(**{field: value})  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="got -2"):
        HealthPolicy(cordon_faults=-2)


def test_smallest_legal_values() -> None:
    policy = HealthPolicy(node_timeout_s=1e-9, straggler_factor=0.5, straggler_steps=1,
                          straggler_min_ranks=1, cordon_faults=1, cordon_window_s=1e-9)
    assert policy.straggler_steps == policy.straggler_min_ranks == policy.cordon_faults == 1
    assert HealthPolicy(node_timeout_s=2).node_timeout_s == 2
