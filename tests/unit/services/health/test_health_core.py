"""The failure-detection rules of ``HealthCore``, case by case.

Each test feeds events (and ticks) at explicit times and asserts on the
decisions returned; ``check_invariants`` runs after every call. Deadlines are
strict: a timeout fires just after ``last + timeout``, never at it.
"""

from __future__ import annotations

import math

import pytest

from phalanx.schemas.errors import StoredStateError
from phalanx.schemas.messages import FaultKind
from phalanx.services.health.core import HealthCore
from phalanx.services.health.events import (
    CordonNode,
    Decision,
    Event,
    FinishJob,
    HeartbeatSeen,
    JobUnwatched,
    JobWatched,
    JudgementHeld,
    MarkNodeAlive,
    MarkNodeLost,
    MemberApplied,
    NodeUncordoned,
    ProgressReported,
    RaiseFault,
    RankExitSeen,
    RankStartSeen,
    WatchLost,
    WatchResumed,
)
from phalanx.services.health.model import HealthPolicy
from phalanx.services.health.stored import snapshot

T0 = 1_717_000_000.0
CRASH, HANG, STRAGGLER, LOST = (FaultKind.CRASH, FaultKind.HANG, FaultKind.STRAGGLER,
                                FaultKind.NODE_LOST)
SPREAD = HealthPolicy().cordon_spread_s  # a charge to a node is judged this long after it


def after(t: float) -> float:
    """The first time strictly after ``t``."""
    return math.nextafter(t, math.inf)


def make(nodes: tuple[str, ...] = ("n0", "n1", "n2"), *, job: str = "j", hang: float = 2.0,
         **policy: float) -> HealthCore:
    core = HealthCore(HealthPolicy(**policy))  # type: ignore[arg-type]
    if nodes:
        assert run(core, T0, JobWatched(job, nodes, hang)) == []
    return core


def run(core: HealthCore, now: float, *events: Event) -> list[Decision]:
    decisions: list[Decision] = []
    for event in events:
        decisions += core.handle(event, now)
        core.check_invariants()
    return decisions


def tick(core: HealthCore, now: float) -> list[Decision]:
    decisions = core.tick(now)
    core.check_invariants()
    return decisions


def progress(rank: int, step_time: float = 1.0, job: str = "j", step: int = 1
             ) -> ProgressReported:
    return ProgressReported(job, rank, step, step_time)


def exited(rank: int, code: int | None = 0, node: str | None = None, *, job: str = "j",
           signal: str | None = None, cause: str = "exited") -> RankExitSeen:
    return RankExitSeen(job, rank, node or f"n{rank}", code, signal, cause)


def faults(decisions: list[Decision]) -> list[tuple[FaultKind, str, int | None, str]]:
    """(kind, job, rank, node) of each fault, in order."""
    return [(d.kind, d.job_id, d.rank, d.node_id) for d in decisions if isinstance(d, RaiseFault)]


def names(decisions: list[Decision]) -> list[str]:
    return [type(d).__name__ for d in decisions]


# --- events and clock ----------------------------------------------------------------------


def test_unknown_event_is_a_type_error_and_changes_nothing() -> None:
    core = make()
    run(core, T0, HeartbeatSeen("n0"))
    with pytest.raises(TypeError, match="unknown event"):
        core.handle("heartbeat", T0 + 100)  # type: ignore[arg-type]
    assert core.now == T0
    assert core.next_deadline() == T0 + 3.0
    core.check_invariants()


@pytest.mark.parametrize("cause", ["crashed", "", "EXITED"])
def test_exit_cause_must_be_known(cause: str) -> None:
    with pytest.raises(ValueError, match="cause must be one of"):
        RankExitSeen("j", 0, "n0", 1, None, cause)


@pytest.mark.parametrize(("nodes", "hang", "message"), [
    ((), 2.0, "nodes must not be empty"),
    (("n0",), 0.0, "hang_timeout_s must be a positive finite number"),
    (("n0",), -1.0, "hang_timeout_s"),
    (("n0",), math.inf, "hang_timeout_s"),
    (("n0",), math.nan, "hang_timeout_s"),
])
def test_job_watched_is_validated(nodes: tuple[str, ...], hang: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobWatched("j", nodes, hang)


def test_nan_time_is_refused() -> None:
    with pytest.raises(ValueError, match="nan"):
        make().tick(math.nan)


def test_an_earlier_now_counts_as_the_latest_seen() -> None:
    core = make()
    run(core, T0 + 5, HeartbeatSeen("n0"))
    run(core, T0 + 1, HeartbeatSeen("n1"))  # delivered late, stamped with an older clock
    assert core.nodes["n1"].last_heartbeat == T0 + 5
    assert core.next_deadline() == T0 + 8


def test_due_timeouts_come_before_the_events_own_decisions() -> None:
    core = make(("n0",), hang=5.0)
    run(core, T0, HeartbeatSeen("n0"), progress(0))
    decisions = run(core, T0 + 10, exited(0, 1))
    assert faults(decisions) == [(LOST, "j", 0, "n0"), (CRASH, "j", 0, "n0")]
    assert names(decisions) == ["MarkNodeLost", "RaiseFault", "RaiseFault"]


# --- crash ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "signal", "cause", "detail"), [
    (1, None, "exited", "rank 1 exited with code 1"),
    (137, None, "exited", "rank 1 exited with code 137"),
    (-11, None, "exited", "rank 1 exited with code -11"),
    (None, "SIGKILL", "exited", "rank 1 was killed by signal SIGKILL"),
    (0, "SIGTERM", "exited", "rank 1 was killed by signal SIGTERM (exit code 0)"),
    (None, None, "exited", "rank 1 exited with an unknown status"),
    (None, None, "lost", "rank 1 was found dead by a restarted agent on n1; its exit status "
                         "is unknown"),
    (1, None, "lost", "found dead by a restarted agent on n1; its exit status is unknown "
                      "(reported: exit code 1, signal None)"),
    (0, "SIGKILL", "lost", "found dead"),
])
def test_crash_is_a_fault_at_once(code: int | None, signal: str | None, cause: str,
                                  detail: str) -> None:
    core = make()
    decisions = run(core, T0 + 1, exited(1, code, signal=signal, cause=cause))
    assert len(decisions) == 1
    fault = decisions[0]
    assert isinstance(fault, RaiseFault)
    assert (fault.job_id, fault.kind, fault.node_id, fault.rank) == ("j", CRASH, "n1", 1)
    assert (fault.exit_code, fault.signal) == (code, signal)
    assert detail in fault.detail


@pytest.mark.parametrize(("code", "signal", "cause"), [
    (0, None, "exited"),
    (0, None, "lost"),  # a restarted agent that still knows the status
    (0, None, "stopped"),
    (1, None, "stopped"),
    (None, "SIGTERM", "stopped"),
    (None, "SIGKILL", "stopped"),
    (None, None, "stopped"),
])
def test_no_fault_for_a_clean_or_agent_caused_exit(code: int | None, signal: str | None,
                                                    cause: str) -> None:
    core = make()
    assert run(core, T0 + 1, exited(1, code, signal=signal, cause=cause)) == []
    assert core.jobs["j"].ranks[1].exit is not None


@pytest.mark.parametrize("event", [
    exited(0, 1, job="other"),  # never watched
    exited(3, 1),  # outside the placement
    exited(0, 1, node="n9"),  # reported from another node: a leftover
])
def test_crash_ignored_outside_the_watch(event: RankExitSeen) -> None:
    core = make()
    assert run(core, T0 + 1, event) == []
    core.check_invariants()


