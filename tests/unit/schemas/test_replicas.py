"""Replica ids: what elasticity names, the agent reads back."""

from __future__ import annotations

from phalanx.schemas.replicas import (
    incarnation,
    log_replica,
    member_log,
    replica_id,
    replica_order,
)


def test_incarnation_reads_what_replica_id_writes() -> None:
    assert [incarnation(replica_id(7, n)) for n in (0, 1, 12)] == [0, 1, 12]
    assert replica_id(3, 0) == "r3-0"


def test_names_of_another_shape_carry_no_incarnation() -> None:
    assert incarnation("r3") is None
    assert incarnation("x1-2") is None
    assert incarnation("r1-2-3") is None


def test_a_groups_logs_are_named_with_the_group_rank_and_read_back() -> None:
    assert member_log("r3-1", None) == "r3-1" and member_log("r3-1", 2) == "r3-1_g2"
    assert log_replica("r3-1_g2") == ("r3-1", 2) and log_replica("r3-1") == ("r3-1", None)
    logs = ["r10-0_g0", "r2-0_g10", "zz", "r2-0_g2", "r2-1_g0", "r1-0", "r2-0_g0"]
    assert sorted(logs, key=replica_order) == [
        "r1-0", "r2-0_g0", "r2-0_g2", "r2-0_g10", "r2-1_g0", "r10-0_g0", "zz"]
