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
   that moment is in time. A rank still starting up (no report yet), or one
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
   *Departing*). A node never heard from is not judged. When its heartbeats
   resume it is alive again, without new faults.
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
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
import math
import statistics

import msgspec

from phalanx.schemas.errors import ConfigError
from phalanx.schemas.messages import (
    DETAIL_CHARS,
    FaultKind,
    JobProgress,
    ReasonCode,
    RestartPolicy,
)
from phalanx.services.health.policy import Failure, RestartBudget, classify_exit
from phalanx.services.health.progress import StepTrack

EXIT_CAUSES = frozenset({"exited", "stopped", "lost", "launch_failed"})
DEFAULT_RESTART_POLICY = RestartPolicy()  # frozen: one instance serves every default


@dataclasses.dataclass(frozen=True)
class HealthPolicy:
    node_timeout_s: float = 3.0
    """A node is lost when it sends no heartbeat for longer than this."""
    straggler_factor: float = 2.0
    """A step time above this many times the median of the other ranks' is slow."""
    straggler_steps: int = 5
    """A rank straggles after this many slow reports in a row."""
    straggler_min_ranks: int = 3
    """Stragglers are only judged in jobs with at least this many reporting ranks."""
    cordon_faults: int = 3
    """A node charged with this many faults ..."""
    cordon_window_s: float = 300.0
    """... within this many seconds is cordoned."""
    cordon_spread_s: float = 5.0
    """A fault of a job whose faults struck most of its nodes within this many seconds of
    it is the job's, not its node's; a charge is judged this long after it happened."""

    def __post_init__(self) -> None:
        for name in ("node_timeout_s", "straggler_factor", "cordon_window_s",
                     "cordon_spread_s"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"health.{name} must be a positive finite number, "
                                  f"got {value!r}")
        for name in ("straggler_steps", "straggler_min_ranks", "cordon_faults"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"health.{name} must be an integer >= 1, got {value!r}")


# --- events --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobWatched:
    """A job is admitted: rank (slot) ``slots[i]`` runs on ``nodes[i]``; no slots: ``i``.

    Sent again with another placement or timeout, it replaces the watch and
    starts every rank afresh; sent again unchanged, it changes nothing.
    """

    job_id: str
    nodes: tuple[str, ...]
    hang_timeout_s: float
    slots: tuple[int, ...] = ()
    restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError(f"JobWatched {self.job_id!r}: nodes must not be empty")
        if self.slots and (len(self.slots) != len(self.nodes)
                           or len(set(self.slots)) != len(self.slots)):
            raise ValueError(f"JobWatched {self.job_id!r}: slots must name each node entry once")
        if not math.isfinite(self.hang_timeout_s) or self.hang_timeout_s <= 0:
            raise ValueError(f"JobWatched {self.job_id!r}: hang_timeout_s must be a positive "
                             f"finite number, got {self.hang_timeout_s!r}")


@dataclasses.dataclass(frozen=True)
class JobEnded:
    """The job is no longer admitted (cancelled, preempted, finished): stop watching it."""

    job_id: str


@dataclasses.dataclass(frozen=True)
class RankStarted:
    """An agent started a rank's process; the rank is judged afresh from here."""

    job_id: str
    rank: int
    node_id: str
    pid: int
    replica_id: str | None = None


@dataclasses.dataclass(frozen=True)
class RankExited:
    """A rank's process ended; ``cause`` is ``exited``, ``stopped``, ``lost`` or
    ``launch_failed``; ``detail`` is its error or last output, when it failed;
    ``with_agent``: stopped as its agent shut down (no evidence against the node)."""

    job_id: str
    rank: int
    node_id: str
    exit_code: int | None
    signal: str | None
    cause: str
    replica_id: str | None = None
    detail: str = ""
    with_agent: bool = False

    def __post_init__(self) -> None:
        if self.cause not in EXIT_CAUSES:
            raise ValueError(f"RankExited cause must be one of {sorted(EXIT_CAUSES)}, "
                             f"got {self.cause!r}")


@dataclasses.dataclass(frozen=True)
class ProgressReported:
    """A rank finished ``step`` in ``step_time_s`` (``final``: its last; it is exiting)."""

    job_id: str
    rank: int
    step: int
    step_time_s: float
    final: bool = False
    replica_id: str | None = None
    total_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class NodeHeartbeat:
    """A node's agent is alive; it arrived at the ``now`` passed with it."""

    node_id: str


@dataclasses.dataclass(frozen=True)
class NodeUncordoned:
    """An operator uncordoned the node; its fault history is forgotten."""

    node_id: str


@dataclasses.dataclass(frozen=True)
class ChaosInjected:
    """An operator injects faults on the node (``phalanx chaos``) until ``until``: faults
    charged to it until then are not the node's fault."""

    node_id: str
    until: float