def test_no_crash_fault_after_the_job_ended() -> None:
    core = make()
    run(core, T0 + 1, JobUnwatched("j"))
    assert "j" not in core.jobs
    assert run(core, T0 + 2, exited(0, 1)) == []


def test_an_exit_is_reported_once() -> None:
    core = make()
    assert faults(run(core, T0 + 1, exited(0, 1))) == [(CRASH, "j", 0, "n0")]
    assert run(core, T0 + 2, exited(0, 1)) == []
    assert run(core, T0 + 3, exited(0, 0)) == []


def test_a_restarted_rank_can_crash_again() -> None:
    core = make()
    assert len(faults(run(core, T0 + 1, exited(0, 1)))) == 1
    run(core, T0 + 2, RankStartSeen("j", 0, "n0", 4242))
    assert faults(run(core, T0 + 3, exited(0, None, signal="SIGSEGV"))) == [
        (CRASH, "j", 0, "n0")]


def test_crash_names_the_node_the_rank_was_started_on() -> None:
    core = make()
    run(core, T0, RankStartSeen("j", 0, "n7", 100))
    assert run(core, T0 + 1, exited(0, 1, node="n0")) == []  # not where it runs
    assert faults(run(core, T0 + 1, exited(0, 1, node="n7"))) == [(CRASH, "j", 0, "n7")]


# --- finish --------------------------------------------------------------------------------


def test_job_finishes_once_when_every_rank_exits_zero() -> None:
    core = make()
    assert run(core, T0 + 1, exited(2, 0), exited(0, 0)) == []
    assert run(core, T0 + 2, exited(1, 0)) == [FinishJob("j")]
    assert "j" not in core.jobs
    assert run(core, T0 + 3, exited(1, 0), exited(1, 1), progress(0)) == []
    assert tick(core, T0 + 100) == []


@pytest.mark.parametrize(("last", "finished"), [
    (exited(2, 0), True),
    (exited(2, 0, cause="stopped"), True),  # stopped by its agent: no longer needed
    (exited(2, 1), True),  # crashed after the others finished: nothing runs any more
    (exited(2, None, signal="SIGKILL"), True),
    (exited(2, None, cause="lost"), True),
    (exited(2, 0, node="n0"), False),  # not from its node: rank 2 still runs
])
def test_finish_needs_some_rank_done_and_none_running(last: RankExitSeen, finished: bool) -> None:
    core = make()
    run(core, T0 + 1, exited(0, 0), exited(1, 0))
    assert (FinishJob("j") in run(core, T0 + 2, last)) is finished


def test_a_crashed_slot_that_is_never_replaced_does_not_hold_the_job_back() -> None:
    """Its replacements ran out (or its node is gone): the others finish the training."""
    core = make()
    [fault] = run(core, T0 + 1, exited(1, None, signal="SIGKILL"))
    assert fault.kind is CRASH
    assert run(core, T0 + 50, exited(0, 0)) == []  # rank 2 still trains
    assert run(core, T0 + 51, exited(2, 0)) == [FinishJob("j")]


def test_the_same_rank_twice_does_not_finish_a_job() -> None:
    core = make(("n0", "n1"))
    assert run(core, T0 + 1, exited(0, 0), exited(0, 0)) == []
    assert "j" in core.jobs


def test_a_crashed_rank_restarted_and_exiting_zero_finishes_the_job() -> None:
    core = make(("n0", "n1"))
    run(core, T0 + 1, exited(1, 1))
    run(core, T0 + 2, RankStartSeen("j", 1, "n1", 7), exited(0, 0))
    assert run(core, T0 + 3, exited(1, 0)) == [FinishJob("j")]


def test_finished_job_can_be_watched_again() -> None:
    core = make(("n0",))
    assert run(core, T0 + 1, exited(0, 0)) == [FinishJob("j")]
    run(core, T0 + 2, JobWatched("j", ("n0",), 2.0))
    assert run(core, T0 + 3, exited(0, 0)) == [FinishJob("j")]


# --- hang ----------------------------------------------------------------------------------


@pytest.mark.parametrize("hang", [0.5, 2.0, 30.0])
def test_hang_fires_just_after_the_deadline_not_at_it(hang: float) -> None:
    core = make(hang=hang)
    run(core, T0 + 1, progress(1, step=7))
    deadline = T0 + 1 + hang
    assert core.next_deadline() == deadline
    assert tick(core, deadline) == []
    decisions = tick(core, after(deadline))
    assert faults(decisions) == [(HANG, "j", 1, "n1")]
    assert decisions[0].detail == (  # type: ignore[union-attr]
        f"rank 1 reported no progress for more than {hang:g} s after step 7")


def test_a_rank_starting_up_is_not_judged() -> None:
    core = make()
    run(core, T0, RankStartSeen("j", 0, "n0", 1), RankStartSeen("j", 1, "n1", 2))
    assert core.next_deadline() is None
    assert tick(core, T0 + 1000) == []


def test_a_rank_that_reported_its_final_step_is_not_judged_while_it_exits() -> None:
    core = make(hang=2.0)
    run(core, T0, progress(0), ProgressReported("j", 0, 100, 1.0, final=True))
    assert tick(core, T0 + 1000) == []
    run(core, T0 + 1001, progress(0, step=101))  # reporting again: judged again
    assert faults(tick(core, T0 + 1004)) == [(HANG, "j", 0, "n0")]


@pytest.mark.parametrize("gap", [0.5, 1.999, 2.0])
def test_late_report_before_the_deadline_is_no_fault(gap: float) -> None:
    core = make(hang=2.0)
    now = T0
    run(core, now, progress(0))
    for _ in range(5):
        now += gap
        assert run(core, now, progress(0)) == []
        assert core.next_deadline() == now + 2.0


def test_report_after_the_deadline_is_a_hang_even_without_a_tick() -> None:
    core = make(hang=2.0)
    run(core, T0, progress(0))
    decisions = run(core, T0 + 2.5, progress(0))
    assert faults(decisions) == [(HANG, "j", 0, "n0")]
    assert core.next_deadline() == T0 + 4.5  # re-armed by the report


def test_a_member_whose_reports_went_unheard_is_judged_once_its_generation_applied() -> None:
    """A replacement reported only to a leader that died, then hung: its generation's
    stored event, which the next leader reads, makes it a reporting rank."""
    core = make(hang=2.0)
    run(core, T0, RankStartSeen("j", 2, "n2", 77, "r5-0"), progress(0), progress(1))
    assert run(core, T0 + 1, MemberApplied("j", "r9-9", 1349)) == []  # no such replica
    assert faults(tick(core, T0 + 10)) == [(HANG, "j", 0, "n0"), (HANG, "j", 1, "n1")]
    assert run(core, T0 + 11, MemberApplied("j", "r5-0", 1349)) == []
    decisions = tick(core, after(T0 + 13))
    assert faults(decisions) == [(HANG, "j", 2, "n2")]
    assert "after step 1349" in next(d for d in decisions if isinstance(d, RaiseFault)).detail
    restored = HealthCore(core.policy)  # the flag is stored: a next leader judges it too
    restored.restore(snapshot(core.jobs["j"]), T0 + 20)
    assert restored.jobs["j"].ranks[2].reporting


