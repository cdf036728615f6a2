"""Failure detection: which ranks crashed, hung or straggle, which nodes are lost. Pure.

The rules, numbered as the modules cite them (1 crash, 2 finish, 3 hang, 4 straggler,
5 lost node, 6 cordon, 7 blindness, 8 restart policy, 9 progress; departing ranks),
are written out in docs/health.md, "The rules". Time is an argument:
:meth:`HealthCore.handle` and :meth:`HealthCore.tick` take ``now``, and every call first
applies the timeouts due by then, so what is decided does not depend on how often the
shell ticks; :meth:`HealthCore.next_deadline` says when to tick next. No clock, no I/O.

The rules live one concept a module over one model (:class:`~.model.HealthState`):
:mod:`.events` (what comes in and goes out), :mod:`.model` (jobs, ranks, nodes, the
deadline heap, :class:`~.model.HealthPolicy`), :mod:`.lifecycle` (rules 1, 2 and 9,
departing), :mod:`.detect` (rules 3, 4, 5 and 7), :mod:`.cordon` (rule 6),
:mod:`.outcome` (rule 8, and the finish of rule 2), :mod:`.crash` (a crash fault's
text), :mod:`.stored` (what a new leader restores); :class:`HealthCore` is their entry
point.
"""

from __future__ import annotations

from phalanx.schemas.messages import JobProgress
from phalanx.services.health import detect, lifecycle, stored
from phalanx.services.health.events import (
    ChaosInjected,
    CordonNode,
    Decision,
    Event,
    FailJob,
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
from phalanx.services.health.model import HealthPolicy, HealthState, JobHealth, NodeHealth
from phalanx.services.health.stored import snapshot

# The names the core has always offered, wherever they are defined now.
__all__ = [
    "ChaosInjected", "CordonNode", "Decision", "Event", "FailJob", "FinishJob", "HealthCore",
    "HealthPolicy", "HeartbeatSeen", "JobUnwatched", "JobWatched", "JudgementHeld",
    "MarkNodeAlive",
    "MarkNodeLost", "MemberApplied", "NodeUncordoned", "ProgressReported", "RaiseFault",
    "RankExitSeen", "RankStartSeen", "WatchLost", "WatchResumed", "snapshot",
]


class HealthCore:
    """The failure detector. Feed events with :meth:`handle`; call :meth:`tick` when due.

    It holds the model (:attr:`state`) and hands each call to the module of its rules.
    """

    def __init__(self, policy: HealthPolicy) -> None:
        self.state = HealthState(policy)

    # What the service and tests read of the model.

    @property
    def policy(self) -> HealthPolicy:
        return self.state.policy

    @property
    def jobs(self) -> dict[str, JobHealth]:
        """The watched jobs, by id."""
        return self.state.jobs

    @property
    def nodes(self) -> dict[str, NodeHealth]:
        """Every node heard from, by id."""
        return self.state.nodes

    @property
    def now(self) -> float:
        """The latest time seen."""
        return self.state.now

    @property
    def blind(self) -> bool:
        """Between :class:`WatchLost` and :class:`WatchResumed`: no timeout is judged."""
        return self.state.blind

    # Entry points.

    def handle(self, event: Event, now: float) -> list[Decision]:
        """Apply one event at ``now``: the timeouts due by then, then the event's own rules.

        Raises:
            TypeError: not one of :mod:`.events`' events.
        """
        return lifecycle.handle(self.state, event, now)

    def take_changed(self) -> set[str]:
        """The jobs whose lasting part changed since the last call: store the
        :func:`snapshot` of those still watched, drop the others'."""
        changed, self.state.changed = self.state.changed, set()
        return changed

    def take_progress(self, now: float, every_s: float) -> list[JobProgress]:
        """What to store of the jobs' progress at ``now``: the last of every job that ended
        since the last call, and of each watched job whose progress changed, if it was not
        taken within ``every_s``."""
        taken, self.state.ended_progress = self.state.ended_progress, []
        for job in self.state.jobs.values():
            if job.progress_due and now - job.progress_taken >= every_s:
                job.progress_due, job.progress_taken = False, now
                taken.append(job.progress(now))
        return taken

    def restore(self, data: bytes, now: float) -> str:
        """Take back a job's :func:`snapshot` at ``now``; returns the job id.

        Its reporting ranks are judged for hangs from ``now`` on (a full timeout).

        Raises:
            StoredStateError: ``data`` is not a snapshot this version can read.
        """
        return stored.restore(self.state, data, now)

    def tick(self, now: float) -> list[Decision]:
        """The time-based rules (hangs, lost nodes) due by ``now``."""
        return detect.due(self.state, self.state.advance(now))

    def next_deadline(self) -> float | None:
        """The earliest deadline of a judged rank or node, or of a node's charge to judge;
        None when nothing is timed.

        A timeout fires strictly after its deadline, so :meth:`tick` at exactly this
        time decides nothing yet and any later tick decides it (a charge that turns out
        to be no evidence, or not enough, decides nothing even then).
        """
        return detect.next_deadline(self.state)

    def check_invariants(self) -> None:
        """Assert the state is consistent (used by tests after every step)."""
        self.state.check_invariants()
