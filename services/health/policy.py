"""When failures end a job: the restart policy's rules. Pure.

Every failure of a rank is either the script's own doing or the
infrastructure's, and only the second kind is worth retrying without limit:

* **Application**: the rank exited by itself with a non-zero code (a Python
  exception, ``exit(1)``), or could not be started at all (a missing
  executable, a bad path, no permission). Running the same code again fails
  the same way, so a job survives at most ``max_app_failures`` of them; the
  next one fails it (``app_failed``, or ``launch_failed`` for a start error),
  with the rank's error as the reason.
* **Infrastructure**: a kill by a signal (the OOM killer's ``SIGKILL``, also
  seen through a shell as exit code 128 + N), a hang, a lost node, a rank
  whose exit status was lost with its agent. These are replaced.

Each failure that is repaired counts as one restart (a replacement of one
replica, as torchrun's ``--max-restarts`` counts restarts): a failure that
would be the ``max_restarts + 1``-th fails the job (``restarts_exhausted``),
and so does one that would be the ``max_restarts_in_window + 1``-th within
``window_s`` (``restart_rate``: a crash loop fails in minutes, not after the
whole budget). Application failures that are retried count as restarts too.

A :class:`RestartBudget` lives as long as health watches the job's admission
(a new placement keeps it; a requeue starts a new one) and is part of the
health snapshot, so a restarted health service goes on counting.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import signal as signals

from phalanx.schemas.messages import ReasonCode, RestartPolicy


class Failure(enum.StrEnum):
    """Whose doing a rank's failure is."""

    APPLICATION = "application"  # the script exited non-zero by itself
    LAUNCH = "launch"  # the command could not be started (an application failure too)
    INFRASTRUCTURE = "infrastructure"  # a signal, a hang, a lost node, a lost status

    @property
    def application(self) -> bool:
        return self is not Failure.INFRASTRUCTURE


def classify_exit(cause: str, exit_code: int | None, signal: str | None) -> Failure:
    """The class of a rank's failed exit (cause ``exited``, ``lost`` or ``launch_failed``)."""
    if cause == "launch_failed":
        return Failure.LAUNCH
    if cause != "exited" or signal is not None or exit_code is None:
        return Failure.INFRASTRUCTURE
    if _killed_through_shell(exit_code):
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
class JobFailed:
    """The failure just charged ends the job."""

    reason_code: ReasonCode
    reason: str


@dataclasses.dataclass
class RestartBudget:
    """What a job has spent of its :class:`RestartPolicy`."""

    policy: RestartPolicy
    restarts: int = 0
    app_failures: int = 0
    recent: collections.deque[float] = dataclasses.field(
        default_factory=collections.deque)  # restart times within the window, oldest first

    def charge(self, failure: Failure, at: float, what: str) -> JobFailed | None:
        """Charge one failure (``what`` says which, for the reason) at time ``at``.

        Returns None when it is to be repaired (it counted as a restart), else why
        the job fails instead.
        """
        policy = self.policy
        if failure.application:
            self.app_failures += 1
            if self.app_failures > policy.max_app_failures:
                code = ReasonCode.LAUNCH_FAILED if failure is Failure.LAUNCH \
                    else ReasonCode.APP_FAILED
                return JobFailed(code, f"{what} (application failure {self.app_failures}, "
                                       f"max_app_failures {policy.max_app_failures})")
        if self.restarts + 1 > policy.max_restarts:
            return JobFailed(ReasonCode.RESTARTS_EXHAUSTED,
                             f"{what}, after {self.restarts} restart(s) "
                             f"(max_restarts {policy.max_restarts})")
        while self.recent and at - self.recent[0] > policy.window_s:
            self.recent.popleft()
        if len(self.recent) + 1 > policy.max_restarts_in_window:
            return JobFailed(ReasonCode.RESTART_RATE,
                             f"{what}, after {len(self.recent)} restart(s) within "
                             f"{policy.window_s:g} s (max_restarts_in_window "
                             f"{policy.max_restarts_in_window})")
        self.restarts += 1
        self.recent.append(at)
        return None