@dataclasses.dataclass(frozen=True)
class WatchLost:
    """The detector cannot hear (its bus connection is down): until :class:`WatchResumed`
    it judges no timeout, whatever events it is still handed."""


@dataclasses.dataclass(frozen=True)
class WatchResumed:
    """The detector was blind until the ``now`` passed with it (disconnected, or just
    taken over): silence until then proves nothing."""


Event = (JobWatched | JobEnded | RankStarted | RankExited | ProgressReported | NodeHeartbeat
         | NodeUncordoned | ChaosInjected | WatchLost | WatchResumed)
_EVENTS = (JobWatched, JobEnded, RankStarted, RankExited, ProgressReported, NodeHeartbeat,
           NodeUncordoned, ChaosInjected, WatchLost, WatchResumed)


# --- decisions -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RaiseFault:
    """Publish a fault of ``job_id``'s rank (``None``: the job as a whole) on ``node_id``."""

    job_id: str
    kind: FaultKind
    node_id: str
    rank: int | None
    detail: str
    exit_code: int | None = None
    signal: str | None = None
    replica_id: str | None = None
    application: bool = False  # the script failed by itself


@dataclasses.dataclass(frozen=True)
class MarkNodeLost:
    """The node stopped sending heartbeats: its slots are gone until it is heard again."""

    node_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class MarkNodeAlive:
    """A lost node is sending heartbeats again."""

    node_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class CordonNode:
    """The node faults too often: no new work on it until an operator uncordons it."""

    node_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FinishJob:
    """The job's training completed (see rule 2), at ``step`` if a rank reported it."""

    job_id: str
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class FailJob:
    """The job's failures are past its restart policy (see rule 8): it ends ``failed``."""

    job_id: str
    reason_code: ReasonCode
    reason: str


Decision = RaiseFault | MarkNodeLost | MarkNodeAlive | CordonNode | FinishJob | FailJob


# --- state ---------------------------------------------------------------------------------


class RankExit(enum.StrEnum):
    """How a rank's process ended (``RankHealth.exit``; None while it runs)."""

    DONE = "done"
    CRASHED = "crashed"
    STOPPED = "stopped"


@dataclasses.dataclass(eq=False)
class RankHealth:
    """One rank of a watched job, since its placement or its last start."""

    job: JobHealth = dataclasses.field(repr=False)
    rank: int
    node_id: str
    replica_id: str | None = None
    exit: RankExit | None = None
    reporting: bool = False  # has reported progress (or did before a takeover)
    last_progress: float | None = None
    last_step: int | None = None
    step_time: float | None = None  # latest step time
    hang_since: float = -math.inf  # the hang clock runs from here (last report or node return)
    hang_raised: bool = False  # a fault (hang or node lost) covers the silence since then
    done: bool = False  # reported its final step: silence while it exits is not a hang
    slow_reports: int = 0
    straggler_raised: bool = False
    queued: bool = False  # has an entry in the deadline heap
    round: int = 0  # the job's restart round when this rank was started (or placed)


@dataclasses.dataclass(eq=False)
class JobHealth:
    job_id: str
    nodes: tuple[str, ...]
    hang_timeout_s: float
    slots: tuple[int, ...] = ()
    ranks: dict[int, RankHealth] = dataclasses.field(default_factory=dict)
    # Running ranks of slots an earlier placement held (see Departing), by slot.
    departing: dict[int, RankHealth] = dataclasses.field(default_factory=dict)
    budget: RestartBudget = dataclasses.field(
        default_factory=lambda: RestartBudget(DEFAULT_RESTART_POLICY))
    completed: bool = False  # a rank exited 0 or reported its final step: training is over
    final_step: int | None = None  # the last step, as a final report gave it
    track: StepTrack = dataclasses.field(default_factory=StepTrack)
    progress_due: bool = False  # its progress changed since it was last taken
    progress_taken: float = -math.inf


@dataclasses.dataclass(eq=False)
class NodeHealth:
    node_id: str
    last_heartbeat: float | None = None
    heard_from: float = -math.inf  # judged as if heard at least then (after blindness)
    lost: bool = False
    cordoned: bool = False
    chaos_until: float = -math.inf  # faults until then are injected, not the node's
    faults: collections.deque[tuple[float, FaultKind]] = dataclasses.field(
        default_factory=collections.deque)  # evidence, by when; oldest first; pruned to the window
    queued: bool = False
    uncordons: int = 0  # how often it was uncordoned: a charge made before one is forgotten