def test_one_hang_fault_per_silence_then_rearmed_by_progress() -> None:
    core = make(hang=2.0)
    run(core, T0, progress(0))
    assert len(faults(tick(core, T0 + 3))) == 1
    assert core.next_deadline() == T0 + 2 + SPREAD  # only the hang's charge to its node
    assert tick(core, T0 + 4) == tick(core, T0 + 100) == []
    assert run(core, T0 + 101, progress(0)) == []
    assert tick(core, T0 + 103) == []
    assert faults(tick(core, T0 + 103.5)) == [(HANG, "j", 0, "n0")]


def test_hang_per_rank_in_deadline_order() -> None:
    core = make(hang=2.0)
    run(core, T0, progress(2))
    run(core, T0 + 0.5, progress(0))
    run(core, T0 + 1, progress(1))
    assert [f[2] for f in faults(tick(core, T0 + 10))] == [2, 0, 1]


@pytest.mark.parametrize("end", [
    exited(0, 0), exited(0, 0, cause="stopped"), exited(0, 1), exited(0, None, cause="lost"),
])
def test_no_hang_after_the_rank_exited(end: RankExitSeen) -> None:
    core = make()
    run(core, T0, progress(0))
    run(core, T0 + 1, end)
    # Nothing but, for a lost status (the infrastructure's), the charge to its node.
    assert core.next_deadline() == (T0 + 1 + SPREAD if end.cause == "lost" else None)
    assert faults(tick(core, T0 + 100)) == []


def test_no_hang_after_the_job_ended() -> None:
    core = make()
    run(core, T0, progress(0), progress(1))
    run(core, T0 + 1, JobUnwatched("j"))
    assert core.next_deadline() is None
    assert tick(core, T0 + 100) == []
    assert run(core, T0 + 101, progress(0)) == []  # no longer watched
    assert core.next_deadline() is None


def test_progress_of_an_unwatched_job_or_unknown_rank_is_ignored() -> None:
    core = make()
    run(core, T0, progress(0, job="other"), progress(3), progress(-1))
    assert core.next_deadline() is None
    assert tick(core, T0 + 100) == []


def test_restarted_rank_is_not_judged_until_it_reports() -> None:
    core = make()
    run(core, T0, progress(0))
    run(core, T0 + 1, RankStartSeen("j", 0, "n0", 99))
    assert core.next_deadline() is None
    assert tick(core, T0 + 100) == []
    run(core, T0 + 101, progress(0))
    assert core.next_deadline() == T0 + 103


def test_new_placement_resets_every_rank() -> None:
    core = make(("n0", "n1"))
    run(core, T0, progress(0), progress(1))
    run(core, T0 + 1, JobWatched("j", ("n2", "n3", "n4"), 2.0))
    assert core.next_deadline() is None
    assert tick(core, T0 + 100) == []
    assert [r.node_id for r in core.jobs["j"].ranks.values()] == ["n2", "n3", "n4"]
    assert faults(run(core, T0 + 101, exited(2, 1, node="n4"))) == [(CRASH, "j", 2, "n4")]
    assert run(core, T0 + 101, exited(0, 1, node="n0")) == []  # the old placement's rank 0


def test_a_shrunk_placement_keeps_its_slot_numbers() -> None:
    core = make(("n0", "n0", "n1", "n1"))
    # n0 is gone: the job keeps slots 2 and 3 on n1, under their numbers.
    run(core, T0, JobWatched("j", ("n1", "n1"), 2.0, slots=(2, 3)))
    assert sorted(core.jobs["j"].ranks) == [2, 3]
    assert faults(run(core, T0 + 1, exited(3, 1, node="n1"))) == [(CRASH, "j", 3, "n1")]
    # Slots 0 and 1 are departing: their stop or clean exit is no event.
    assert run(core, T0 + 1, exited(0, 1, node="n0", cause="stopped"),
               exited(1, 0, node="n0")) == []
    assert core.jobs["j"].departing == {}
    with pytest.raises(ValueError, match="slots must name"):
        JobWatched("j", ("n1", "n1"), 2.0, slots=(2, 2))


def test_a_slot_taken_before_its_node_was_judged_lost_still_gets_its_fault() -> None:
    # Admission judged n0 lost first and shrank the job to n1's slots: the members on n0
    # still need their node-lost fault, or the others wait for them in a step forever.
    core = make(("n0", "n0", "n1", "n1"), hang=10.0)
    run(core, T0, HeartbeatSeen("n0"), HeartbeatSeen("n1"), progress(0), progress(2))
    run(core, T0 + 1, JobWatched("j", ("n1", "n1"), 10.0, slots=(2, 3)))
    assert sorted(core.jobs["j"].departing) == [0, 1]
    restored = HealthCore(core.policy)  # a restarted detector knows them too
    restored.restore(snapshot(core.jobs["j"]), T0 + 1)
    run(restored, T0 + 1, HeartbeatSeen("n0"))
    for detector, lost_at in ((core, T0 + 3), (restored, T0 + 4)):
        run(detector, lost_at, HeartbeatSeen("n1"))
        assert faults(tick(detector, lost_at + 0.5)) == [(LOST, "j", 0, "n0"),
                                                          (LOST, "j", 1, "n0")]
        assert detector.jobs["j"].departing == {}


def test_a_departing_rank_is_not_judged_for_hangs_but_its_crash_is_a_fault() -> None:
    core = make(("n0", "n1", "n2"), hang=1.0)
    run(core, T0, progress(0), progress(1), progress(2))
    run(core, T0 + 0.5, JobWatched("j", ("n0", "n1"), 1.0, slots=(0, 1)), progress(0),
        progress(1))
    assert faults(tick(core, T0 + 1.7)) == [(HANG, "j", 0, "n0"), (HANG, "j", 1, "n1")]
    # Slot 2 reported nothing since, yet it is on its way out: no hang; a crash counts.
    assert faults(run(core, T0 + 2, exited(2, None, signal="SIGKILL"))) == \
        [(CRASH, "j", 2, "n2")]
    assert run(core, T0 + 2, exited(2, None, signal="SIGKILL")) == []  # once


def test_a_new_hang_timeout_is_a_new_watch() -> None:
    core = make(hang=2.0)
    run(core, T0, progress(0))
    run(core, T0 + 1, JobWatched("j", ("n0", "n1", "n2"), 5.0))
    assert core.next_deadline() is None
    run(core, T0 + 2, progress(0))
    assert core.next_deadline() == T0 + 7


def test_an_identical_watch_is_a_replay() -> None:
    core = make(hang=2.0)
    run(core, T0, progress(0), exited(1, 0))
    run(core, T0 + 1, JobWatched("j", ("n0", "n1", "n2"), 2.0))
    assert core.next_deadline() == T0 + 2
    assert core.jobs["j"].ranks[1].exit == "done"
    assert faults(tick(core, T0 + 3)) == [(HANG, "j", 0, "n0")]


def test_hang_names_the_node_the_rank_was_started_on() -> None:
    core = make()
    run(core, T0, RankStartSeen("j", 1, "n9", 5), progress(1))
    assert faults(tick(core, T0 + 3)) == [(HANG, "j", 1, "n9")]


# --- straggler -----------------------------------------------------------------------------

STRAGGLE = {"straggler_factor": 2.0, "straggler_steps": 3, "straggler_min_ranks": 3}


def reports(core: HealthCore, times: dict[int, float], now: float = T0) -> list[Decision]:
    return run(core, now, *(progress(rank, t) for rank, t in times.items()))


