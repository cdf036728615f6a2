"""Replica ids: what elasticity names, the agent reads back."""

from __future__ import annotations

from phalanx.schemas.replicas import incarnation, replica_id


def test_incarnation_reads_what_replica_id_writes() -> None:
    assert [incarnation(replica_id(7, n)) for n in (0, 1, 12)] == [0, 1, 12]
    assert replica_id(3, 0) == "r3-0"


def test_names_of_another_shape_carry_no_incarnation() -> None:
    assert incarnation("r3") is None
    assert incarnation("x1-2") is None
    assert incarnation("r1-2-3") is None
