"""When failures end a job: the restart policy's rules. Pure.

Every failure of a rank is either the script's own doing or the
infrastructure's:

* **Application**: the rank exited by itself with a non-zero code (a Python
  exception, ``exit(1)``), or could not be started at all (a missing
  executable, a bad path, no permission). Running the same code again fails
  the same way, so a job survives at most ``max_app_failures`` of them over its
  admission; the next one fails it (``app_failed``, or ``launch_failed`` for a
  start error), with the rank's error as the reason.
* **Infrastructure**: a kill by a signal (the OOM killer's ``SIGKILL``, also
  seen through a shell as exit code 128 + N), a hang, a lost node, a rank
  whose exit status was lost with its agent, a rank its agent killed because
  its GPU failed (cause ``gpu_fault``). These are what the system is
  there to survive: they never fail a job that trains between them.

Every failure that is repaired is a restart (``restarts``, reported; no limit
applies to it). What ends a job is a **crash loop**: restarts that repeat
with no committed step between them. Failures are grouped into *rounds*: the
first failure after the job's step advanced starts a round, and so does the
failure of a rank started since the latest round began (a replacement that
failed again before the job got anywhere); failures of ranks that were
already running when the round began are the same incident (every rank of a
job killed at once, a node's two ranks lost with it) and start none. A rank
reporting a step past the one the job had reached at the latest round is
progress: it ends the streak. A round that would be the ``max_restarts + 1``-th
of a streak fails the job (``restarts_exhausted``), and so does one that would
be the ``max_restarts_in_window + 1``-th within ``window_s`` (``restart_rate``:
a fast loop fails in minutes). A job that never reports a step (no runtime
session) never shows progress, so its restarts count over its whole
admission, as torchrun's ``--max-restarts`` counts restart rounds. Application
failures start rounds by the same rule, and count towards their own limit only
when they start one: a rank already running when the round began that then
exits with an error is the incident's collateral (a torchrun script's
all-reduce failing because its peer died, while its gang is restarted
whole), not its code failing again. The round's replacements failing again
count; so does any failure once the job has stepped on, and every command that
cannot start (it never reported a start, so it counts as started in the round
now running).

Why not a count per window, as before: ten faults in 133 s on three nodes,
the job committing steps between all of them, failed it with ``restart_rate``
(issue 24), and on 1,000 nodes eight failures in five minutes is an ordinary
afternoon. Why rounds, not failures: a job of 16 ranks killed at once (a
power cut, someone's ``pkill``) is one incident, however many ranks it took.

A :class:`RestartBudget` lives as long as health watches the job's admission
(a new placement keeps it; a requeue starts a new one) and is part of the
health snapshot, so a restarted health service goes on counting. The job's
step is stored only as it was when the latest round began: a restored budget
takes the first report it hears as where the job is, not as progress, so a
crash loop is never forgiven by a takeover (a job that did advance meanwhile
ends its streak at its next step).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import signal as signals

from phalanx.schemas.environment import EXIT_DROPPED, EXIT_STATE_LOST
from phalanx.schemas.messages import ReasonCode, RestartPolicy


class Failure(enum.StrEnum):
    """Whose doing a rank's failure is."""

    APPLICATION = "application"  # the script exited non-zero by itself
    LAUNCH = "launch"  # the command could not be started (an application failure too)
    INFRASTRUCTURE = "infrastructure"  # a signal, a hang, a lost node, a lost status,
    # or the runtime's own word that the job's state is out of reach (EXIT_STATE_LOST)
    # or that the job fenced the rank out (EXIT_DROPPED)

    @property
    def application(self) -> bool:
        return self is not Failure.INFRASTRUCTURE


def classify_exit(cause: str, exit_code: int | None, signal: str | None) -> Failure:
    """The class of a rank's failed exit (cause ``exited``, ``lost``, ``launch_failed`` or
    ``oom``). A rank the OOM killer ended passed its job's ``memory_per_rank``: the
    application's failure, as running it again the same way may fail the same way."""
    if cause == "launch_failed":
        return Failure.LAUNCH
    if cause == "oom":
        return Failure.APPLICATION
    if cause != "exited" or signal is not None or exit_code is None:
        return Failure.INFRASTRUCTURE
    if _killed_through_shell(exit_code) or exit_code in (EXIT_STATE_LOST, EXIT_DROPPED):
        return Failure.INFRASTRUCTURE
    return Failure.APPLICATION


def _killed_through_shell(exit_code: int) -> bool:
    """A shell reports a child killed by signal N as exit code 128 + N (137: SIGKILL)."""
    try:
        signals.Signals(exit_code - 128)
    except ValueError:
        return False
    return exit_code > 128


@dataclasses.dataclass(frozen=True)
class BudgetSpent:
    """The failure just charged ends the job."""

    reason_code: ReasonCode
    reason: str


@dataclasses.dataclass
class RestartBudget:
    """What a job has spent of its :class:`RestartPolicy`."""

    policy: RestartPolicy
    restarts: int = 0  # failures repaired over the admission (reported, not limited)
    app_failures: int = 0
    stalled: collections.deque[float] = dataclasses.field(
        default_factory=collections.deque)  # rounds since the step last advanced, oldest first
    round: int = 0  # rounds begun over the admission; a rank notes it when it starts
    step: int = 0  # the job's step when the latest round began: a step past it is progress
    # False once restored from a snapshot, until a report says where the job is: the job
    # may have trained on since the stored step, so the first report only teaches it.
    knows_step: bool = True

    def progressed(self, step: int) -> bool:
        """A rank reported ``step`` committed; returns whether the budget changed (a
        streak ended, or a restored budget learnt the job's step)."""
        if not self.knows_step:
            self.knows_step = True
            learnt, self.step = step > self.step, max(self.step, step)
            return learnt
        if step <= self.step or not self.stalled:
            return False
        self.stalled.clear()
        return True

    def charge(self, failure: Failure, at: float, what: str, *, started_in: int,
               step: int) -> BudgetSpent | None:
        """Charge one failure (``what`` says which, for the reason) at time ``at``, of a
        rank started in round ``started_in``, the job being at ``step``.

        Returns None when it is to be repaired (it counted as a restart), else why
        the job fails instead.
        """
        policy = self.policy
        begins = not self.stalled or started_in == self.round
        if failure.application and begins:
            self.app_failures += 1
            if self.app_failures > policy.max_app_failures:
                code = ReasonCode.LAUNCH_FAILED if failure is Failure.LAUNCH \
                    else ReasonCode.APP_FAILED
                return BudgetSpent(code, f"{what} (application failure {self.app_failures}, "
                                       f"max_app_failures {policy.max_app_failures})")
        if begins:
            if len(self.stalled) + 1 > policy.max_restarts:
                return BudgetSpent(ReasonCode.RESTARTS_EXHAUSTED,
                                 f"{what}, after {len(self.stalled)} restart(s) without a "
                                 f"committed step between them (max_restarts "
                                 f"{policy.max_restarts})")
            recent = sum(1 for t in self.stalled if at - t <= policy.window_s)
            if recent + 1 > policy.max_restarts_in_window:
                return BudgetSpent(ReasonCode.RESTART_RATE,
                                 f"{what}, after {recent} restart(s) within "
                                 f"{policy.window_s:g} s without a committed step between "
                                 f"them (max_restarts_in_window "
                                 f"{policy.max_restarts_in_window})")
            self.stalled.append(at)
            self.round += 1
            self.step = max(self.step, step)
        self.restarts += 1
        return None