@pytest.mark.parametrize(("slow", "faulted"), [
    (2.0, False),  # exactly factor x median: not over
    (2.0001, True),
    (2.5, True),
    (10.0, True),
])
def test_straggler_after_consecutive_slow_reports(slow: float, faulted: bool) -> None:
    core = make(**STRAGGLE)
    reports(core, {0: 1.0, 1: 1.0})
    assert reports(core, {2: slow}) == []
    assert reports(core, {2: slow}) == []
    decisions = reports(core, {2: slow})
    if faulted:
        assert faults(decisions) == [(STRAGGLER, "j", 2, "n2")]
        assert "median 1 s of the other 2 rank(s), for 3 reports in a row" in (
            decisions[0].detail)  # type: ignore[union-attr]
    else:
        assert decisions == []


def test_straggler_streak_must_be_unbroken() -> None:
    core = make(**STRAGGLE)
    reports(core, {0: 1.0, 1: 1.0})
    for t in (3.0, 3.0, 1.5, 3.0, 3.0):
        assert reports(core, {2: t}) == []
    assert faults(reports(core, {2: 3.0})) == [(STRAGGLER, "j", 2, "n2")]


def test_straggler_once_until_back_under_the_threshold() -> None:
    core = make(**STRAGGLE)
    reports(core, {0: 1.0, 1: 1.0})
    found = [faults(reports(core, {2: 3.0})) for _ in range(8)]
    assert [len(f) for f in found] == [0, 0, 1, 0, 0, 0, 0, 0]
    reports(core, {2: 1.0})  # re-armed
    found = [faults(reports(core, {2: 3.0})) for _ in range(3)]
    assert [len(f) for f in found] == [0, 0, 1]


@pytest.mark.parametrize(("min_ranks", "reporting", "faulted"), [
    (3, 2, False),
    (3, 3, True),
    (4, 3, False),
    (2, 2, True),
    (1, 1, False),  # a lone rank has no others to compare with
])
def test_straggler_needs_enough_reporting_ranks(min_ranks: int, reporting: int,
                                                faulted: bool) -> None:
    core = make(tuple(f"n{i}" for i in range(4)), straggler_steps=2,
                straggler_min_ranks=min_ranks)
    reports(core, {r: 1.0 for r in range(reporting - 1)})
    found = faults(reports(core, {reporting - 1: 5.0}) + reports(core, {reporting - 1: 5.0}))
    assert bool(found) is faulted


def test_straggler_median_is_of_the_other_ranks() -> None:
    # Others [1, 1, 3]: median 1, so 2.5 is slow; with itself, [1, 1, 2.5, 3] has median 1.75.
    core = make(("n0", "n1", "n2", "n3"), straggler_steps=1)
    reports(core, {0: 1.0, 1: 1.0, 2: 3.0})
    assert faults(reports(core, {3: 2.5})) == [(STRAGGLER, "j", 3, "n3")]


def test_straggler_median_of_an_even_count() -> None:
    core = make(("n0", "n1", "n2", "n3", "n4"), straggler_steps=1, straggler_min_ranks=5)
    reports(core, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0})  # median 2.5
    assert reports(core, {4: 5.0}) == []
    assert len(faults(reports(core, {4: 5.01}))) == 1


def test_exited_ranks_do_not_count_for_stragglers() -> None:
    core = make(**STRAGGLE)
    reports(core, {0: 1.0, 1: 1.0})
    run(core, T0, exited(0, 0))
    assert all(reports(core, {2: 5.0}) == [] for _ in range(5))


def test_an_unjudged_report_restarts_the_count() -> None:
    core = make(**STRAGGLE)
    reports(core, {0: 1.0, 1: 1.0})
    reports(core, {2: 5.0})
    reports(core, {2: 5.0})
    run(core, T0, RankStartSeen("j", 1, "n1", 3))  # rank 1 has no step time now: 2 reporting
    assert reports(core, {2: 5.0}) == []
    reports(core, {1: 1.0})
    assert reports(core, {2: 5.0}) == reports(core, {2: 5.0}) == []
    assert len(faults(reports(core, {2: 5.0}))) == 1


# --- lost nodes ----------------------------------------------------------------------------


def test_a_node_never_heard_from_is_not_judged() -> None:
    core = make()
    assert core.next_deadline() is None
    assert tick(core, T0 + 1000) == []


@pytest.mark.parametrize("timeout", [0.5, 3.0, 10.0])
def test_node_lost_just_after_its_timeout(timeout: float) -> None:
    core = make(node_timeout_s=timeout)
    run(core, T0, JobWatched("k", ("n1", "n0"), 2.0), HeartbeatSeen("n0"))
    run(core, T0, exited(1, 0))  # j's rank 1 on n1: not n0, and done anyway
    run(core, T0, RankExitSeen("k", 0, "n1", 0, None, "exited"))
    assert core.next_deadline() == T0 + timeout
    assert tick(core, T0 + timeout) == []
    decisions = tick(core, after(T0 + timeout))
    assert decisions[0] == MarkNodeLost("n0", f"no heartbeat for more than {timeout:g} s")
    assert faults(decisions) == [(LOST, "j", 0, "n0"), (LOST, "k", 1, "n0")]
    assert tick(core, T0 + 1000) == []
    assert core.next_deadline() is None


def test_node_lost_covers_ranks_placed_there_and_not_exited() -> None:
    core = make(("n0", "n0", "n1", "n0"))
    run(core, T0, HeartbeatSeen("n0"), HeartbeatSeen("n1"))
    run(core, T0, exited(0, 0, node="n0"), exited(3, 1, node="n0"),
        RankStartSeen("j", 1, "n1", 5))  # rank 1 moved to n1
    run(core, T0 + 2, HeartbeatSeen("n1"))
    decisions = tick(core, T0 + 4)
    assert names(decisions) == ["MarkNodeLost"] + ["RaiseFault"] * len(faults(decisions))
    assert faults(decisions) == []  # ranks 0 and 3 exited, rank 1 is on n1, rank 2 on n1
    run(core, T0 + 4, RankStartSeen("j", 0, "n1", 6))
    assert faults(tick(core, T0 + 6)) == [(LOST, "j", 0, "n1"), (LOST, "j", 1, "n1"),
                                          (LOST, "j", 2, "n1")]


@pytest.mark.parametrize("gap", [0.1, 1.5, 2.999, 3.0])
def test_no_false_positive_when_heartbeats_are_late_but_within_the_timeout(gap: float) -> None:
    core = make(node_timeout_s=3.0)
    now = T0
    run(core, now, HeartbeatSeen("n0"))
    for _ in range(20):
        assert tick(core, now + gap) == []
        now += gap
        assert run(core, now, HeartbeatSeen("n0")) == []
    assert not core.nodes["n0"].lost


def test_a_heartbeat_after_the_timeout_is_a_loss_even_without_a_tick() -> None:
    core = make(("n0",))
    run(core, T0, HeartbeatSeen("n0"))
    decisions = run(core, T0 + 3.5, HeartbeatSeen("n0"))
    assert names(decisions) == ["MarkNodeLost", "RaiseFault", "MarkNodeAlive"]
    assert decisions[-1] == MarkNodeAlive("n0", "heartbeats resumed after 3.5 s of silence")


def test_lost_node_comes_back_alive_without_new_faults() -> None:
    core = make(hang=5.0)
    run(core, T0, HeartbeatSeen("n1"), progress(1))
    assert len(faults(tick(core, T0 + 3.5))) == 1
    assert run(core, T0 + 10, HeartbeatSeen("n1")) == [
        MarkNodeAlive("n1", "heartbeats resumed after 10.0 s of silence")]
    assert core.next_deadline() == T0 + 13
    assert tick(core, T0 + 12.9) == []
    assert run(core, T0 + 12.9, HeartbeatSeen("n1")) == []


