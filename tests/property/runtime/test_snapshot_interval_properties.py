"""Properties of the snapshot interval: the rule keeps the cost within budget with the
smallest interval, and members that each measure what they like still snapshot the same
steps, durable steps included."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from phalanx.runtime.snapshot_interval import (
    TAIL_LENGTH,
    IntervalPolicy,
    SnapshotSchedule,
    choose_interval,
    is_due,
)

seconds = st.floats(min_value=1e-6, max_value=100.0, allow_nan=False)
overheads = st.floats(min_value=1e-3, max_value=0.5)
ceilings = st.integers(min_value=1, max_value=1000)


@given(seconds, seconds, overheads, ceilings)
@example(0.043, 0.638, 0.03, 100)  # W: a 43 ms snapshot against a 638 ms step
def test_the_interval_is_the_smallest_within_budget(cost: float, step: float,
                                                    overhead: float, ceiling: int) -> None:
    k = choose_interval(cost, step, overhead, ceiling)
    assert 1 <= k <= ceiling
    if k < ceiling:  # at the ceiling the budget may be passed: fewer snapshots lose steps
        assert cost / (k * step) <= overhead * (1 + 1e-12)
    if k > 1:  # one step less would pass the budget
        assert cost / ((k - 1) * step) > overhead * (1 - 1e-12)


@given(seconds, seconds, seconds, overheads, ceilings)
def test_a_dearer_snapshot_is_never_taken_more_often(cost: float, more: float, step: float,
                                                     overhead: float, ceiling: int) -> None:
    assert choose_interval(cost + more, step, overhead, ceiling) \
        >= choose_interval(cost, step, overhead, ceiling)


@given(st.floats(max_value=0.0), seconds, overheads, ceilings)
def test_nothing_measured_means_every_step_so_the_first_snapshot_measures(
        cost: float, step: float, overhead: float, ceiling: int) -> None:
    assert choose_interval(cost, step, overhead, ceiling) == 1
    assert choose_interval(step, cost, overhead, ceiling) == 1


@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=1, max_value=200),
       st.integers(min_value=1, max_value=200))
def test_a_durable_step_is_always_snapshotted(n: int, interval: int, durable: int) -> None:
    assert is_due(n * durable, interval, durable)
    assert is_due(n * interval, interval, durable)


# One member's measurements at one step: its step time, and what its snapshot cost when
# one was due (a member may also have none: a joiner, a refused reservation).
member_steps = st.lists(st.tuples(seconds, seconds | st.none()), min_size=1, max_size=6)


@given(st.lists(member_steps, min_size=1, max_size=5), st.integers(1, 60),
       st.integers(0, 30), overheads, st.integers(1, 50))
def test_members_measuring_differently_snapshot_the_same_steps(
        members: list, steps: int, durable: int, overhead: float, ceiling: int) -> None:
    policy = IntervalPolicy(None, overhead, ceiling, durable)
    schedules = [SnapshotSchedule(policy) for _ in members]
    for n in range(1, steps + 1):
        # The step's all-reduce: every member's tail summed, the same bytes for everyone.
        summed = torch.zeros(TAIL_LENGTH, dtype=torch.float64)
        for schedule in schedules:
            summed += torch.tensor(schedule.tail(), dtype=torch.float64)
        for schedule in schedules:
            schedule.agree(summed.tolist())
        due = {schedule.due(n) for schedule in schedules}
        assert len(due) == 1, f"members disagree on step {n}"
        assert durable == 0 or n % durable or due == {True}
        for i, schedule in enumerate(schedules):
            step_s, cost_s = members[i][n % len(members[i])]
            schedule.measured(step_s, cost_s if schedule.due(n) else None)
