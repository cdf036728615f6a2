"""The cluster's admission policy: priority classes and team quotas.

Priority classes are named weights (higher admits first and may preempt
lower). Each team (the job spec's ``team``) has a *nominal* quota of slots it
is guaranteed, and may *borrow* idle slots beyond it up to ``borrow_limit``
(``None`` = as many as are idle). Slots a team uses above its nominal are
borrowed: when a team that is under its nominal quota needs them back, the
borrower's gangs are preempted whatever their priority (reclaim). Teams not
listed get ``default_quota``; by default that is nominal 0 with unlimited
borrowing, so a cluster with no quotas configured simply shares everything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from phalanx.schemas.errors import ConfigError

DEFAULT_PRIORITY_CLASSES = {"low": 0, "normal": 100, "high": 1000}


@dataclasses.dataclass(frozen=True)
class TeamQuota:
    nominal: int = 0
    """Slots the team is guaranteed (reclaimed from borrowers when it needs them)."""
    borrow_limit: int | None = None
    """Slots the team may use above ``nominal`` while others leave them idle; None = no limit."""

    def __post_init__(self) -> None:
        if self.nominal < 0:
            raise ConfigError(f"quota nominal must be >= 0, got {self.nominal}")
        if self.borrow_limit is not None and self.borrow_limit < 0:
            raise ConfigError(f"quota borrow_limit must be >= 0, got {self.borrow_limit}")

    @property
    def ceiling(self) -> float:
        """Most slots the team may hold at once."""
        return float("inf") if self.borrow_limit is None else self.nominal + self.borrow_limit


@dataclasses.dataclass(frozen=True)
class AdmissionPolicy:
    priority_classes: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_PRIORITY_CLASSES))
    """Priority class name -> weight."""
    teams: Mapping[str, TeamQuota] = dataclasses.field(default_factory=dict)
    """Quota per team."""
    default_quota: TeamQuota = TeamQuota()
    """Quota of teams not listed in ``teams``."""
    max_reservations: int = 1
    """How many blocked gangs at the head of the queue hold slots as they free up."""

    def __post_init__(self) -> None:
        if not self.priority_classes:
            raise ConfigError("admission.priority_classes: at least one class is required")
        if self.max_reservations < 0:
            raise ConfigError(f"admission.max_reservations must be >= 0, "
                              f"got {self.max_reservations}")

    def quota(self, team: str) -> TeamQuota:
        return self.teams.get(team, self.default_quota)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> AdmissionPolicy:
        """Build from a TOML-style mapping (the ``[admission]`` table).

        Raises:
            ConfigError: an unknown key or a bad value, named.
        """
        known = {"priority_classes", "teams", "default_quota", "max_reservations"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown admission option(s) {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        if "priority_classes" in data:
            classes = data["priority_classes"]
            if not isinstance(classes, Mapping) or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in classes.values()):
                raise ConfigError("admission.priority_classes must map names to integer weights")
            values["priority_classes"] = dict(classes)
        if "teams" in data:
            if not isinstance(data["teams"], Mapping):
                raise ConfigError("admission.teams must be a table of team quotas")
            values["teams"] = {name: _quota(f"admission.teams.{name}", q)
                               for name, q in data["teams"].items()}
        if "default_quota" in data:
            values["default_quota"] = _quota("admission.default_quota", data["default_quota"])
        if "max_reservations" in data:
            values["max_reservations"] = _count("admission.max_reservations",
                                                data["max_reservations"])
        return cls(**values)


def _count(where: str, raw: Any) -> int:
    """A whole number of slots or gangs; refuses 2.5, "3", True."""
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"{where} must be a whole number, got {raw!r}")
    return raw


def _quota(where: str, raw: Any) -> TeamQuota:
    if not isinstance(raw, Mapping) or set(raw) - {"nominal", "borrow_limit"}:
        raise ConfigError(f"{where} must be a table with nominal and optional borrow_limit")
    borrow = raw.get("borrow_limit")
    try:
        return TeamQuota(_count(f"{where}.nominal", raw.get("nominal", 0)),
                         None if borrow is None else _count(f"{where}.borrow_limit", borrow))
    except ConfigError as exc:
        if str(exc).startswith(where):
            raise
        raise ConfigError(f"{where}: {exc}") from None