def test_no_hang_on_a_lost_node_and_a_full_timeout_after_it_returns() -> None:
    core = make(hang=2.0)
    run(core, T0, HeartbeatSeen("n1"), progress(1), progress(0))
    decisions = tick(core, T0 + 2.5)  # rank 0 hangs; n1's rank 1 too
    assert faults(decisions) == [(HANG, "j", 0, "n0"), (HANG, "j", 1, "n1")]
    run(core, T0 + 2.75, progress(1))
    decisions = tick(core, T0 + 3.5)  # n1 lost: its rank is covered
    assert faults(decisions) == [(LOST, "j", 1, "n1")]
    run(core, T0 + 4, progress(1))  # the rank runs while its agent is gone
    assert tick(core, T0 + 20) == []
    run(core, T0 + 20, HeartbeatSeen("n1"))
    assert core.next_deadline() == T0 + 22  # hang clock restarts at the node's return
    assert faults(tick(core, after(T0 + 22))) == [(HANG, "j", 1, "n1")]


def test_a_rank_covered_by_node_lost_is_rearmed_only_by_progress() -> None:
    core = make(hang=5.5)
    run(core, T0, HeartbeatSeen("n1"), progress(1))
    assert faults(tick(core, T0 + 3.5)) == [(LOST, "j", 1, "n1")]  # before its hang deadline
    run(core, T0 + 4, HeartbeatSeen("n1"))
    run(core, T0 + 6, HeartbeatSeen("n1"))
    run(core, T0 + 8.5, HeartbeatSeen("n1"))
    assert core.next_deadline() == T0 + 11.5  # only the node: the rank's silence is covered
    assert tick(core, T0 + 11) == []
    run(core, T0 + 11, progress(1), HeartbeatSeen("n1"))
    assert core.next_deadline() == T0 + 14
    run(core, T0 + 13.75, HeartbeatSeen("n1"))
    assert faults(tick(core, T0 + 16.75)) == [(HANG, "j", 1, "n1")]


def test_equal_deadlines_lose_the_node_first() -> None:
    core = make(("n0",), hang=3.0)
    run(core, T0, progress(0), HeartbeatSeen("n0"))
    assert faults(tick(core, T0 + 4)) == [(LOST, "j", 0, "n0")]


def test_node_lost_without_ranks_still_counts_for_cordon() -> None:
    core = make((), cordon_faults=2)
    run(core, T0, HeartbeatSeen("n5"))
    assert names(tick(core, T0 + 4)) == ["MarkNodeLost"]
    run(core, T0 + 5, HeartbeatSeen("n5"))
    assert names(tick(core, T0 + 9)) == ["MarkNodeLost"]
    # Lost just after T0 + 8: the evidence is judged a spread later.
    assert tick(core, T0 + 8 + SPREAD) == []
    assert names(tick(core, after(T0 + 8 + SPREAD))) == ["CordonNode"]


# --- cordon --------------------------------------------------------------------------------


def crash_on(core: HealthCore, node: str, at: float) -> list[Decision]:
    """A one-rank job on ``node`` killed at ``at``; returns the decisions until its charge
    to the node is judged."""
    job = f"c{at}"
    run(core, at, JobWatched(job, (node,), 2.0))
    return [*run(core, at, RankExitSeen(job, 0, node, None, "SIGKILL", "exited")),
            *tick(core, after(at + SPREAD))]


def test_cordon_at_the_threshold_once() -> None:
    core = make((), cordon_faults=3, cordon_window_s=300.0)
    assert names(crash_on(core, "n0", T0)) == ["RaiseFault"]
    assert names(crash_on(core, "n0", T0 + 100)) == ["RaiseFault"]
    decisions = crash_on(core, "n0", T0 + 200)
    assert decisions[1] == CordonNode("n0", "3 faults within 300 s (3 crash)")
    assert names(crash_on(core, "n0", T0 + 210)) == ["RaiseFault"]
    assert core.nodes["n0"].cordoned


@pytest.mark.parametrize(("third", "cordoned"), [
    (T0 + 300.0, True),  # the first fault is exactly a window old: still inside
    (after(T0 + 300.0), False),
])
def test_cordon_window_edge(third: float, cordoned: bool) -> None:
    core = make((), cordon_faults=3, cordon_window_s=300.0)
    crash_on(core, "n0", T0)
    crash_on(core, "n0", T0 + 150)
    assert ("CordonNode" in names(crash_on(core, "n0", third))) is cordoned


def test_faults_on_other_nodes_do_not_add_up() -> None:
    core = make((), cordon_faults=2)
    for i, node in enumerate(["n0", "n1", "n2", "n3"]):
        assert names(crash_on(core, node, T0 + 10 * i)) == ["RaiseFault"]


def test_every_kind_counts_and_a_node_loss_counts_once() -> None:
    core = make(("n0", "n0", "n0", "n1"), hang=10.0, cordon_faults=3, straggler_steps=1,
                straggler_min_ranks=2)
    run(core, T0, HeartbeatSeen("n0"), progress(3, 1.0), progress(1, 1.0), progress(2, 1.0))
    assert faults(run(core, T0, progress(0, 9.0))) == [(STRAGGLER, "j", 0, "n0")]
    decisions = tick(core, T0 + 3.5)
    assert faults(decisions) == [(LOST, "j", 0, "n0"), (LOST, "j", 1, "n0"),
                                 (LOST, "j", 2, "n0")]
    # Rank 3 on n1 hangs eight seconds after the loss: not the same moment, n1's own.
    assert faults(tick(core, T0 + 11)) == [(HANG, "j", 3, "n1")]
    assert "CordonNode" not in names(tick(core, T0 + 11 + SPREAD))
    run(core, T0 + 18, HeartbeatSeen("n0"), progress(0))
    run(core, T0 + 18, exited(1, None, node="n0", signal="SIGKILL"))
    run(core, T0 + 21, HeartbeatSeen("n0"))
    assert tick(core, T0 + 18 + SPREAD) == []
    assert tick(core, after(T0 + 18 + SPREAD)) == [CordonNode(
        "n0", "3 faults within 300 s (1 crash, 1 node_lost, 1 straggler)")]


def test_timeouts_are_charged_when_they_happened_not_when_ticked() -> None:
    core = make(("n0",), hang=2.0, cordon_faults=2, cordon_window_s=10.0)
    run(core, T0, progress(0))
    tick(core, T0 + 11)  # the hang happened just after T0 + 2, judged a spread later
    assert [t for t, _ in core.nodes["n0"].faults] == [T0 + 2]
    assert names(crash_on(core, "n0", T0 + 12.5)) == ["RaiseFault"]  # 10.5 s apart


def test_uncordon_forgets_the_faults() -> None:
    core = make((), cordon_faults=2)
    crash_on(core, "n0", T0)
    assert names(crash_on(core, "n0", T0 + 10)) == ["RaiseFault", "CordonNode"]
    assert run(core, T0 + 20, NodeUncordoned("n0")) == []
    assert not core.nodes["n0"].cordoned
    assert names(crash_on(core, "n0", T0 + 30)) == ["RaiseFault"]
    assert names(crash_on(core, "n0", T0 + 40)) == ["RaiseFault", "CordonNode"]


