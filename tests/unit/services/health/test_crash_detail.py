"""A crash's detail and a failed job's reason carry the failing rank's error: its last
output line on the first line (all a one-line view shows, so that line stands alone),
then its last output."""

from __future__ import annotations

from phalanx.schemas.messages import DETAIL_CHARS, RestartPolicy
from phalanx.services.health.core import HealthCore
from phalanx.services.health.events import (
    FailJob,
    JobWatched,
    RaiseFault,
    RankExitSeen,
)
from phalanx.services.health.model import HealthPolicy

T0 = 1_717_000_000.0
TRACEBACK = ("=== phalanx: r0-0 of j starting on n0 at 2026-11-26T15:44:58+00:00: python t.py\n"
             "Traceback (most recent call last):\n"
             '  File "t.py", line 3, in <module>\n'
             "    raise RuntimeError('loss is nan at step 5')\n"
             "RuntimeError: loss is nan at step 5\n")


def crash(detail: str, max_app_failures: int = 3) -> list:
    core = HealthCore(HealthPolicy())
    core.handle(JobWatched("j", ("n0", "n1"), 2.0,
                           restart_policy=RestartPolicy(max_app_failures=max_app_failures)), T0)
    return core.handle(RankExitSeen("j", 0, "n0", 1, None, "exited", "r0-0", detail), T0 + 1)


def test_the_error_line_leads_and_the_output_follows() -> None:
    [fault] = [d for d in crash(TRACEBACK) if isinstance(d, RaiseFault)]
    first, rest = fault.detail.split("\n", 1)
    assert first == "rank 0 exited with code 1: RuntimeError: loss is nan at step 5"
    assert rest == "its last output:\n" + TRACEBACK.rstrip()


def test_a_failed_jobs_reason_ends_with_the_ranks_error() -> None:
    [failed] = [d for d in crash("/usr/bin/python: can't open file '/x/t.py': [Errno 2] No "
                                 "such file or directory\n", max_app_failures=0)
                if isinstance(d, FailJob)]
    first, *rest = failed.reason.split("\n")
    # The policy's verdict ends the first line, which says it all; the output follows.
    assert first == ("r0-0 on n0: rank 0 exited with code 1: /usr/bin/python: can't open "
                     "file '/x/t.py': [Errno 2] No such file or directory (application "
                     "failure 1, max_app_failures 0)")
    assert rest == ["its last output:", "/usr/bin/python: can't open file '/x/t.py': [Errno 2] "
                    "No such file or directory"]


def test_long_output_is_cut_at_its_start_within_the_detail_limit() -> None:
    output = "x" * 10 + "\n" + "noise\n" * 2000 + TRACEBACK
    [fault] = [d for d in crash(output[-DETAIL_CHARS:]) if isinstance(d, RaiseFault)]
    assert len(fault.detail) <= DETAIL_CHARS
    assert fault.detail.endswith("RuntimeError: loss is nan at step 5")


def test_no_output_says_no_more_than_the_exit() -> None:
    [fault] = [d for d in crash("  \n") if isinstance(d, RaiseFault)]
    assert fault.detail == "rank 0 exited with code 1"


def test_a_signal_kill_quotes_no_line_as_its_error() -> None:
    core = HealthCore(HealthPolicy())
    core.handle(JobWatched("j", ("n0", "n1"), 2.0), T0)
    banner = "=== phalanx: generation 0 (start): r0-0 is rank 0 of 2, resuming after step 0\n"
    [fault] = [d for d in core.handle(RankExitSeen("j", 0, "n0", None, "SIGKILL", "exited",
                                                 "r0-0", banner), T0 + 1)
               if isinstance(d, RaiseFault)]
    assert fault.detail == ("rank 0 was killed by signal SIGKILL\nits last output:\n"
                            + banner.rstrip())


def test_a_rank_stopped_with_its_agent_says_so() -> None:
    core = HealthCore(HealthPolicy())
    core.handle(JobWatched("j", ("n0", "n1"), 2.0), T0)
    [fault] = [d for d in core.handle(RankExitSeen("j", 0, "n0", None, "SIGTERM", "lost",
                                                 "r0-0", with_agent=True), T0 + 1)
               if isinstance(d, RaiseFault)]
    assert fault.detail.startswith("rank 0 was stopped with its agent on n0")


def test_a_gpu_fault_is_an_infrastructure_crash_naming_the_gpu_and_the_fault() -> None:
    """The agent killed the rank because its GPU failed: a fault to repair like a crash
    (never the script's failure, however few application failures the job may have),
    whose first line names the GPU and the fault, the rank's last output after it."""
    core = HealthCore(HealthPolicy())
    core.handle(JobWatched("j", ("n0", "n1"), 2.0,
                           restart_policy=RestartPolicy(max_app_failures=0)), T0)
    decisions = core.handle(RankExitSeen(
        "j", 0, "n0", None, "SIGKILL", "gpu_fault", "r0-0",
        "Xid 79 on GPU 0 (GPU-5d2c)\nstep 41\nstep 42"), T0 + 1)
    assert not [d for d in decisions if isinstance(d, FailJob)]
    [fault] = [d for d in decisions if isinstance(d, RaiseFault)]
    assert not fault.application and fault.signal == "SIGKILL"
    first, rest = fault.detail.split("\n", 1)
    assert first == ("rank 0 was killed by its agent on n0: GPU fault: Xid 79 on GPU 0 "
                     "(GPU-5d2c)")
    assert rest == "its last output:\nstep 41\nstep 42"


def test_an_oom_kill_names_the_oom_killer_and_is_the_jobs_own_failure() -> None:
    """An exit with cause ``oom`` says what killed the rank and charges the job's
    application failures (its memory use, not the node's fault): past
    ``max_app_failures`` it fails the job, saying why."""
    for allowed in (1, 0):
        core = HealthCore(HealthPolicy())
        core.handle(JobWatched("j", ("n0", "n1"), 2.0,
                               restart_policy=RestartPolicy(max_app_failures=allowed)), T0)
        [decision] = [d for d in core.handle(RankExitSeen(
            "j", 1, "n1", None, "SIGKILL", "oom", "r1-0", "step 30\n"), T0 + 1)
            if isinstance(d, RaiseFault | FailJob)]
        text = decision.detail if isinstance(decision, RaiseFault) else decision.reason
        assert isinstance(decision, RaiseFault if allowed else FailJob)
        assert "rank 1 was killed by the OOM killer on n1: its memory passed its job's " \
            "memory_per_rank" in text
