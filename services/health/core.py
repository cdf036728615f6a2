"""Failure detection: which ranks crashed, hung or straggle, which nodes are lost. Pure.

The core watches the jobs admission placed (rank ``i`` runs on ``nodes[i]``)
and the nodes that send heartbeats, and turns what it hears into faults:

1. **Crash.** A rank that exits with a non-zero (or unknown) exit code, or is
   ended by a signal, crashed: a crash fault at once, saying which. Exits the
   agent caused (cause ``stopped``: cancel, preemption, eviction) are not
   faults. A rank found dead by a restarted agent (cause ``lost``, status
   unknown), or whose command could not start (cause ``launch_failed``), is
   a crash too. An exit reported from a node other than the rank's is a
   leftover of an earlier placement and is ignored.
2. **Finish.** The training is complete once a rank exits with code 0 and no
   signal or reports its final step; from then on every exit of the job (a
   lost status, gloo timing out at exit) is done, never a crash. When some
   rank of the job is done and none is still running — the others are done,
   were stopped by their agent (an elastic job's replica that was no longer
   needed), or crashed and were never started again (a slot whose
   replacements ran out, or whose node is gone) — the job is finished (once),
   with the final step reported, and no longer watched.
3. **Hang.** A rank that has reported progress at least once and then reports
   nothing for longer than the job's ``hang_timeout_s`` hangs: one hang fault,
   strictly after ``last progress + hang_timeout_s``; a report at or before
   that moment is in time. A rank still starting up (no report yet, and no
   generation applied: :class:`MemberApplied`, from the stored job events, which a
   new leader reads even when the rank's reports went to its predecessor), or one
   whose last report said it was its final step (it is exiting), is not
   judged. The next report re-arms the rule. Ranks that exited, and ranks on a
   node that is currently lost (the node-lost fault covers them), are not
   judged; when such a node comes back its ranks get a full timeout again.
4. **Straggler.** When at least ``straggler_min_ranks`` running ranks of a job
   have a latest step time, a rank whose step time exceeds
   ``straggler_factor`` times the median of the *other* ranks' latest step
   times for ``straggler_steps`` consecutive reports straggles: one straggler
   fault. A report back under the threshold re-arms it; a report that cannot
   be judged (too few ranks) restarts the count.
5. **Lost node.** A node that sent a heartbeat and then none for longer than
   ``node_timeout_s`` is lost (once), with a node-lost fault for every rank of
   every watched job on it that has not exited, departing ranks included (see
   *Departing*). A node never heard from is not judged, unless a running rank
   of a watched job is on it at a :class:`WatchResumed` (see 7). When its
   heartbeats resume it is alive again, without new faults.
6. **Cordon.** A cordon needs evidence against the node, not against the
   job. Every infrastructure fault (see 8) and straggler is charged to its
   node (a node loss once, however many ranks it takes down) at the moment it
   happened, unless the node was under injected chaos then
   (:class:`ChaosInjected`). A charge is judged once ``cordon_spread_s`` has
   passed after it (strictly, like a timeout), when the job's other faults of
   that moment are in: a fault of a job whose faults within
   ``cordon_spread_s`` of it (either side) struck at least two of its nodes,
   more than half of the nodes it runs on, is the job's (every rank killed
   from outside, the script's own bug, a hang that stalls every rank) and
   says nothing about the node; any other charge, and every node loss, is
   evidence. A node with ``cordon_faults`` pieces of evidence within
   ``cordon_window_s`` is cordoned (once), until it is uncordoned, which also
   forgets its evidence and its charges not yet judged. (Before, every charge
   was evidence at once: a 4-rank job on two nodes killed whole twice, 15 s
   apart, cordoned both.)

7. **Blindness.** While the detector cannot hear (between :class:`WatchLost`
   and :class:`WatchResumed`: its bus connection is down) it judges no
   timeout, even when it is still handed events; :class:`WatchResumed` (also at
   a takeover) gives every node and every reporting rank a full timeout from
   that moment, so timeouts that fell due while it was blind are never judged.
   A node a running rank is on is judged from then too, though never heard: a
   node that died just before a takeover is heard by no new leader, and its
   ranks (still starting, or with a long hang timeout) were otherwise never
   judged.
   A *mass silence* is blindness too: a node or a rank that times out while
   every node not lost, at least two, went unheard for more than half the
   node timeout (:func:`~phalanx.schemas.registry.mass_silence`) is not
   judged; the detector judges nothing (no node, no hang) until a node is
   heard, and
   that heartbeat gives every node and rank a full timeout, as
   :class:`WatchResumed` does (:class:`JudgementHeld` says both). Every node
   silent at once is more likely the detector's connection or the network
   than every node dying, and a fault raised for each would end or requeue
   every job at once. A lone node's silence is its own.
8. **Restart policy.** Each crash, hang or node-lost fault of a rank is
   charged to its job's :class:`~phalanx.services.health.policy.RestartBudget`
   (the job's ``restart_policy``, kept across new placements of the same
   admission), with the restart round the rank was started in (noted at its
   start or placement) and the job's step: within it, the fault is raised
   (marked ``application`` when the script failed by itself); past it, the job
   fails instead (:class:`FailJob`, with the policy's reason code and the
   rank's error) and is no longer watched. Every step a rank reports goes to
   the budget too: progress ends a streak of restarts.
9. **Progress.** Each job's step, total steps and step rate are tracked from its
   ranks' reports (:class:`~phalanx.services.health.progress.StepTrack`, kept
   across new placements of the same admission like the budget), and
   :meth:`HealthCore.take_progress` hands the shell a job's
   :class:`~phalanx.schemas.messages.JobProgress` to store when its step, total or
   restarts changed, at most once per interval, and always its last one when the
   job finishes or fails.

**Departing.** A new placement of a job that no longer holds a slot whose rank
still runs keeps that rank watched as *departing* until it exits or its node
is lost: admission may take a slot away before this detector judges its node
lost (the two judge heartbeats independently), and an elastic job's members
there still need their node-lost fault, as a leaver that fails does. A
departing rank is not judged for hangs (it is on its way out: a leaver that
overstays is stopped by its agent); its stop or clean exit is no event, any
other exit is a crash as under rule 2, never the training's completion.

Faults name the rank's node: the one it was started on, else its placement
(a crash: the node that reported it), and the replica that runs in the slot
(the one last started there, else the one that exited). Jobs not watched, or no longer watched
(ended, finished, or re-placed: a new placement starts every rank of its slots
afresh), never get faults; events about them, or about ranks neither in the
placement nor departing, are ignored.

Time is an argument: :meth:`HealthCore.handle` and :meth:`HealthCore.tick`
take ``now`` (a ``now`` earlier than one already seen counts as the latest
seen), and every call first applies the timeouts due by then, so what is
decided, and when each fault is charged, does not depend on how often the
shell ticks, only on the events and their times. :meth:`HealthCore.next_deadline`
says when to tick next. No clock, no I/O; the service publishes the decisions.

Where the rules live (each a module of plain functions over the one model,
:class:`~.model.HealthState`; :class:`HealthCore` is their entry point):
:mod:`.events` (what comes in and goes out), :mod:`.model` (jobs, ranks, nodes, the
deadline heap, :class:`~.model.HealthPolicy`), :mod:`.lifecycle` (what each event does:
rules 1, 2 and 9, Departing), :mod:`.detect` (rules 3, 4, 5 and 7), :mod:`.cordon`
(rule 6), :mod:`.outcome` (rule 8, and the finish of rule 2), :mod:`.crash` (a crash
fault's text), :mod:`.stored` (what a new leader restores).
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