@dataclasses.dataclass(frozen=True)
class Charge:
    """A fault charged to a node, judged ``cordon_spread_s`` after it happened."""

    node_id: str
    at: float
    kind: FaultKind
    job_id: str | None  # None: the node's own loss, evidence whatever else happened
    job_nodes: int  # how many nodes the job ran on then
    uncordons: int  # the node's uncordon count then


class HealthCore:
    """The failure detector. Feed events with :meth:`handle`; call :meth:`tick` when due."""

    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self.jobs: dict[str, JobHealth] = {}
        self.nodes: dict[str, NodeHealth] = {}
        self.now = -math.inf  # latest time seen
        # Deadlines of judged ranks and nodes: (time, order, seq, item). Entries go stale
        # lazily (a report moves a deadline later; the entry is re-pushed when it surfaces).
        # Equal deadlines fire in a fixed order, nodes first (a loss covers its ranks).
        self._heap: list[tuple[float, tuple[int, str, int], int, RankHealth | NodeHealth]] = []
        self._seq = 0
        self._changed: set[str] = set()  # jobs whose lasting part changed since taken
        # Charges to judge, by (when judged, seq); and every job's faults, (when, job, node),
        # oldest first, kept as long as a charge may still be judged against them.
        self._charges: list[tuple[float, int, Charge]] = []
        self._struck: collections.deque[tuple[float, str, str]] = collections.deque()
        self.blind = False  # between WatchLost and WatchResumed: no timeout is judged
        self._last_progress: list[JobProgress] = []  # of jobs that ended since taken

    # --- entry points -------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Decision]:
        """Apply one event at ``now``: the timeouts due by then, then the event's own rules.

        Raises:
            TypeError: not one of this module's events.
        """
        if not isinstance(event, _EVENTS):
            raise TypeError(f"unknown event {event!r}")
        now = self._advance(now)
        if isinstance(event, WatchLost):
            self.blind = True
            return []
        if isinstance(event, WatchResumed):
            self.blind = False
            self._resumed(now)  # before anything falls due: the silence proves nothing
            return []
        decisions = self._due(now)
        match event:
            case JobWatched():
                self._watched(event)
            case JobEnded():
                if self.jobs.pop(event.job_id, None) is not None:
                    self._changed.add(event.job_id)
            case RankStarted():
                self._started(event)
            case RankExited():
                decisions += self._exited(event, now)
            case ProgressReported():
                decisions += self._progress(event, now)
            case NodeHeartbeat():
                decisions += self._heartbeat(event.node_id, now)
            case NodeUncordoned():
                node = self.nodes.get(event.node_id)
                if node is not None:
                    node.cordoned = False
                    node.faults.clear()
                    node.uncordons += 1
            case ChaosInjected():
                node = self._node(event.node_id)
                node.chaos_until = max(node.chaos_until, event.until)
        return decisions

    def take_changed(self) -> set[str]:
        """The jobs whose lasting part changed since the last call: store the
        :func:`snapshot` of those still watched, drop the others'."""
        changed, self._changed = self._changed, set()
        return changed

    def take_progress(self, now: float, every_s: float) -> list[JobProgress]:
        """What to store of the jobs' progress at ``now``: the last of every job that ended
        since the last call, and of each watched job whose progress changed, if it was not
        taken within ``every_s``."""
        taken, self._last_progress = self._last_progress, []
        for job in self.jobs.values():
            if job.progress_due and now - job.progress_taken >= every_s:
                job.progress_due, job.progress_taken = False, now
                taken.append(_progress(job, now))
        return taken

    def restore(self, data: bytes, now: float) -> str:
        """Take back a job's :func:`snapshot` at ``now``; returns the job id.

        Its reporting ranks are judged for hangs from ``now`` on (a full timeout).

        Raises:
            SnapshotError: ``data`` is not a snapshot this version can read.
        """
        try:
            stored = _SNAPSHOT_DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SnapshotError(f"not a health job snapshot: {exc}") from None
        now = self._advance(now)
        job = JobHealth(stored.job_id, stored.nodes, stored.hang_timeout_s, stored.slots,
                        budget=RestartBudget(stored.restart_policy, stored.restarts,
                                             stored.app_failures,
                                             collections.deque(stored.recent_restarts),
                                             stored.restart_round, stored.stalled_step,
                                             knows_step=False),
                        completed=stored.completed, final_step=stored.final_step)
        for rank in stored.ranks:
            into = job.departing if rank.departing else job.ranks
            into[rank.rank] = RankHealth(job, rank.rank, rank.node_id, rank.replica_id,
                                         rank.exit, rank.reporting, hang_since=now,
                                         done=rank.done, round=rank.round)
        self.jobs[job.job_id] = job
        for rank in job.ranks.values():
            self._arm(rank)
        return job.job_id

    def tick(self, now: float) -> list[Decision]:
        """The time-based rules (hangs, lost nodes) due by ``now``."""
        return self._due(self._advance(now))

    def next_deadline(self) -> float | None:
        """The earliest deadline of a judged rank or node, or of a node's charge to judge;
        None when nothing is timed.

        A timeout fires strictly after its deadline, so :meth:`tick` at exactly this
        time decides nothing yet and any later tick decides it (a charge that turns out
        to be no evidence, or not enough, decides nothing even then).
        """
        entry = self._peek()
        deadlines = [entry[0]] if entry is not None else []
        if self._charges:
            deadlines.append(self._charges[0][0])
        return min(deadlines, default=None)

    # --- events -------------------------------------------------------------------------

    def _watched(self, event: JobWatched) -> None:
        old = self.jobs.get(event.job_id)
        slots = tuple(event.slots) or tuple(range(len(event.nodes)))
        if (old is not None and old.nodes == event.nodes and old.slots == slots
                and old.hang_timeout_s == event.hang_timeout_s
                and old.budget.policy == event.restart_policy):
            return  # a replay
        job = JobHealth(event.job_id, tuple(event.nodes), event.hang_timeout_s, slots)
        if old is not None:  # a new placement of the same admission: the spending goes on
            job.budget, job.completed, job.final_step = old.budget, old.completed, old.final_step
            job.track, job.progress_due = old.track, old.progress_due
            job.progress_taken = old.progress_taken
            for slot, rank in [*old.ranks.items(), *old.departing.items()]:
                if slot not in slots and rank.exit is None:
                    rank.job = job
                    job.departing[slot] = rank
        job.budget.policy = event.restart_policy
        job.ranks = {slot: RankHealth(job, slot, node_id, round=job.budget.round)
                     for slot, node_id in zip(slots, job.nodes, strict=True)}
        self.jobs[event.job_id] = job  # old rank entries in the heap are stale now
        self._changed.add(event.job_id)

    def _resumed(self, now: float) -> None:
        for node in self.nodes.values():
            node.heard_from = now
            self._arm(node)
        for job in self.jobs.values():
            for rank in job.ranks.values():
                rank.hang_since = max(rank.hang_since, now)
                self._arm(rank)

    def _rank(self, job_id: str, rank: int) -> RankHealth | None:
        """The rank in slot ``rank`` of a watched job: placed there, else departing."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        return job.ranks.get(rank) or job.departing.get(rank)

    def _started(self, event: RankStarted) -> None:
        job = self.jobs.get(event.job_id)
        old = None if job is None else job.ranks.get(event.rank)
        if old is not None:
            old.job.ranks[event.rank] = RankHealth(old.job, event.rank, event.node_id,
                                                   event.replica_id,
                                                   round=old.job.budget.round)
            self._changed.add(event.job_id)

    def _exited(self, event: RankExited, now: float) -> list[Decision]:
        rank = self._rank(event.job_id, event.rank)
        if rank is None or rank.exit is not None or rank.node_id != event.node_id:
            return []
        if rank.replica_id is None:
            rank.replica_id = event.replica_id
        elif event.replica_id is not None and event.replica_id != rank.replica_id:
            return []  # an earlier incarnation's late exit
        self._changed.add(event.job_id)
        job = rank.job
        if job.departing.get(event.rank) is rank:
            del job.departing[event.rank]
            if event.cause == "stopped" or (event.exit_code == 0 and event.signal is None):
                return []  # a leaver's end, whatever the others still do
        elif event.cause == "stopped":
            rank.exit = RankExit.STOPPED
            return self._finish_if_done(job)
        elif (event.exit_code == 0 and event.signal is None) or rank.done or job.completed:
            # Training was over: whatever ends a process after the last commit is not a
            # failure (an exit status lost with a restarted agent; gloo timing out at exit
            # in a script that never closed its session).
            rank.exit = RankExit.DONE
            job.completed = True
            return self._finish_if_done(job)
        rank.exit = RankExit.CRASHED
        failure = classify_exit(event.cause, event.exit_code, event.signal)
        fault = RaiseFault(event.job_id, FaultKind.CRASH, event.node_id, event.rank,
                           _crash_detail(event), event.exit_code, event.signal,
                           rank.replica_id)
        decisions = self._failure(rank, failure, now, fault)
        # The script's own failures are no node's, nor is its agent's orderly shutdown.
        if failure is Failure.INFRASTRUCTURE and not event.with_agent:
            self._charge(event.node_id, now, FaultKind.CRASH, job)
        if self.jobs.get(job.job_id) is job:
            decisions += self._finish_if_done(job)
        return decisions

    def _failure(self, rank: RankHealth, failure: Failure, at: float,
                 fault: RaiseFault) -> list[Decision]:
        """Charge a rank's failure to its job's restart budget: the fault that has it
        repaired, or, past the budget, the job's end."""
        job = rank.job
        self._changed.add(job.job_id)
        node = self.nodes.get(rank.node_id)
        if node is None or at > node.chaos_until:
            # An injected fault is no evidence, neither against its node nor for a fault
            # that struck the whole job (which would clear a real one beside it).
            self._strike(job.job_id, rank.node_id, at)
        what = f"{rank.replica_id or f'rank {rank.rank}'} on {rank.node_id}: {fault.detail}"
        verdict = job.budget.charge(failure, at, what, started_in=rank.round,
                                    step=max(job.track.step, job.final_step or 0))
        if verdict is not None:
            del self.jobs[job.job_id]
            self._last_progress.append(_progress(job, at))
            return [FailJob(job.job_id, verdict.reason_code, verdict.reason)]
        job.progress_due = True  # a restart more
        return [dataclasses.replace(fault, application=failure.application)]

    def _finish_if_done(self, job: JobHealth) -> list[Decision]:
        """Finished: some rank exited 0 and none still runs (a crashed slot that is never
        started again does not hold the job back)."""
        exits = [r.exit for r in job.ranks.values()]
        if RankExit.DONE in exits and None not in exits:
            del self.jobs[job.job_id]
            self._last_progress.append(_progress(job, self.now))
            return [FinishJob(job.job_id, job.final_step)]
        return []

    def _progress(self, event: ProgressReported, now: float) -> list[Decision]:
        rank = self._rank(event.job_id, event.rank)
        if rank is None or rank.exit is not None:
            return []
        if rank.job.budget.progressed(event.step):  # a streak of restarts ended
            self._changed.add(event.job_id)
        if rank.job.departing.get(rank.rank) is rank:  # counts for the job's step, no more
            if rank.job.track.reported(event.step, event.total_steps, now):
                rank.job.progress_due = True
            return []
        if not rank.reporting or (rank.replica_id is None and event.replica_id is not None):
            rank.reporting = True
            rank.replica_id = rank.replica_id or event.replica_id
            self._changed.add(event.job_id)
        rank.last_progress = rank.hang_since = now
        if rank.job.track.reported(event.step, event.total_steps, now):
            rank.job.progress_due = True
        rank.done = event.final
        if event.final and rank.job.final_step != event.step:
            rank.job.completed, rank.job.final_step = True, event.step
            self._changed.add(event.job_id)
        rank.last_step = event.step
        rank.step_time = event.step_time_s
        rank.hang_raised = False
        self._arm(rank)
        return self._judge_straggler(rank, event, now)

    def _judge_straggler(self, rank: RankHealth, event: ProgressReported,
                         now: float) -> list[Decision]:
        policy = self.policy
        others = [r.step_time for r in rank.job.ranks.values()
                  if r is not rank and r.exit is None and r.step_time is not None]
        if not others or len(others) + 1 < policy.straggler_min_ranks:
            rank.slow_reports = 0
            return []
        median = statistics.median(others)
        if not event.step_time_s > policy.straggler_factor * median:
            rank.slow_reports = 0
            rank.straggler_raised = False
            return []
        rank.slow_reports += 1
        if rank.straggler_raised or rank.slow_reports < policy.straggler_steps:
            return []
        rank.straggler_raised = True
        detail = (f"rank {rank.rank} took {event.step_time_s:.3g} s for step {event.step}, "
                  f"over {policy.straggler_factor:g} x the median {median:.3g} s of the other "
                  f"{len(others)} rank(s), for {rank.slow_reports} reports in a row")
        fault = RaiseFault(rank.job.job_id, FaultKind.STRAGGLER, rank.node_id, rank.rank, detail,
                           replica_id=rank.replica_id)
        self._strike(rank.job.job_id, rank.node_id, now)
        self._charge(rank.node_id, now, FaultKind.STRAGGLER, rank.job)
        return [fault]

    def _heartbeat(self, node_id: str, now: float) -> list[Decision]:
        node = self._node(node_id)
        decisions: list[Decision] = []
        if node.lost:
            assert node.last_heartbeat is not None
            node.lost = False
            decisions.append(MarkNodeAlive(node_id, (
                f"heartbeats resumed after {now - node.last_heartbeat:.1f} s of silence")))
            for rank in self._ranks_on(node_id):
                rank.hang_since = max(rank.hang_since, now)  # a full timeout from the return
                self._arm(rank)
        node.last_heartbeat = now
        self._arm(node)
        return decisions

    # --- timeouts -----------------------------------------------------------------------

    def _advance(self, now: float) -> float:
        if math.isnan(now):
            raise ValueError("now must be a number, got nan")
        self.now = max(self.now, now)
        return self.now

    def _deadline(self, item: RankHealth | NodeHealth) -> float | None:
        """When ``item`` times out, or None when it is not judged (or no longer tracked)."""
        if isinstance(item, NodeHealth):
            if (self.nodes.get(item.node_id) is not item or item.lost
                    or item.last_heartbeat is None):
                return None
            return max(item.last_heartbeat, item.heard_from) + self.policy.node_timeout_s
        job = item.job
        if (self.jobs.get(job.job_id) is not job or job.ranks.get(item.rank) is not item
                or item.exit is not None or not item.reporting or item.hang_raised
                or item.done):
            return None
        node = self.nodes.get(item.node_id)
        if node is not None and node.lost:
            return None
        return item.hang_since + job.hang_timeout_s

    def _arm(self, item: RankHealth | NodeHealth) -> None:
        if item.queued:
            return  # its entry is at or before the deadline; re-pushed when it surfaces
        deadline = self._deadline(item)
        if deadline is not None:
            self._seq += 1
            order = ((0, item.node_id, 0) if isinstance(item, NodeHealth)
                     else (1, item.job.job_id, item.rank))
            heapq.heappush(self._heap, (deadline, order, self._seq, item))
            item.queued = True

    def _peek(self) -> tuple[float, tuple[int, str, int], int, RankHealth | NodeHealth] | None:
        """The heap's first entry once it is current (stale entries dropped or moved)."""
        heap = self._heap
        while heap:
            at, _, _, item = heap[0]
            if self._deadline(item) == at:
                return heap[0]
            heapq.heappop(heap)
            item.queued = False
            self._arm(item)
        return None

    def _due(self, now: float) -> list[Decision]:
        """Timeouts and charges to judge due by ``now``, in time order (a timeout first
        on a tie: a fault at the very edge of a charge's spread counts for it)."""
        decisions: list[Decision] = []
        if self.blind:
            return decisions
        while True:
            entry = self._peek()
            timeout = entry[0] if entry is not None and entry[0] < now else math.inf
            charge = self._charges[0][0] if self._charges else math.inf
            if charge < now and charge < timeout:
                decisions += self._judge(heapq.heappop(self._charges)[2])
            elif timeout < now:
                at, _, _, item = heapq.heappop(self._heap)
                item.queued = False
                if isinstance(item, NodeHealth):
                    decisions += self._lose(item, at)
                else:
                    decisions += self._hang(item, at)
            else:
                return decisions

    def _hang(self, rank: RankHealth, at: float) -> list[Decision]:
        rank.hang_raised = True
        job = rank.job
        after = ("since this health service began watching it" if rank.last_step is None
                 else f"after step {rank.last_step}")
        detail = (f"rank {rank.rank} reported no progress for more than "
                  f"{job.hang_timeout_s:g} s {after}")
        fault = RaiseFault(job.job_id, FaultKind.HANG, rank.node_id, rank.rank, detail,
                           replica_id=rank.replica_id)
        decisions = self._failure(rank, Failure.INFRASTRUCTURE, at, fault)
        self._charge(rank.node_id, at, FaultKind.HANG, job)
        return decisions

    def _lose(self, node: NodeHealth, at: float) -> list[Decision]:
        node.lost = True
        why = f"no heartbeat for more than {self.policy.node_timeout_s:g} s"
        decisions: list[Decision] = [MarkNodeLost(node.node_id, why)]
        for rank in self._ranks_on(node.node_id):
            if self.jobs.get(rank.job.job_id) is not rank.job:
                continue  # the job failed with an earlier rank on this node
            rank.hang_raised = True
            if rank.job.departing.get(rank.rank) is rank:
                del rank.job.departing[rank.rank]  # its fault is all that is left to say
            fault = RaiseFault(rank.job.job_id, FaultKind.NODE_LOST, node.node_id, rank.rank,
                               f"rank {rank.rank}'s node {node.node_id} was lost: {why}",
                               replica_id=rank.replica_id)
            decisions += self._failure(rank, Failure.INFRASTRUCTURE, at, fault)
        self._charge(node.node_id, at, FaultKind.NODE_LOST, None)
        return decisions

    # --- nodes and cordons --------------------------------------------------------------

    def _node(self, node_id: str) -> NodeHealth:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeHealth(node_id)
        return node

    def _ranks_on(self, node_id: str) -> list[RankHealth]:
        """Ranks of watched jobs on ``node_id`` that have not exited, in watch order (each
        job's placed ranks, then its departing ones)."""
        return [r for job in self.jobs.values()
                for r in [*job.ranks.values(), *job.departing.values()]
                if r.node_id == node_id and r.exit is None]

    def _strike(self, job_id: str, node_id: str, at: float) -> None:
        """Note a fault of ``job_id`` on ``node_id`` (faults come in time order)."""
        struck = self._struck
        struck.append((at, job_id, node_id))
        # The charges still to judge look back a spread from their own time: from the
        # oldest of them, or (none) from a charge this fault's may yet bring.
        spread = self.policy.cordon_spread_s
        oldest = self._charges[0][2].at if self._charges else at
        while struck[0][0] < min(oldest, at - spread) - spread:
            struck.popleft()

    def _charge(self, node_id: str, at: float, kind: FaultKind,
                job: JobHealth | None) -> None:
        """Charge a fault at ``at`` to its node (``job``: None for the node's own loss), to
        be judged once the job's faults of that moment are in."""
        node = self._node(node_id)
        if at <= node.chaos_until:
            return  # injected on purpose: says nothing about the node
        nodes = 0 if job is None else len({r.node_id for r in [*job.ranks.values(),
                                                               *job.departing.values()]})
        self._seq += 1
        heapq.heappush(self._charges, (at + self.policy.cordon_spread_s, self._seq, Charge(
            node_id, at, kind, None if job is None else job.job_id, nodes, node.uncordons)))

    def _judge(self, charge: Charge) -> list[Decision]:
        """A charge whose spread has passed: evidence against its node, or the job's."""
        node = self.nodes[charge.node_id]
        if node.uncordons != charge.uncordons:
            return []  # forgotten by an uncordon
        if charge.job_id is not None:
            spread = self.policy.cordon_spread_s
            struck = {n for t, j, n in self._struck
                      if j == charge.job_id and abs(t - charge.at) <= spread}
            if len(struck) >= 2 and 2 * len(struck) > charge.job_nodes:
                return []  # it struck most of the job's nodes alike: the job's, not the node's
        return self._evidence(node, charge.at, charge.kind)

    def _evidence(self, node: NodeHealth, at: float, kind: FaultKind) -> list[Decision]:
        node_id = node.node_id
        faults = node.faults
        faults.append((at, kind))
        window = self.policy.cordon_window_s
        while at - faults[0][0] > window:
            faults.popleft()
        if node.cordoned or len(faults) < self.policy.cordon_faults:
            return []
        node.cordoned = True
        counts = collections.Counter(k.value for _, k in faults)
        what = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        return [CordonNode(node_id, f"{len(faults)} faults within {window:g} s ({what})")]

    # --- invariants ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the state is consistent (used by tests after every step)."""
        policy = self.policy
        live: set[int] = set()
        for job_id, job in self.jobs.items():
            assert job.job_id == job_id, f"{job_id} filed under another id"
            assert len(job.ranks) == len(job.nodes) > 0, f"{job_id} ranks drifted"
            assert not (any(r.exit == RankExit.DONE for r in job.ranks.values()) and all(
                r.exit is not None for r in job.ranks.values())), f"{job_id} unfinished"
            for i, rank in job.departing.items():
                assert rank.job is job and rank.rank == i, f"{job_id} departing {i} misfiled"
                assert i not in job.ranks and rank.exit is None, f"{job_id} {i} not departing"
            for i, rank in job.ranks.items():
                assert rank.job is job and rank.rank == i, f"{job_id} rank {i} misfiled"
                assert rank.exit in (None, RankExit.DONE, RankExit.CRASHED, RankExit.STOPPED)
                assert rank.slow_reports >= 0
                if rank.last_progress is not None:
                    assert rank.reporting, f"{job_id} rank {i} reported but is not reporting"
                    assert rank.step_time is not None and rank.last_step is not None
                    assert rank.last_progress <= rank.hang_since <= self.now
                live.add(id(rank))
        for node_id, node in self.nodes.items():
            assert node.node_id == node_id, f"{node_id} filed under another id"
            assert not node.lost or node.last_heartbeat is not None, f"{node_id} lost unheard"
            assert node.last_heartbeat is None or node.last_heartbeat <= self.now
            times = [t for t, _ in node.faults]
            assert times == sorted(times), f"{node_id} faults out of order"
            assert not times or times[-1] - times[0] <= policy.cordon_window_s
            assert not times or times[-1] <= self.now
            assert node.uncordons >= 0
            live.add(id(node))
        struck = [t for t, _, _ in self._struck]
        assert struck == sorted(struck), "job faults out of order"
        assert not struck or struck[-1] <= self.now
        for due, _, charge in self._charges:
            assert charge.node_id in self.nodes, f"a charge to unknown {charge.node_id}"
            assert due == charge.at + policy.cordon_spread_s and charge.at <= self.now
            assert self.blind or due >= self.now, f"{charge!r} is overdue"
            assert charge.job_id is None or (charge.at, charge.job_id, charge.node_id) \
                in self._struck, f"{charge!r}: its own fault is no longer kept"
        entries: collections.Counter[int] = collections.Counter()
        for at, _, _, item in self._heap:
            if id(item) in live:
                entries[id(item)] += 1
                deadline = self._deadline(item)
                assert deadline is None or at <= deadline, "a heap entry is after its deadline"
        for job in self.jobs.values():
            for rank in job.ranks.values():
                self._check_timed(rank, entries[id(rank)])
        for node in self.nodes.values():
            self._check_timed(node, entries[id(node)])

    def _check_timed(self, item: RankHealth | NodeHealth, entries: int) -> None:
        assert entries == (1 if item.queued else 0), f"{item!r}: {entries} heap entries"
        deadline = self._deadline(item)
        if deadline is not None:
            assert item.queued, f"{item!r} is judged but has no deadline queued"
            assert self.blind or deadline >= self.now, \
                f"{item!r} is overdue ({deadline} < {self.now})"


