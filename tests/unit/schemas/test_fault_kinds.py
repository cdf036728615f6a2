"""What each fault kind means to a job, decided once in the schema for elasticity and the
ranks alike."""

from __future__ import annotations

import pytest

from phalanx.schemas.messages import Fault, FaultKind


@pytest.mark.parametrize(("kind", "removes", "replaceable"), [
    (FaultKind.CRASH, True, True),
    (FaultKind.HANG, True, True),
    (FaultKind.STRAGGLER, False, True),
    (FaultKind.NODE_LOST, True, False),
])
def test_each_kind_says_whether_it_removes_the_member_and_may_be_replaced(
        kind: FaultKind, removes: bool, replaceable: bool) -> None:
    assert (kind.removes_member, kind.replaceable) == (removes, replaceable)


def test_every_kind_is_decided_here() -> None:
    """A new kind is listed above, or this fails: its meaning is a decision, not a default."""
    assert set(FaultKind) == {FaultKind.CRASH, FaultKind.HANG, FaultKind.STRAGGLER,
                              FaultKind.NODE_LOST}


def test_a_fault_without_a_replica_removes_no_member() -> None:
    """A node's fault before any rank of the job ran on it names no replica."""
    fault = Fault(fault_id="f", job_id="j", kind=FaultKind.CRASH, node_id="n", detected_at=0.0)
    assert not fault.removes_member
    named = Fault(fault_id="f", job_id="j", kind=FaultKind.CRASH, node_id="n",
                  detected_at=0.0, replica_id="r0-0")
    assert named.removes_member
    assert not Fault(fault_id="f", job_id="j", kind=FaultKind.STRAGGLER, node_id="n",
                     detected_at=0.0, replica_id="r0-0").removes_member
