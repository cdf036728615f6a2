"""The crash-loop guard: restarts fail a job only when they repeat without progress.

Issue 24: ten faults in 133 s, the job committing steps between all of them,
ended ``failed`` with ``restart_rate``. These feed the core rank exits, starts
and step reports at explicit times and assert on what it decides.
"""

from __future__ import annotations

from phalanx.schemas.environment import EXIT_DROPPED, EXIT_STATE_LOST
from phalanx.schemas.messages import ReasonCode, RestartPolicy
from phalanx.services.health.core import HealthCore
from phalanx.services.health.events import (
    Decision,
    FailJob,
    JobWatched,
    ProgressReported,
    RaiseFault,
    RankExitSeen,
    RankStartSeen,
)
from phalanx.services.health.model import HealthPolicy
from phalanx.services.health.stored import snapshot

T0 = 1_717_000_000.0
NODES = ("n0", "n0", "n1", "n1")
QUICK = RestartPolicy(max_restarts=3, max_restarts_in_window=2, window_s=300.0)


def watched(policy: RestartPolicy = QUICK, nodes: tuple[str, ...] = NODES) -> HealthCore:
    core = HealthCore(HealthPolicy())
    core.handle(JobWatched("j", nodes, 100.0, restart_policy=policy), T0)
    return core


def kill(core: HealthCore, at: float, *ranks: int) -> list[Decision]:
    """SIGKILL ``ranks`` at ``at``; each is started again a second later."""
    out: list[Decision] = []
    for rank in ranks:
        node = core.jobs["j"].ranks[rank].node_id if "j" in core.jobs else "n0"
        out += core.handle(RankExitSeen("j", rank, node, None, "SIGKILL", "exited"), at)
        core.check_invariants()
    for rank in ranks:
        if "j" in core.jobs:
            core.handle(RankStartSeen("j", rank, core.jobs["j"].ranks[rank].node_id, 1), at + 1)
    return out


def step(core: HealthCore, at: float, step: int) -> None:
    for rank in core.jobs["j"].ranks:
        core.handle(ProgressReported("j", rank, step, 0.1), at)
    core.check_invariants()


def failed(decisions: list[Decision]) -> FailJob | None:
    return next((d for d in decisions if isinstance(d, FailJob)), None)


def test_rapid_infrastructure_faults_with_steps_between_never_fail_the_job() -> None:
    core = watched()
    for i in range(20):  # far more than either limit, a second apart
        at = T0 + 2 * i
        assert failed(kill(core, at, i % 4)) is None
        step(core, at + 1.5, i + 1)
    assert core.jobs["j"].budget.restarts == 20


def test_a_crash_that_recurs_before_any_step_fails_the_job() -> None:
    core = watched()
    assert failed(kill(core, T0, 1)) is None
    assert failed(kill(core, T0 + 10, 1)) is None
    verdict = failed(kill(core, T0 + 20, 1))
    assert verdict is not None and verdict.reason_code is ReasonCode.RESTART_RATE
    assert verdict.reason.endswith("after 2 restart(s) within 300 s without a committed step "
                                   "between them (max_restarts_in_window 2)")
    assert "j" not in core.jobs


def test_a_crash_loop_after_progress_fails_the_same_way() -> None:
    core = watched()
    step(core, T0, 50)
    for i in range(2):
        assert failed(kill(core, T0 + 10 * (i + 1), 3)) is None
        step(core, T0 + 10 * (i + 1) + 5, 50)  # resumed at 50, dies before 51: no progress
    assert failed(kill(core, T0 + 30, 3)) is not None


def test_every_rank_killed_at_once_is_one_restart_round() -> None:
    core = watched()
    assert failed(kill(core, T0, 0, 1, 2, 3)) is None
    assert len(core.jobs["j"].budget.stalled) == 1
    step(core, T0 + 5, 7)
    assert failed(kill(core, T0 + 15, 0, 1, 2, 3)) is None  # issue 24 item 4, twice
    assert len(core.jobs["j"].budget.stalled) == 1
    # The replacements all die before a step: a second round, then a third fails it.
    assert failed(kill(core, T0 + 25, 0, 1, 2, 3)) is None
    verdict = failed(kill(core, T0 + 35, 0, 1, 2, 3))
    assert verdict is not None and verdict.reason_code is ReasonCode.RESTART_RATE