# --- snapshots -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankSnapshot:
    rank: int
    node_id: str
    replica_id: str | None
    exit: RankExit | None
    reporting: bool
    done: bool = False
    departing: bool = False
    round: int = 0  # the restart round it was started in


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
    """The lasting part of a watched job."""

    job_id: str
    nodes: tuple[str, ...]
    hang_timeout_s: float
    slots: tuple[int, ...]
    ranks: tuple[RankSnapshot, ...]
    restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY
    restarts: int = 0
    app_failures: int = 0
    recent_restarts: tuple[float, ...] = ()  # the rounds of the streak without progress
    completed: bool = False
    final_step: int | None = None
    restart_round: int = 0
    stalled_step: int = 0  # the job's step when the latest round began


class SnapshotError(ValueError):
    """Stored health state that this version cannot read."""


def snapshot(job: JobHealth) -> bytes:
    """A watched job's lasting part, for :meth:`HealthCore.restore`."""
    budget = job.budget
    return _SNAPSHOT_ENCODER.encode(JobSnapshot(
        job.job_id, job.nodes, job.hang_timeout_s, job.slots,
        tuple(RankSnapshot(r.rank, r.node_id, r.replica_id, r.exit, r.reporting, r.done,
                           departing=r.rank not in job.ranks, round=r.round)
              for r in [*job.ranks.values(), *job.departing.values()]),
        budget.policy, budget.restarts, budget.app_failures, tuple(budget.stalled),
        job.completed, job.final_step, budget.round, budget.step))


