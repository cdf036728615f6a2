"""Recovery planning, pure: the same rows give every member the same plan (no gloo here)."""

from __future__ import annotations

import pytest

from phalanx.runtime.recovery import (
    MemberProgress,
    RecoveryPlan,
    Repair,
    StateLost,
    plan_recovery,
)

M = MemberProgress


@pytest.mark.parametrize(("members", "generation", "expected"), [
    pytest.param([M(0), M(0), M(0)], 0, RecoveryPlan(0, 0, (1, 2), None, None),
                 id="generation 0: everyone starts from rank 0's state, as DDP does"),
    pytest.param([M(100), M(100), M(100), M(0)], 3, RecoveryPlan(100, 0, (3,), None, (1, 2)),
                 id="a join: rank 0 sends, the joiner receives, the others compute step 100"),
    pytest.param([M(50, 50, 1), M(50, 50, 1), M(50, 50, 1)], 2,
                 RecoveryPlan(50, 0, (), Repair(50, 1), None),
                 id="a rank died mid-all-reduce: the kept gradients of step 50 count"),
    pytest.param([M(50, 50, 1), M(50), M(50, 50, 1)], 2,
                 RecoveryPlan(50, 0, (), Repair(50, 1), None),
                 id="a survivor that had not reached the all-reduce kept nothing"),
    pytest.param([M(50, 50, 1), M(50, 50, 2)], 3,
                 RecoveryPlan(50, 0, (), None, None),
                 id="kept from different attempts: the step runs whole"),
    pytest.param([M(51), M(50, 50, 1)], 2, RecoveryPlan(51, 0, (1,), None, None),
                 id="one survivor committed the step: the other receives its state"),
    pytest.param([M(50, 50, 1), M(50, 50, 1), M(0)], 2,
                 RecoveryPlan(50, 0, (2,), Repair(50, 1), None),
                 id="a join during a repair: the joiner computes its part after the copy"),
    pytest.param([M(-1), M(7), M(7)], 4, RecoveryPlan(7, 1, (0,), None, (2,)),
                 id="a copy cut short: that rank holds no step and receives again"),
])
def test_the_plan(members: list[MemberProgress], generation: int,
                  expected: RecoveryPlan) -> None:
    assert plan_recovery(members, generation) == expected


def test_a_row_round_trips_through_the_all_reduce_layout() -> None:
    row = M(50, 50, 1)
    assert M(*row.row()) == row and M(9).row() == [9, -1, -1]


def test_no_complete_state_is_refused() -> None:
    with pytest.raises(StateLost, match="every copy was cut short"):
        plan_recovery([M(-1), M(-1)], 5)


def test_members_behind_the_jobs_progress_are_refused_naming_the_steps() -> None:
    # Every replica that held step 300 is gone: starting over would redo committed steps.
    with pytest.raises(StateLost, match="holds step 300, which the job has reached .*up to 0"):
        plan_recovery([M(0), M(0)], 6, job_resume_step=300)


def test_every_member_restored_from_a_tier_copies_nothing_even_in_generation_0() -> None:
    """A whole-job restore: each member loaded the step (a sharded optimizer's member only
    its partition, so it could not send the whole state anyway)."""
    assert plan_recovery([M(40), M(40)], 0, 40, restored=True) == RecoveryPlan(
        40, 0, (), None, None)
    assert plan_recovery([M(40), M(40)], 0, 40) == RecoveryPlan(40, 0, (1,), None, None)
