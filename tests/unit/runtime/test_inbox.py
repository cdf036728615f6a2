"""The membership inbox and fault injection's configuration (no bus needed to feed them)."""

from __future__ import annotations

import pytest

from phalanx.runtime.inbox import Inbox
from phalanx.schemas.messages import (
    Fault,
    FaultKind,
    Generation,
    GenerationReason,
    Member,
    RankProgress,
)


def generation(number: int, replicas: list[str],
               reason: GenerationReason = GenerationReason.FAULT) -> Generation:
    return Generation(job_id="j", generation=number, world_size=len(replicas),
                      members=[Member(replica_id=r, rank=i, node_id="n", endpoint="h:1")
                               for i, r in enumerate(replicas)],
                      rendezvous=f"j-g{number}", resume_step=0, reason=reason)


def fault(replica: str, kind: FaultKind = FaultKind.CRASH) -> Fault:
    return Fault(fault_id=f"f-{replica}", job_id="j", kind=kind, rank=1, replica_id=replica,
                 node_id="n", detected_at=0.0)


def test_only_a_newer_generation_replaces_the_newest_and_wakes_the_trainer() -> None:
    inbox = Inbox("r0-0")
    inbox.on_generation(generation(3, ["r0-0", "r1-0"]), None)
    assert inbox.wake.is_set() and inbox.newest_number() == 3
    inbox.sleep(0)
    inbox.on_generation(generation(2, ["r0-0"]), None)  # late, or a repeat
    assert not inbox.wake.is_set() and inbox.newest_number() == 3


def test_a_collective_is_given_up_for_a_failed_member_or_a_fault_generation() -> None:
    inbox = Inbox("r0-0")
    current = generation(1, ["r0-0", "r1-0", "r2-0"])
    inbox.on_generation(current, None)
    assert not inbox.must_abort(current) and not inbox.must_abort(None)
    inbox.on_fault(fault("r1-0", FaultKind.STRAGGLER), None)  # slow is not failed
    assert not inbox.must_abort(current)
    inbox.on_generation(generation(2, ["r0-0", "r1-0", "r2-0", "r3-0"],
                                   GenerationReason.JOIN), None)
    assert not inbox.must_abort(current)  # a join waits for the step boundary
    inbox.on_fault(fault("r2-0"), None)
    assert inbox.must_abort(current)
    inbox.forget_faults(generation(3, ["r0-0", "r2-0"]))  # r2-0 is a member again
    assert not inbox.must_abort(current)
    inbox.on_generation(generation(3, ["r0-0", "r1-0"]), None)
    assert inbox.must_abort(current)  # replaced by a fault generation


@pytest.mark.parametrize("replica", ["r0-0", "r2-0"])
def test_a_leave_lets_the_step_in_flight_finish_for_those_who_stay_and_those_who_go(
        replica: str) -> None:
    inbox = Inbox(replica)
    current = generation(1, ["r0-0", "r1-0", "r2-0"])
    inbox.on_generation(current, None)
    inbox.on_generation(generation(2, ["r0-0", "r1-0"], GenerationReason.LEAVE), None)
    assert not inbox.must_abort(current)  # r2-0 leaves after the step boundary
    inbox.on_generation(generation(3, ["r0-0", "r1-0"]), None)
    assert inbox.must_abort(current)  # a fault generation supersedes the leave


def test_a_join_that_takes_this_replica_out_as_a_leaver_lets_the_step_finish() -> None:
    """Its slot was taken while the others were below min: the join that makes min again
    takes it out, planned, after the step everyone switches at."""
    inbox = Inbox("r2-0")
    current = generation(1, ["r0-0", "r1-0", "r2-0"])
    inbox.on_generation(current, None)
    inbox.on_generation(generation(2, ["r0-0", "r1-0", "r3-0"], GenerationReason.JOIN), None)
    assert not inbox.must_abort(current)


def test_a_join_after_a_generation_this_replica_missed_gives_up_its_collective() -> None:
    """A fault generation dropped it (unheard: the bus was away), then a join came."""
    inbox = Inbox("r2-0")
    current = generation(1, ["r0-0", "r1-0", "r2-0"])
    inbox.on_generation(current, None)
    inbox.on_generation(generation(3, ["r0-0", "r1-0", "r3-0"], GenerationReason.JOIN), None)
    assert inbox.must_abort(current)


def test_the_jobs_progress_only_goes_forward() -> None:
    inbox = Inbox("r3-0")
    for step in (5, 9, 7):
        inbox.on_progress(RankProgress(job_id="j", rank=0, replica_id="r0-0", step=step,
                                       generation=0, step_time_s=0.1, sent_at=0.0), None)
    assert inbox.finished_step == 9