_SNAPSHOT_ENCODER = msgspec.msgpack.Encoder()
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(JobSnapshot)


def _progress(job: JobHealth, now: float) -> JobProgress:
    track, budget = job.track, job.budget
    return JobProgress(job_id=job.job_id, step=max(track.step, job.final_step or 0),
                       total_steps=track.total_steps, steps_per_s=track.rate(now),
                       window_s=track.window_s, restarts=budget.restarts,
                       app_failures=budget.app_failures, updated_at=now)


def _crash_detail(event: RankExited) -> str:
    if event.cause == "launch_failed":
        return f"rank {event.rank} could not be started: {event.detail or 'no reason given'}"
    if event.cause == "lost" and event.with_agent:
        return (f"rank {event.rank} was stopped with its agent on {event.node_id} (the agent "
                "shut down while the job still wanted the rank)")
    if event.cause == "lost":
        what = (f"rank {event.rank} was found dead by a restarted agent on {event.node_id}; "
                "its exit status is unknown")
        if event.signal is not None or event.exit_code is not None:
            what += f" (reported: exit code {event.exit_code}, signal {event.signal})"
        return what
    if event.signal is not None:
        code = f" (exit code {event.exit_code})" if event.exit_code is not None else ""
        what = f"rank {event.rank} was killed by signal {event.signal}{code}"
    elif event.exit_code is None:
        what = f"rank {event.rank} exited with an unknown status"
    else:
        what = f"rank {event.rank} exited with code {event.exit_code}"
    output = event.detail.rstrip()
    if not output:
        return what
    # The error is the output's last line (an exception's, a "can't open file"): it goes on
    # the first line too, which is all that one-line views show (phalanx top, a
    # generation's cause). The output is cut at its start to keep the fault's detail
    # within DETAIL_CHARS, so the error is never what is lost.
    error = output.splitlines()[-1].strip()
    # A process killed by a signal was stopped from outside: its last line is no error.
    head = f"{what}; its last output:\n" if event.signal is not None \
        else f"{what}: {error[:_ERROR_CHARS]}; its last output:\n"
    return head + output[max(0, len(output) - (DETAIL_CHARS - len(head))):]


#: The most of a rank's error line that the first line of its crash detail quotes.
_ERROR_CHARS = 500