def test_a_slow_crash_loop_is_bounded_by_max_restarts() -> None:
    core = watched(RestartPolicy(max_restarts=3, max_restarts_in_window=2, window_s=10.0))
    for i in range(3):
        assert failed(kill(core, T0 + 100 * i, 2)) is None
    verdict = failed(kill(core, T0 + 300, 2))
    assert verdict is not None and verdict.reason_code is ReasonCode.RESTARTS_EXHAUSTED
    assert "after 3 restart(s) without a committed step between them (max_restarts 3)" \
        in verdict.reason


def test_a_survivor_failing_during_the_recovery_is_the_same_incident() -> None:
    """Ranks that were running when the round began did not restart: their failure is
    no repeat (a node's second rank, a peer killed a moment later)."""
    core = watched()
    assert failed(kill(core, T0, 0)) is None
    assert failed(kill(core, T0 + 0.5, 2)) is None  # started before the round: same round
    assert len(core.jobs["j"].budget.stalled) == 1


def test_application_failures_keep_their_own_limit() -> None:
    core = watched(RestartPolicy(max_app_failures=1, max_restarts_in_window=5))
    out = core.handle(RankExitSeen("j", 0, "n0", 1, None, "exited"), T0)
    assert [d.application for d in out if isinstance(d, RaiseFault)] == [True]
    step(core, T0 + 5, 3)  # progress does not forgive the script's own failures
    verdict = failed(core.handle(RankExitSeen("j", 1, "n0", 1, None, "exited"), T0 + 10))
    assert verdict is not None and verdict.reason_code is ReasonCode.APP_FAILED


def test_a_survivors_error_in_the_same_incident_is_not_its_code_failing_again() -> None:
    """A torchrun script's all-reduce fails when its peer is killed: that exit is the
    kill's collateral while the gang restarts, not an application failure; the same
    error from a rank started since is."""
    core = watched(RestartPolicy(max_app_failures=0, max_restarts_in_window=5))
    assert failed(kill(core, T0, 1)) is None
    out = core.handle(RankExitSeen("j", 0, "n0", 1, None, "exited"), T0 + 0.5)
    assert failed(out) is None and core.jobs["j"].budget.app_failures == 0
    core.handle(RankStartSeen("j", 0, "n0", 1), T0 + 1)
    verdict = failed(core.handle(RankExitSeen("j", 0, "n0", 1, None, "exited"), T0 + 2))
    assert verdict is not None and verdict.reason_code is ReasonCode.APP_FAILED


def test_replacements_that_cannot_start_fail_the_job_though_they_never_started() -> None:
    """A command that cannot start never reports a start: each launch failure, the
    placement's or a replacement's, is the script failing by itself in the round now
    running, never an earlier round's collateral nor a late exit to ignore."""
    core = watched(RestartPolicy(max_app_failures=2, max_restarts_in_window=5))
    first = core.handle(RankExitSeen("j", 0, "n0", None, None, "launch_failed", "r0-0"), T0)
    assert failed(first) is None and any(isinstance(d, RaiseFault) for d in first)
    # The gang is restarted whole: r0-1 cannot start either, nor can r1-1.
    assert failed(core.handle(
        RankExitSeen("j", 0, "n0", None, None, "launch_failed", "r0-1"), T0 + 1)) is None
    verdict = failed(core.handle(
        RankExitSeen("j", 1, "n0", None, None, "launch_failed", "r1-1"), T0 + 1.1))
    assert verdict is not None and verdict.reason_code is ReasonCode.LAUNCH_FAILED
    assert "application failure 3" in verdict.reason