def test_uncordon_forgets_charges_not_yet_judged() -> None:
    core = make(("n0",), cordon_faults=1)
    run(core, T0, exited(0, None, node="n0", signal="SIGKILL"))
    run(core, T0 + 1, NodeUncordoned("n0"))
    assert tick(core, T0 + 100) == []
    assert not core.nodes["n0"].faults


def kill_all(core: HealthCore, at: float, ranks: int = 4, job: str = "j") -> list[Decision]:
    """Every rank of ``job`` SIGKILLed from outside at ``at`` (their exits a moment apart);
    each slot then started again."""
    decisions: list[Decision] = []
    for rank in range(ranks):
        node = core.jobs[job].ranks[rank].node_id
        decisions += run(core, at + rank * 0.01,
                         RankExitSeen(job, rank, node, None, "SIGKILL", "exited"))
    for rank in range(ranks):
        node = core.jobs[job].ranks[rank].node_id
        run(core, at + 1, RankStartSeen(job, rank, node, 100 + rank))
    return decisions


def test_a_job_killed_whole_twice_cordons_no_node() -> None:
    """Issue 24: a 4-rank job on two nodes, every rank SIGKILLed at once and again 15 s
    later, cordoned both nodes ("3 faults within 300 s (3 crash)")."""
    core = make(("n1", "n1", "n2", "n2"), hang=100.0, cordon_faults=3)
    assert faults(kill_all(core, T0)) == [(CRASH, "j", r, n) for r, n in
                                          enumerate(("n1", "n1", "n2", "n2"))]
    run(core, T0 + 5, progress(0, step=10))
    kill_all(core, T0 + 15)
    assert not any(isinstance(d, CordonNode) for d in tick(core, T0 + 100))
    assert not core.nodes["n1"].faults and not core.nodes["n2"].faults
    assert core.jobs["j"].budget.restarts == 8  # and the job goes on (see the restart tests)


def test_ranks_stopped_as_their_agent_shuts_down_are_faults_but_no_evidence() -> None:
    """A one-node job through a cluster restart (`phalanx down`): every rank is reported
    lost with its agent, which faults them (the job still wants them) and charges no node
    however many there are."""
    core = make(("n1", "n1", "n1", "n1"), hang=100.0, cordon_faults=3)
    decisions = run(core, T0, *(RankExitSeen("j", r, "n1", None, "SIGTERM", "lost",
                                           with_agent=True) for r in range(4)))
    assert faults(decisions) == [(CRASH, "j", r, "n1") for r in range(4)]
    assert not any(isinstance(d, CordonNode) for d in tick(core, T0 + 100))
    assert "n1" not in core.nodes or not core.nodes["n1"].faults


def test_repeated_faults_on_one_node_while_the_others_are_fine_cordon_it() -> None:
    core = make(("n1", "n1", "n2", "n2"), hang=100.0, cordon_faults=3)
    for i, at in enumerate((T0, T0 + 20, T0 + 40)):
        run(core, at, RankExitSeen("j", 0, "n1", None, "SIGKILL", "exited"),
            RankStartSeen("j", 0, "n1", 200 + i))
        run(core, at + 1, progress(0, step=i + 1), progress(2, step=i + 1))
    assert tick(core, after(T0 + 40 + SPREAD)) == [CordonNode(
        "n1", "3 faults within 300 s (3 crash)")]
    assert "n2" not in core.nodes


@pytest.mark.parametrize(("other_at", "evidence"), [
    (T0 + SPREAD, False),  # the other node's fault at the very edge of the spread: the job's
    (after(T0 + SPREAD), True),  # just past it: two faults of their own
])
def test_the_spread_edge(other_at: float, evidence: bool) -> None:
    core = make(("n1", "n2"), cordon_faults=1)
    run(core, T0, exited(0, None, node="n1", signal="SIGKILL"))
    decisions = run(core, other_at, exited(1, None, node="n2", signal="SIGKILL"))
    decisions += tick(core, T0 + 100)
    assert [d.node_id for d in decisions if isinstance(d, CordonNode)] == (
        ["n1", "n2"] if evidence else [])


def test_a_fault_on_a_minority_of_a_jobs_nodes_is_each_nodes_own() -> None:
    """Two of five nodes at once is not most of the job: both are charged."""
    core = make(("n0", "n1", "n2", "n3", "n4"), cordon_faults=1)
    run(core, T0, exited(0, None, node="n0", signal="SIGKILL"),
        exited(1, None, node="n1", signal="SIGKILL"))
    assert [d.node_id for d in tick(core, T0 + 100)] == ["n0", "n1"]


def test_a_node_loss_is_evidence_even_when_the_jobs_other_nodes_fault_too() -> None:
    core = make(("n0", "n1"), hang=100.0, cordon_faults=1)
    run(core, T0, HeartbeatSeen("n0"), HeartbeatSeen("n1"))
    run(core, T0 + 2.9, HeartbeatSeen("n1"))
    assert faults(tick(core, T0 + 3.5)) == [(LOST, "j", 0, "n0")]
    run(core, T0 + 3.5, exited(1, None, node="n1", signal="SIGKILL"))
    assert [d.node_id for d in tick(core, T0 + 9) if isinstance(d, CordonNode)] == ["n0"]
    # n1's crash came with n0's loss: the job's. (n1's own loss later is its own.)
    tick(core, T0 + 100)
    assert [k for _, k in core.nodes["n1"].faults] == [LOST]


def test_uncordon_of_an_unknown_node_is_harmless() -> None:
    core = make()
    assert run(core, T0, NodeUncordoned("nx")) == []
    assert "nx" not in core.nodes


# --- next deadline -------------------------------------------------------------------------


def test_next_deadline_is_the_earliest_judged_timeout() -> None:
    core = make(hang=1.5, node_timeout_s=3.0)
    assert core.next_deadline() is None
    run(core, T0, HeartbeatSeen("n0"))
    assert core.next_deadline() == T0 + 3
    run(core, T0 + 1, progress(1))
    assert core.next_deadline() == T0 + 2.5
    run(core, T0 + 2, progress(1))
    assert core.next_deadline() == T0 + 3
    run(core, T0 + 2.5, HeartbeatSeen("n0"))
    assert core.next_deadline() == T0 + 3.5
    run(core, T0 + 3, exited(1, 0))
    assert core.next_deadline() == T0 + 5.5
    tick(core, T0 + 6)  # n0 lost just after T0 + 3.5: its charge is judged a spread later
    assert core.next_deadline() == T0 + 5.5 + SPREAD
    tick(core, T0 + 100)
    assert core.next_deadline() is None


@pytest.mark.parametrize("events", [
    [HeartbeatSeen("n0")],
    [progress(2)],
    [HeartbeatSeen("n1"), progress(1)],
    [progress(0), HeartbeatSeen("n2"), progress(1)],
])
def test_tick_at_the_next_deadline_decides_nothing_and_just_after_decides(
        events: list[Event]) -> None:
    core = make(hang=3.0)
    run(core, T0, *events)
    deadline = core.next_deadline()
    assert deadline is not None
    assert tick(core, deadline - 1) == []
    assert tick(core, deadline) == []
    assert core.next_deadline() == deadline
    assert tick(core, after(deadline)) != []


# --- blindness, replicas, restarts ------------------------------------------------------------


