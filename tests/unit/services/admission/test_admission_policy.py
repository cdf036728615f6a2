"""AdmissionPolicy: defaults, quotas and parsing of the ``[admission]`` table."""

from __future__ import annotations

import math
from typing import Any

import pytest

from phalanx.schemas.errors import ConfigError
from phalanx.services.admission.policy import (
    DEFAULT_PRIORITY_CLASSES,
    AdmissionPolicy,
    TeamQuota,
)


def test_defaults_share_everything() -> None:
    policy = AdmissionPolicy()
    assert dict(policy.priority_classes) == {"low": 0, "normal": 100, "high": 1000}
    assert policy.priority_classes == DEFAULT_PRIORITY_CLASSES
    assert policy.priority_classes is not DEFAULT_PRIORITY_CLASSES
    assert policy.max_reservations == 1
    assert policy.quota("anyone") == TeamQuota(0, None)
    assert policy.quota("anyone").ceiling == math.inf


@pytest.mark.parametrize(("quota", "ceiling"), [
    (TeamQuota(), math.inf),
    (TeamQuota(4), math.inf),
    (TeamQuota(4, 0), 4),
    (TeamQuota(4, 2), 6),
    (TeamQuota(0, 3), 3),
])
def test_ceiling_is_nominal_plus_borrow_limit(quota: TeamQuota, ceiling: float) -> None:
    assert quota.ceiling == ceiling


@pytest.mark.parametrize(("nominal", "borrow", "message"), [
    (-1, None, "quota nominal must be >= 0, got -1"),
    (0, -2, "quota borrow_limit must be >= 0, got -2"),
])
def test_negative_quota_is_a_config_error(nominal: int, borrow: int | None,
                                          message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TeamQuota(nominal, borrow)


def test_listed_teams_get_their_quota_others_the_default() -> None:
    policy = AdmissionPolicy(teams={"a": TeamQuota(4, 1)}, default_quota=TeamQuota(1, 0))
    assert policy.quota("a") == TeamQuota(4, 1)
    assert policy.quota("b") == TeamQuota(1, 0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"priority_classes": {}}, "admission.priority_classes: at least one class is required"),
    ({"max_reservations": -1}, "admission.max_reservations must be >= 0, got -1"),
])
def test_constructor_rejects(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AdmissionPolicy(**kwargs)


def test_from_mapping_empty_is_the_default() -> None:
    assert AdmissionPolicy.from_mapping({}) == AdmissionPolicy()


def test_from_mapping_full_table() -> None:
    policy = AdmissionPolicy.from_mapping({
        "priority_classes": {"batch": 1, "prod": 50},
        "teams": {"research": {"nominal": 16, "borrow_limit": 8}, "infra": {"nominal": 4}},
        "default_quota": {"nominal": 0, "borrow_limit": 2},
        "max_reservations": 3,
    })
    assert dict(policy.priority_classes) == {"batch": 1, "prod": 50}
    assert policy.quota("research") == TeamQuota(16, 8)
    assert policy.quota("research").ceiling == 24
    assert policy.quota("infra") == TeamQuota(4, None)
    assert policy.quota("other") == TeamQuota(0, 2)
    assert policy.max_reservations == 3


def test_from_mapping_explicit_null_borrow_limit_is_unlimited() -> None:
    policy = AdmissionPolicy.from_mapping({"teams": {"a": {"nominal": 2, "borrow_limit": None}}})
    assert policy.quota("a").ceiling == math.inf


def test_from_mapping_copies_priority_classes() -> None:
    classes = {"x": 1}
    policy = AdmissionPolicy.from_mapping({"priority_classes": classes})
    classes["y"] = 2
    assert dict(policy.priority_classes) == {"x": 1}


@pytest.mark.parametrize(("data", "message"), [
    ({"priorities": {}}, r"unknown admission option\(s\) \['priorities'\]; known: "
                         r"\['default_quota', 'max_reservations', 'priority_classes', 'teams'\]"),
    ({"priority_classes": ["low"]}, "admission.priority_classes must map names to integer"),
    ({"priority_classes": {"low": "0"}}, "admission.priority_classes must map names to integer"),
    ({"priority_classes": {"low": 1.5}}, "admission.priority_classes must map names to integer"),
    ({"priority_classes": {"low": True}}, "admission.priority_classes must map names to integer"),
    ({"priority_classes": {}}, "at least one class is required"),
    ({"teams": {"a": 4}}, "admission.teams.a must be a table with nominal and optional"),
    ({"teams": {"a": {"nominal": 1, "limit": 2}}}, "admission.teams.a must be a table"),
    ({"teams": {"a": {"nominal": "lots"}}},
     "admission.teams.a.nominal must be a whole number, got 'lots'"),
    ({"teams": {"a": {"nominal": [1]}}}, r"admission.teams.a.nominal must be a whole number"),
    ({"teams": {"a": {"nominal": "3"}}}, "admission.teams.a.nominal must be a whole number"),
    ({"teams": {"a": {"nominal": 2.5}}}, "admission.teams.a.nominal must be a whole number"),
    ({"teams": {"a": {"borrow_limit": True}}}, "admission.teams.a.borrow_limit must be a whole"),
    ({"default_quota": "none"}, "admission.default_quota must be a table"),
    ({"default_quota": {"borrow_limit": 0.5}}, "admission.default_quota.borrow_limit must be"),
    ({"max_reservations": "2"}, "admission.max_reservations must be a whole number, got '2'"),
    ({"max_reservations": None}, "admission.max_reservations must be a whole number"),
    ({"max_reservations": 1.5}, "admission.max_reservations must be a whole number"),
    ({"max_reservations": -1}, "admission.max_reservations must be >= 0, got -1"),
])
def test_from_mapping_rejects_naming_the_option(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AdmissionPolicy.from_mapping(data)


@pytest.mark.parametrize(("data", "option"), [
    ({"teams": {"a": {"nominal": -1}}}, "admission.teams.a"),
    ({"teams": {"a": {"borrow_limit": -3}}}, "admission.teams.a"),
    ({"default_quota": {"nominal": -5}}, "admission.default_quota"),
])
def test_from_mapping_negative_quota_names_the_table(data: dict[str, Any], option: str) -> None:
    """(Was a bug: the error read "quota nominal must be >= 0, got -1", naming no team.)"""
    with pytest.raises(ConfigError, match=option):
        AdmissionPolicy.from_mapping(data)


def test_from_mapping_teams_must_be_a_table() -> None:
    """(Was a bug: ``data["teams"].items()`` ran unguarded and raised AttributeError.)"""
    with pytest.raises(ConfigError, match="admission.teams"):
        AdmissionPolicy.from_mapping({"teams": ["research"]})
