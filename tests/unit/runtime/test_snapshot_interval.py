"""The snapshot schedule of one rank: the policy the agent passes, the interval it starts
with, its part of the all-reduce tail, and the window a slow snapshot counts in."""

from __future__ import annotations

import pytest

from phalanx.runtime.snapshot_interval import (
    COST_WINDOW,
    TAIL_LENGTH,
    IntervalPolicy,
    SnapshotSchedule,
    agreed_interval,
)
from phalanx.schemas.environment import CheckpointEnvironment


def policy(**env: str) -> IntervalPolicy | None:
    checkpoint = CheckpointEnvironment.from_env({"PHALANX_SNAPSHOT_DIR": "/s", **env})
    assert checkpoint is not None
    return IntervalPolicy.of(checkpoint)


def test_the_policy_the_agent_passes() -> None:
    assert policy() == IntervalPolicy()  # auto, 2 %, at most 100
    assert policy(PHALANX_CHECKPOINT_MEMORY_EVERY="0") is None
    fixed = policy(PHALANX_CHECKPOINT_MEMORY_EVERY="5")
    assert fixed is not None and fixed.every == 5
    auto = policy(PHALANX_CHECKPOINT_MEMORY_EVERY="auto",
                  PHALANX_CHECKPOINT_MEMORY_OVERHEAD="0.01",
                  PHALANX_CHECKPOINT_MEMORY_MAX_EVERY="7")
    assert auto is not None and (auto.every, auto.overhead, auto.max_every) == (None, 0.01, 7)


@pytest.mark.parametrize("kwargs", [{"every": 0}, {"overhead": 0.0}, {"overhead": 0.6},
                                    {"max_every": 0}, {"durable_every": -1}])
def test_a_policy_out_of_range_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        IntervalPolicy(**kwargs)


def test_adaptive_starts_at_every_step_and_a_fixed_interval_never_moves() -> None:
    adaptive, fixed = SnapshotSchedule(IntervalPolicy()), SnapshotSchedule(IntervalPolicy(4))
    assert adaptive.interval == 1 and adaptive.due(1)
    for schedule in (adaptive, fixed):
        schedule.agree([0.5, 1.0, 1.0])  # a snapshot costing half a step
    assert adaptive.interval == 25  # 0.5 / (0.02 * 1.0)
    assert fixed.interval == 4 and not fixed.due(6) and fixed.due(8)


def test_a_member_with_nothing_measured_adds_nothing() -> None:
    schedule = SnapshotSchedule(IntervalPolicy())
    assert schedule.tail() == [0.0] * TAIL_LENGTH
    schedule.measured(0.1, None)  # a step, no snapshot yet
    assert schedule.tail() == [0.0] * TAIL_LENGTH
    schedule.measured(0.1, 0.006)
    assert schedule.tail() == [0.006, 0.1, 1.0]
    assert agreed_interval([0.0] * TAIL_LENGTH, 0.03, 100) == 1


def test_a_slow_snapshot_counts_until_it_leaves_the_window() -> None:
    schedule = SnapshotSchedule(IntervalPolicy())
    for cost in [0.068] + [0.011] * (COST_WINDOW - 1):  # measured on W: first 68 ms, then 11
        schedule.measured(0.64, cost)
    schedule.agree(schedule.tail())
    assert schedule.interval == 2  # a mean of 22 ms is 3.5 % of a 0.64 s step
    # The window of whole costs (a snapshot and the step after it) is a step behind.
    for _ in range(2):
        schedule.measured(0.64, 0.011)
    schedule.agree(schedule.tail())
    assert schedule.interval == 1  # 11 ms is 1.7 %


def steps_of(schedule: SnapshotSchedule, plain_s: float, snapshot_s: float,
             after_s: float, snapshots: int, every: int = 5) -> None:
    """``snapshots`` rounds of ``every`` steps, a snapshot after the last of each round
    and the next step taking ``after_s``."""
    for i in range(snapshots):
        schedule.measured(after_s if i else plain_s, None)
        for _ in range(every - 2):
            schedule.measured(plain_s, None)
        schedule.measured(plain_s, snapshot_s)


def test_what_the_step_after_a_snapshot_loses_counts_in_its_cost() -> None:
    """On the H200's CPUs the step after a snapshot was slower than the others: its
    stragglers and the caches its copy evicted cost the job beside its own time."""
    schedule = SnapshotSchedule(IntervalPolicy())
    steps_of(schedule, plain_s=0.2, snapshot_s=0.004, after_s=0.206, snapshots=COST_WINDOW + 1)
    assert schedule.cost() == pytest.approx(0.010)
    schedule.agree(schedule.tail())
    assert schedule.interval == 3  # 10 ms is 5 % of a step; 4 ms alone would be 2 %


def test_a_step_after_a_snapshot_that_runs_fast_never_makes_it_cheaper() -> None:
    schedule = SnapshotSchedule(IntervalPolicy())
    steps_of(schedule, plain_s=0.2, snapshot_s=0.006, after_s=0.19, snapshots=COST_WINDOW + 1)
    assert schedule.cost() == pytest.approx(0.006)  # its own time in the thread, at least


def test_the_step_after_an_unmeasured_snapshot_is_neither_plain_nor_its_cost() -> None:
    """A membership's first write pays a fresh mapping's page faults: not measured, and
    the step after it is held against nothing."""
    schedule = SnapshotSchedule(IntervalPolicy())
    schedule.measured(0.2, None, taken=True)  # the first write of a buffer
    schedule.measured(0.5, None)  # the step after it, slowed
    assert schedule.cost() == 0.0
    schedule.measured(0.21, 0.004)
    schedule.measured(0.215, None)  # 10 ms over the plain steps' median (0.2, 0.21)
    assert schedule.cost() == pytest.approx(0.014)  # 0.5 among them: 5 ms


def test_the_mean_of_the_members_decides() -> None:
    # Two members: one measured 40 ms, one 20 ms, both 0.5 s steps: 30 ms is 6 %: every 2.
    assert agreed_interval([0.06, 1.0, 2.0], 0.03, 100) == 2