def test_silence_while_the_detector_was_blind_proves_nothing() -> None:
    core = make(("n0",), hang=2.0, node_timeout_s=3.0)
    run(core, T0, HeartbeatSeen("n0"), ProgressReported("j", 0, 1, 0.5))
    # Disconnected from T0 to T0 + 10: the timeouts fell due meanwhile, but are not judged.
    assert run(core, T0 + 10, WatchResumed()) == []
    assert tick(core, T0 + 11.9) == []
    [fault] = tick(core, after(T0 + 12))  # a full hang timeout from the resumption
    assert (fault.kind, fault.rank) == (HANG, 0)
    assert "after step 1" in fault.detail
    lost = tick(core, after(T0 + 13))  # and a full node timeout
    assert [type(d) for d in lost] == [MarkNodeLost, RaiseFault]


def test_a_node_a_rank_runs_on_is_judged_from_a_takeover_though_never_heard() -> None:
    """A node that died just before a takeover: the new leader never hears it. Its ranks,
    still starting up (not judged for hangs), were never faulted, and the job waited on
    them for good."""
    old = make(("n0", "n1", "n1"), hang=60.0, node_timeout_s=3.0)
    run(old, T0, RankExitSeen("j", 2, "n1", 0, None, "exited"))  # done: judged for nothing
    core = make((), node_timeout_s=3.0)
    assert core.restore(snapshot(old.jobs["j"]), T0 + 5) == "j"
    run(core, T0 + 5, HeartbeatSeen("n7"))  # a node no job runs on
    assert run(core, T0 + 5, WatchResumed()) == []
    for t in (6.0, 7.0, 8.0):
        assert run(core, T0 + t, HeartbeatSeen("n0"), HeartbeatSeen("n7")) == []
    assert tick(core, T0 + 8) == []
    decisions = tick(core, after(T0 + 8))  # a full node timeout from the takeover
    assert decisions[0] == MarkNodeLost("n1", "no heartbeat for more than 3 s")
    assert faults(decisions) == [(LOST, "j", 1, "n1")]
    # Heard at last: alive again, the silence counted from the takeover.
    assert run(core, T0 + 10, HeartbeatSeen("n1")) == [
        MarkNodeAlive("n1", "heartbeats resumed after 5.0 s of silence")]


def test_a_node_no_running_rank_is_on_is_not_judged_unheard_after_a_takeover() -> None:
    core = make(("n0", "n1"), hang=60.0, node_timeout_s=3.0)
    run(core, T0, RankExitSeen("j", 1, "n1", 1, None, "exited"))  # a crash: n1 runs nothing
    assert run(core, T0 + 1, WatchResumed()) == []
    run(core, T0 + 2, HeartbeatSeen("n0"))
    assert "n1" not in core.nodes or core.nodes["n1"].heard is None
    assert [d for d in tick(core, T0 + 100) if isinstance(d, MarkNodeLost)] == [
        MarkNodeLost("n0", "no heartbeat for more than 3 s")]


def test_every_node_silent_at_once_loses_none_and_hangs_none() -> None:
    """The 12,000-job burst on a loaded machine starved the heartbeats of every node at
    once: each node, judged on its own, was lost with every job on it. A silence of every
    node is held: nothing is judged until one is heard, then all get a full timeout."""
    core = make(("n0", "n1"), hang=5.0, node_timeout_s=3.0)
    run(core, T0, HeartbeatSeen("n0"), progress(0), progress(1))
    run(core, T0 + 0.4, HeartbeatSeen("n1"))
    [held] = tick(core, after(T0 + 3))  # n0 times out; n1 not heard for 2.6 s either
    assert isinstance(held, JudgementHeld) and held.held and "n0, n1" in held.reason
    assert core.next_deadline() is None  # only an event ends it
    assert tick(core, T0 + 60) == []  # no node lost, no rank hung, however long
    ended = run(core, T0 + 60, HeartbeatSeen("n1"))
    assert [type(d) for d in ended] == [JudgementHeld] and not ended[0].held
    run(core, T0 + 60.5, HeartbeatSeen("n0"), progress(0))
    run(core, T0 + 62, HeartbeatSeen("n0"), HeartbeatSeen("n1"))
    run(core, T0 + 64.5, HeartbeatSeen("n0"), HeartbeatSeen("n1"))
    assert tick(core, T0 + 65) == []
    # Heard again, every node and rank is judged as before: rank 1 never reported again.
    [hang] = tick(core, after(T0 + 65))
    assert (hang.kind, hang.rank) == (HANG, 1)


def test_a_hang_timeout_shorter_than_the_node_timeout_is_held_in_a_mass_silence() -> None:
    core = make(("n0", "n1"), hang=2.0, node_timeout_s=3.0)  # the defaults
    run(core, T0, HeartbeatSeen("n0"), HeartbeatSeen("n1"), progress(0), progress(1))
    [held] = tick(core, after(T0 + 2))  # the reports stopped with the heartbeats
    assert isinstance(held, JudgementHeld) and held.held
    assert tick(core, T0 + 30) == []
    assert [type(d) for d in run(core, T0 + 30, HeartbeatSeen("n0"))] == [JudgementHeld]
    # Ranks that stop while their nodes are heard hang as before.
    run(core, T0 + 31, HeartbeatSeen("n0"), HeartbeatSeen("n1"))
    hangs = [d for d in tick(core, after(T0 + 32)) if isinstance(d, RaiseFault)]
    assert sorted((d.kind, d.rank) for d in hangs) == [(HANG, 0), (HANG, 1)]


def test_after_a_mass_silence_a_node_that_stays_silent_is_lost_a_timeout_later() -> None:
    core = make(("n0", "n1", "n2"), hang=100.0, node_timeout_s=2.0)
    run(core, T0, *(HeartbeatSeen(n) for n in ("n0", "n1", "n2")))
    assert [type(d) for d in tick(core, T0 + 10)] == [JudgementHeld]
    run(core, T0 + 10, HeartbeatSeen("n0"))  # the silence ends; n1 and n2 get 2 s
    run(core, T0 + 11, HeartbeatSeen("n1"), HeartbeatSeen("n0"))
    assert tick(core, T0 + 12) == []
    lost = tick(core, after(T0 + 12))  # n0 heard 1 s before: n2's silence is its own
    assert [(type(d), getattr(d, "node_id", None)) for d in lost] == [
        (MarkNodeLost, "n2"), (RaiseFault, "n2")]


def test_a_dead_node_is_lost_though_its_survivor_is_late_at_each_of_its_deadlines() -> None:
    """On a loaded machine the one other node's heartbeats came late just as the dead
    node's timeout ran out, again and again: with a full timeout for every node after
    each held silence, the dead node was never judged lost. Only the span no node was
    heard in is held against none."""
    core = make(("n0", "n1"), hang=100.0, node_timeout_s=3.0)
    run(core, T0, HeartbeatSeen("n0"), HeartbeatSeen("n1"))  # n0 dies after this
    lost: list[Decision] = []
    at = T0
    for _ in range(5):  # n1 heard 1.4 s after, then 1.6 s unheard at n0's deadline
        run(core, at + 1.4, HeartbeatSeen("n1"))
        deadline = core.next_deadline()
        assert deadline is not None
        lost += tick(core, after(deadline))
        if any(isinstance(d, MarkNodeLost) for d in lost):
            break
        at = deadline + 0.1
        run(core, at, HeartbeatSeen("n1"))  # the silence ends
    assert [(type(d), getattr(d, "node_id", None)) for d in lost
            if not isinstance(d, JudgementHeld)] == [(MarkNodeLost, "n0"), (RaiseFault, "n0")]