def test_a_state_lost_exit_is_retried_under_the_restart_budget_not_the_scripts() -> None:
    """Every member of a sharded job exits EXIT_STATE_LOST: no complete step was within
    reach (a lost node's memory, its agent down for seconds). Those are restarts to
    retry, judged by progress, not application failures that end the job at once."""
    core = watched(RestartPolicy(max_app_failures=1, max_restarts_in_window=3))
    out: list[Decision] = []
    for rank in range(4):
        out += core.handle(RankExitSeen("j", rank, NODES[rank], EXIT_STATE_LOST, None,
                                        "exited"), T0)
    assert failed(out) is None
    assert [d.application for d in out if isinstance(d, RaiseFault)] == [False] * 4
    # Retried and still lost, round after round without a step: the crash-loop guard.
    verdicts = []
    for round_ in range(1, 4):
        for rank in range(4):
            core.handle(RankStartSeen("j", rank, NODES[rank], 10 + round_), T0 + 10 * round_)
        verdicts += [failed(core.handle(RankExitSeen("j", 0, "n0", EXIT_STATE_LOST, None,
                                                     "exited"), T0 + 10 * round_ + 5))]
    verdict = next(v for v in verdicts if v is not None)
    assert verdict.reason_code is ReasonCode.RESTART_RATE, verdict


def test_ranks_fenced_out_of_their_job_are_no_application_failure() -> None:
    """A node cut off from the bus: its ranks find the job moved past them and exit
    EXIT_DROPPED, 0.6 s apart. The second exit was counted as the script's own failure
    and ended a job with max_app_failures 1 (issue 53): the job's doing, not the script's."""
    core = watched(RestartPolicy(max_app_failures=1, max_restarts_in_window=3))
    out: list[Decision] = []
    for at, rank in ((T0, 0), (T0 + 0.6, 1)):
        out += core.handle(RankExitSeen("j", rank, NODES[rank], EXIT_DROPPED, None,
                                        "exited"), at)
    assert failed(out) is None
    assert [d.application for d in out if isinstance(d, RaiseFault)] == [False, False]
    # Control: the same two exits with the script's own status 1 are the application's.
    core = watched(RestartPolicy(max_app_failures=1, max_restarts_in_window=3))
    out = []
    for at, rank in ((T0, 0), (T0 + 0.6, 1)):
        out += core.handle(RankExitSeen("j", rank, NODES[rank], 1, None, "exited"), at)
    assert [d.application for d in out if isinstance(d, RaiseFault)] == [True, True]


def test_a_restored_budget_goes_on_judging_the_same_streak() -> None:
    core = watched()
    step(core, T0, 9)
    kill(core, T0 + 10, 1)
    other = HealthCore(HealthPolicy())
    other.restore(snapshot(core.jobs["j"]), T0 + 12)
    other.check_invariants()
    # The first report a restored core hears says where the job is, not that it advanced
    # (it may have got there before the takeover): the streak goes on.
    other.handle(ProgressReported("j", 0, 12, 0.1), T0 + 13)
    assert failed(kill(other, T0 + 14, 1)) is None
    assert len(other.jobs["j"].budget.stalled) == 2
    # A step past it is progress.
    other.handle(ProgressReported("j", 0, 13, 0.1), T0 + 15)
    assert not other.jobs["j"].budget.stalled
    assert failed(kill(other, T0 + 16, 1)) is None


def test_a_budget_restored_in_a_crash_loop_still_fails_it() -> None:
    core = watched()
    step(core, T0, 9)
    kill(core, T0 + 10, 1)
    kill(core, T0 + 20, 1)
    other = HealthCore(HealthPolicy())
    other.restore(snapshot(core.jobs["j"]), T0 + 21)
    other.handle(ProgressReported("j", 0, 9, 0.1), T0 + 22)  # resumed at 9 again
    verdict = failed(kill(other, T0 + 23, 1))
    assert verdict is not None and verdict.reason_code is ReasonCode.RESTART_RATE


def test_no_progress_reports_means_counted_over_the_admission() -> None:
    """A job without the runtime's session reports no step: every round counts, as
    torchrun counts restarts."""
    core = watched(RestartPolicy(max_restarts=2, max_restarts_in_window=100, window_s=1.0),
                   nodes=("n0",))
    assert failed(kill(core, T0, 0)) is None
    assert failed(kill(core, T0 + 1000, 0)) is None
    verdict = failed(kill(core, T0 + 2000, 0))
    assert verdict is not None and verdict.reason_code is ReasonCode.RESTARTS_EXHAUSTED
