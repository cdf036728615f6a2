"""A job's progress as health hears it: step, total, rate, restarts, and when it is stored."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import JobProgress, RestartPolicy
from phalanx.services.health.core import HealthCore
from phalanx.services.health.events import (
    FailJob,
    FinishJob,
    JobUnwatched,
    JobWatched,
    MemberApplied,
    ProgressReported,
    RaiseFault,
    RankExitSeen,
)
from phalanx.services.health.model import HealthPolicy
from phalanx.services.health.progress import StepTrack, carried

T0 = 1_717_000_000.0
EVERY = 1.0


def watched(policy: RestartPolicy | None = None) -> HealthCore:
    core = HealthCore(HealthPolicy())
    core.handle(JobWatched("j", ("n0", "n1"), 2.0, restart_policy=policy or RestartPolicy()), T0)
    return core


def test_the_step_is_the_most_any_rank_committed_and_the_rate_counts_pauses() -> None:
    track = StepTrack(window_s=10.0)
    assert track.reported(1, None, 0.0) and track.rate(0.0) is None
    assert track.reported(2, 100, 1.0)
    assert not track.reported(1, 100, 1.5)  # a rank one report behind moves nothing
    assert (track.step, track.total_steps, track.rate(1.0)) == (2, 100, 1.0)
    assert track.rate(2.0) == 0.5  # a second without a step: slower
    track.reported(3, 100, 30.0)  # after a long pause: from the last change before the window
    assert track.rate(30.0) == 1 / 29


def test_progress_is_taken_when_it_changed_at_most_once_per_interval() -> None:
    core = watched()
    assert core.take_progress(T0, EVERY) == []
    core.handle(ProgressReported("j", 0, 5, 0.1, total_steps=100), T0 + 1)
    core.handle(ProgressReported("j", 1, 5, 0.1, total_steps=100), T0 + 1)
    [first] = core.take_progress(T0 + 1, EVERY)
    assert (first.job_id, first.step, first.total_steps, first.restarts) == ("j", 5, 100, 0)
    core.handle(ProgressReported("j", 0, 6, 0.1), T0 + 1.5)
    assert core.take_progress(T0 + 1.5, EVERY) == []  # within the interval
    [second] = core.take_progress(T0 + 2.0, EVERY)
    assert (second.step, second.steps_per_s, second.updated_at) == (6, 1 / 1.0, T0 + 2.0)
    assert core.take_progress(T0 + 5.0, EVERY) == []  # nothing changed


def test_restarts_are_progress_and_a_job_that_ends_leaves_its_last_record() -> None:
    core = watched(RestartPolicy(max_app_failures=0))
    core.handle(ProgressReported("j", 0, 7, 0.1), T0 + 1)
    core.take_progress(T0 + 1, EVERY)
    out = core.handle(RankExitSeen("j", 1, "n1", None, "SIGKILL", "exited"), T0 + 2)
    assert any(isinstance(d, RaiseFault) for d in out)
    [after_kill] = core.take_progress(T0 + 2, EVERY)
    assert (after_kill.step, after_kill.restarts, after_kill.app_failures) == (7, 1, 0)
    # Stepped on since the kill, so rank 0's error is its own, not the kill's collateral.
    core.handle(ProgressReported("j", 0, 8, 0.1), T0 + 2.05)
    out = core.handle(RankExitSeen("j", 0, "n0", 1, None, "exited", detail="boom"), T0 + 2.1)
    assert any(isinstance(d, FailJob) for d in out)
    # Ended within the interval, its last record is taken all the same.
    [last] = core.take_progress(T0 + 2.1, EVERY)
    assert (last.step, last.restarts, last.app_failures) == (8, 1, 1)


def test_a_finished_job_leaves_its_final_step() -> None:
    core = watched()
    for rank in (0, 1):
        core.handle(ProgressReported("j", rank, 10, 0.1, final=True, total_steps=10), T0 + 1)
    core.take_progress(T0 + 1, EVERY)
    core.handle(RankExitSeen("j", 0, "n0", 0, None, "exited"), T0 + 1.2)
    out = core.handle(RankExitSeen("j", 1, "n1", 0, None, "exited"), T0 + 1.3)
    assert FinishJob("j", 10) in out
    [last] = core.take_progress(T0 + 1.3, EVERY)
    assert (last.step, last.total_steps) == (10, 10)


def test_a_new_placement_keeps_the_progress_and_a_new_admission_starts_afresh() -> None:
    core = watched()
    core.handle(ProgressReported("j", 0, 7, 0.1), T0 + 1)
    core.handle(JobWatched("j", ("n0",), 2.0), T0 + 2)  # shrunk: the same admission
    assert core.jobs["j"].track.step == 7


def test_a_job_unwatched_leaves_its_last_step_for_the_next_admission() -> None:
    """Preempted within the interval, the step it got to is taken all the same: the next
    admission resumes from what is stored (JobProgress.reached)."""
    core = watched()
    core.handle(ProgressReported("j", 0, 7, 0.1), T0 + 1)
    core.take_progress(T0 + 1, EVERY)
    core.handle(ProgressReported("j", 0, 9, 0.1), T0 + 1.2)
    core.handle(JobUnwatched("j"), T0 + 1.3)
    [last] = core.take_progress(T0 + 1.3, EVERY)
    assert last.step == 9
    core.handle(JobWatched("j", ("n0", "n1"), 2.0), T0 + 2)
    core.handle(JobUnwatched("j"), T0 + 3)  # nothing new since: nothing to store
    assert core.take_progress(T0 + 3, EVERY) == []


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 50), st.sampled_from([None, 40, 50]),
                          st.floats(0.0, 5.0)), max_size=40))
def test_the_track_holds_the_highest_step_the_latest_total_and_a_rate_never_negative(
        reports: list[tuple[int, int | None, float]]) -> None:
    track, now, highest = StepTrack(window_s=10.0), 0.0, 0
    for step, total, gap in reports:
        now += gap
        track.reported(step, total, now)
        highest = max(highest, step)
        assert track.step == highest
        rate = track.rate(now)
        assert rate is None or rate >= 0
        assert not track.changes or track.changes[-1][1] == track.step
    totals = [t for _, t, _ in reports if t is not None]
    assert track.total_steps == (totals[-1] if totals else None)


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500)), min_size=1, max_size=12))
def test_the_step_reached_is_carried_over_admissions_and_never_goes_back(records) -> None:
    """Each stored record is health's progress of one moment of some admission (``step``
    since that admission, ``reached`` as it was told): stored one over the other, the
    record's ``reached`` is the most any of them said, and its own step stays its own."""
    stored = None
    for step, reached in records:
        new = JobProgress(job_id="j", step=step, reached=reached)
        stored = carried(stored, new)
        assert stored.step == step
    assert stored is not None
    assert stored.reached == max(max(step, reached) for step, reached in records)


def test_a_job_admitted_again_keeps_what_it_had_reached() -> None:
    first = carried(None, JobProgress(job_id="j", step=300))
    assert first.reached == 300
    again = carried(first, JobProgress(job_id="j", step=0))  # the next admission's start
    assert (again.step, again.reached) == (0, 300)
    assert carried(again, JobProgress(job_id="j", step=320)).reached == 320


def test_a_rank_of_a_generation_the_job_moved_past_moves_nothing() -> None:
    core = watched()
    for rank in (0, 1):
        core.handle(ProgressReported("j", rank, 10, 0.1, generation=0), T0 + 1)
    core.handle(MemberApplied("j", "r0-0", 11, generation=1), T0 + 2)
    core.handle(ProgressReported("j", 0, 11, 0.1, generation=1), T0 + 2)
    # Rank 1 was cut off and trains on in generation 0 with whoever it still reaches.
    core.handle(ProgressReported("j", 1, 50, 0.1, generation=0), T0 + 2.5)
    [progress] = core.take_progress(T0 + 3, EVERY)
    assert progress.step == 11
    core.handle(ProgressReported("j", 0, 12, 0.1, generation=1), T0 + 4)
    [progress] = core.take_progress(T0 + 4, EVERY)
    assert progress.step == 12