def test_a_node_silent_while_the_others_are_heard_is_lost_and_a_lone_node_too() -> None:
    core = make(("n0", "n1"), hang=100.0, node_timeout_s=2.0)
    run(core, T0, HeartbeatSeen("n0"), HeartbeatSeen("n1"))
    run(core, T0 + 1.5, HeartbeatSeen("n1"))  # heard within half a timeout of n0's end
    assert [type(d) for d in tick(core, after(T0 + 2))] == [MarkNodeLost, RaiseFault]
    # n1 is now the only node not lost: its own silence is no mass silence.
    assert [type(d) for d in tick(core, after(T0 + 3.5))] == [MarkNodeLost, RaiseFault]


def test_faults_name_the_replica_last_started_in_the_slot() -> None:
    core = make(("n0", "n1"))
    run(core, T0, RankStartSeen("j", 1, "n1", 11, replica_id="r1-0"),
        RankStartSeen("j", 1, "n1", 12, replica_id="r1-1"))
    # The first incarnation's exit arrives late: not a fault of the second.
    assert run(core, T0 + 1, RankExitSeen("j", 1, "n1", None, "SIGKILL", "exited",
                                        replica_id="r1-0")) == []
    [fault] = run(core, T0 + 2, RankExitSeen("j", 1, "n1", None, "SIGKILL", "exited",
                                           replica_id="r1-1"))
    assert (fault.kind, fault.replica_id) == (CRASH, "r1-1")
    # A rank never started by an agent here takes the replica from its exit.
    [fault] = run(core, T0 + 3, RankExitSeen("j", 0, "n0", 1, None, "exited", replica_id="r0-0"))
    assert fault.replica_id == "r0-0"


def test_a_restored_job_keeps_exits_and_replicas_and_judges_reporting_ranks_afresh() -> None:
    core = make(("n0", "n1", "n2"), hang=2.0)
    run(core, T0, RankStartSeen("j", 2, "n2", 12, replica_id="r2-1"),
        ProgressReported("j", 0, 5, 0.5), ProgressReported("j", 2, 5, 0.5),
        RankExitSeen("j", 1, "n1", 0, None, "exited", replica_id="r1-0"))
    assert core.take_changed() == {"j"}
    other = HealthCore(HealthPolicy())
    assert other.restore(snapshot(core.jobs["j"]), T0 + 100) == "j"
    other.check_invariants()
    assert other.tick(T0 + 102) == []
    # Both reporting ranks are judged from the takeover; rank 1 is done, so not judged.
    hangs = other.tick(after(T0 + 102))
    assert [(d.kind, d.rank, d.replica_id) for d in hangs] == [(HANG, 0, None),
                                                                (HANG, 2, "r2-1")]
    # Rank 1's exit was kept: once the other two exit 0, the job is finished.
    run(other, T0 + 103, RankExitSeen("j", 0, "n0", 0, None, "exited"))
    assert run(other, T0 + 104, RankExitSeen("j", 2, "n2", 0, None, "exited")) == [FinishJob("j")]
    assert other.take_changed() == {"j"} and "j" not in other.jobs
    with pytest.raises(StoredStateError, match="not a health job snapshot"):
        other.restore(b"\x01", T0)


def test_while_blind_no_event_judges_a_timeout() -> None:
    """Events handled between WatchLost and WatchResumed (a report queued before the
    disconnection) never decide a timeout that fell due meanwhile."""
    core = make(("n0",), hang=2.0, node_timeout_s=3.0)
    run(core, T0, HeartbeatSeen("n0"), ProgressReported("j", 0, 1, 0.5))
    assert run(core, T0 + 0.5, WatchLost()) == []
    assert run(core, T0 + 5, ProgressReported("j", 0, 2, 0.5)) == []  # late, but not judged
    assert core.tick(T0 + 9) == []
    assert run(core, T0 + 10, WatchResumed()) == []
    assert tick(core, T0 + 11.9) == []
    assert [d.kind for d in tick(core, after(T0 + 12))] == [HANG]


def test_a_lost_exit_after_the_final_report_is_a_finish_not_a_crash() -> None:
    """An agent restarted while its ranks ran adopts them and cannot see their exit
    status: a rank that had reported its final step finished (seen in the chaos run)."""
    core = make(("n0", "n1"))
    run(core, T0, ProgressReported("j", 0, 9, 0.1, final=True),
        ProgressReported("j", 1, 8, 0.1))
    assert run(core, T0 + 1, RankExitSeen("j", 0, "n0", None, None, "lost")) == []
    # Rank 1's last report was not final, but rank 0's was: the training is over, and
    # whatever ends rank 1 now is no failure (no fault, nothing charged).
    assert run(core, T0 + 1, RankExitSeen("j", 1, "n1", None, None, "lost")) == [FinishJob("j", 9)]


def test_a_crash_after_the_training_completed_is_a_finish() -> None:
    """A script that never closes its session dies at exit (gloo times out once its peers
    are gone): after a final report, a non-zero exit or a signal ends no job as failed."""
    core = make(("n0", "n1"), cordon_faults=1)
    run(core, T0, ProgressReported("j", 0, 9, 0.1, final=True))
    assert run(core, T0 + 1, exited(0, 0)) == []
    assert run(core, T0 + 2, exited(1, None, signal="SIGABRT")) == [FinishJob("j", 9)]
    assert not core.nodes.get("n1") or not core.nodes["n1"].cordoned


# --- admissions ------------------------------------------------------------------------------


def test_an_earlier_admissions_late_exit_is_no_crash_of_the_new_one() -> None:
    """A requeued job admitted again runs r<slot>-0 again: the first admission's exit of
    r0-0, read after the second admission's record, is not the new r0-0's crash."""
    core = HealthCore(HealthPolicy())
    run(core, T0, JobWatched("j", ("n0", "n1"), 2.0, admission=2))
    late = RankExitSeen("j", 0, "n0", None, "SIGKILL", "exited", "r0-0", admission=1)
    assert run(core, T0 + 1, late) == []
    assert run(core, T0 + 1, RankStartSeen("j", 0, "n0", 4242, "r0-0", admission=1)) == []
    [fault] = [d for d in run(core, T0 + 2, RankExitSeen(
        "j", 0, "n0", None, "SIGKILL", "exited", "r0-0", admission=2))
        if isinstance(d, RaiseFault)]
    assert fault.admission == 2  # elasticity tells it from the earlier admission's


def test_a_record_of_another_admission_starts_the_restart_budget_afresh() -> None:
    """Health that never saw the requeue between two admissions does not carry the first
    one's restarts into the second."""
    core = HealthCore(HealthPolicy())
    run(core, T0, JobWatched("j", ("n0", "n1"), 2.0, admission=1))
    run(core, T0 + 1, exited(0, 1))
    assert core.state.jobs["j"].budget.restarts == 1
    run(core, T0 + 2, JobWatched("j", ("n0", "n1"), 2.0, admission=2))
    assert core.state.jobs["j"].budget.restarts == 0 and core.state.jobs["j"].admission == 2


def test_a_restored_watch_keeps_its_admission() -> None:
    core = HealthCore(HealthPolicy())
    run(core, T0, JobWatched("j", ("n0",), 2.0, admission=3))
    other = HealthCore(HealthPolicy())
    other.restore(snapshot(core.jobs["j"]), T0 + 1)
    assert other.jobs["j"].admission == 3
    late = RankExitSeen("j", 0, "n0", None, "SIGKILL", "exited", "r0-0", admission=2)
    assert run(other, T0 + 2, late) == []  # still told from the earlier admission's
