"""The health core's model: watched jobs and their ranks, nodes, and the deadline heap. Pure.

:class:`HealthState` is everything the rules read: the watched jobs
(:class:`JobHealth`, each rank a :class:`RankHealth`, placed or departing), the nodes
heard from (:class:`NodeHealth`), the heap of deadlines of the ranks and nodes judged for
timeouts, the charges to nodes still to judge (:class:`Charge`) and the faults they are
judged against, the latest time seen, and whether the detector is blind. Its methods keep
the heap consistent (:meth:`~HealthState.arm`, :meth:`~HealthState.peek`: entries go
stale lazily and are re-pushed when they surface) and look things up;
:meth:`~HealthState.check_invariants` recomputes what it can from scratch. The rules are
elsewhere: :mod:`.lifecycle` (events), :mod:`.detect` (timeouts and stragglers),
:mod:`.cordon`, :mod:`.outcome` (the restart guard and the finish), :mod:`.stored`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
import math

from phalanx.schemas.errors import ConfigError
from phalanx.schemas.messages import FaultKind, JobProgress
from phalanx.services.health.events import DEFAULT_RESTART_POLICY
from phalanx.services.health.policy import RestartBudget
from phalanx.services.health.progress import StepTrack


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
    # Running ranks of slots an earlier placement held (:mod:`.core`, Departing), by slot.
    departing: dict[int, RankHealth] = dataclasses.field(default_factory=dict)
    budget: RestartBudget = dataclasses.field(
        default_factory=lambda: RestartBudget(DEFAULT_RESTART_POLICY))
    completed: bool = False  # a rank exited 0 or reported its final step: training is over
    final_step: int | None = None  # the last step, as a final report gave it
    track: StepTrack = dataclasses.field(default_factory=StepTrack)
    progress_due: bool = False  # its progress changed since it was last taken
    progress_taken: float = -math.inf
    admission: int = 0  # which admission of the job this is (JobRecord.admission)
    # A large job's median step time: (taken at, median, ranks it counts less one).
    median: tuple[float, float, int] | None = dataclasses.field(default=None, compare=False)
    #: The newest generation a member applied or reported a step in (-1: none yet): a
    #: report of an older one is a rank the job moved past (:func:`.lifecycle.progress`).
    generation: int = -1

    def progress(self, now: float) -> JobProgress:
        """The job's progress record at ``now``, as the shell stores it."""
        track, budget = self.track, self.budget
        return JobProgress(job_id=self.job_id, step=max(track.step, self.final_step or 0),
                           total_steps=track.total_steps, steps_per_s=track.rate(now),
                           window_s=track.window_s, restarts=budget.restarts,
                           app_failures=budget.app_failures, updated_at=now)


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

    @property
    def heard(self) -> float | None:
        """When it was last heard, or is judged as heard (after blindness, or expected at
        a takeover); None while it is not judged at all."""
        if self.last_heartbeat is None:
            return None if self.heard_from == -math.inf else self.heard_from
        return max(self.last_heartbeat, self.heard_from)


@dataclasses.dataclass(frozen=True)
class Charge:
    """A fault charged to a node, judged ``cordon_spread_s`` after it happened."""

    node_id: str
    at: float
    kind: FaultKind
    job_id: str | None  # None: the node's own loss, evidence whatever else happened
    job_nodes: int  # how many nodes the job ran on then
    uncordons: int  # the node's uncordon count then


#: A deadline heap entry: (when, order, seq, the rank or node it times).
Entry = tuple[float, tuple[int, str, int], int, RankHealth | NodeHealth]


class HealthState:
    """What the detector knows, and the indexes that keep judging it cheap."""

    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self.jobs: dict[str, JobHealth] = {}
        self.nodes: dict[str, NodeHealth] = {}
        self.now = -math.inf  # latest time seen
        # Deadlines of judged ranks and nodes. Entries go stale lazily (a report moves a
        # deadline later; the entry is re-pushed when it surfaces). Equal deadlines fire in
        # a fixed order, nodes first (a loss covers its ranks).
        self.heap: list[Entry] = []
        self.seq = 0
        self.changed: set[str] = set()  # jobs whose lasting part changed since taken
        # Charges to judge, by (when judged, seq); and every job's faults, (when, job, node),
        # oldest first, kept as long as a charge may still be judged against them.
        self.charges: list[tuple[float, int, Charge]] = []
        self.struck: collections.deque[tuple[float, str, str]] = collections.deque()
        self.blind = False  # between WatchLost and WatchResumed: no timeout is judged
        self.silent_since: float | None = None  # a mass silence (rule 7): nor then
        self.ended_progress: list[JobProgress] = []  # of jobs that ended since taken

    @property
    def judging(self) -> bool:
        """Whether timeouts are judged: not blind, and no mass silence under way."""
        return not self.blind and self.silent_since is None

    def advance(self, now: float) -> float:
        """Move the latest time seen to ``now`` (never back); returns it.

        Raises:
            ValueError: ``now`` is NaN.
        """
        if math.isnan(now):
            raise ValueError("now must be a number, got nan")
        self.now = max(self.now, now)
        return self.now

    # --- look-ups -----------------------------------------------------------------------

    def node(self, node_id: str) -> NodeHealth:
        """The node ``node_id``, added unheard if new."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeHealth(node_id)
        return node

    def rank(self, job_id: str, rank: int) -> RankHealth | None:
        """The rank in slot ``rank`` of a watched job: placed there, else departing."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        return job.ranks.get(rank) or job.departing.get(rank)

    def ranks_on(self, node_id: str) -> list[RankHealth]:
        """Ranks of watched jobs on ``node_id`` that have not exited, in watch order (each
        job's placed ranks, then its departing ones)."""
        return [r for job in self.jobs.values()
                for r in [*job.ranks.values(), *job.departing.values()]
                if r.node_id == node_id and r.exit is None]

    # --- the deadline heap --------------------------------------------------------------

    def deadline(self, item: RankHealth | NodeHealth) -> float | None:
        """When ``item`` times out, or None when it is not judged (or no longer tracked)."""
        if isinstance(item, NodeHealth):
            heard = item.heard
            if self.nodes.get(item.node_id) is not item or item.lost or heard is None:
                return None
            return heard + self.policy.node_timeout_s
        job = item.job
        if (self.jobs.get(job.job_id) is not job or job.ranks.get(item.rank) is not item
                or item.exit is not None or not item.reporting or item.hang_raised
                or item.done):
            return None
        node = self.nodes.get(item.node_id)
        if node is not None and node.lost:
            return None
        return item.hang_since + job.hang_timeout_s

    def arm(self, item: RankHealth | NodeHealth) -> None:
        """Queue ``item``'s deadline, unless it has an entry already or is not judged."""
        if item.queued:
            return  # its entry is at or before the deadline; re-pushed when it surfaces
        deadline = self.deadline(item)
        if deadline is not None:
            self.seq += 1
            order = ((0, item.node_id, 0) if isinstance(item, NodeHealth)
                     else (1, item.job.job_id, item.rank))
            heapq.heappush(self.heap, (deadline, order, self.seq, item))
            item.queued = True

    def peek(self) -> Entry | None:
        """The heap's first entry once it is current (stale entries dropped or moved)."""
        heap = self.heap
        while heap:
            at, _, _, item = heap[0]
            if self.deadline(item) == at:
                return heap[0]
            heapq.heappop(heap)
            item.queued = False
            self.arm(item)
        return None

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
            assert not node.lost or node.heard is not None, f"{node_id} lost unjudged"
            assert node.last_heartbeat is None or node.last_heartbeat <= self.now
            times = [t for t, _ in node.faults]
            assert times == sorted(times), f"{node_id} faults out of order"
            assert not times or times[-1] - times[0] <= policy.cordon_window_s
            assert not times or times[-1] <= self.now
            assert node.uncordons >= 0
            live.add(id(node))
        struck = [t for t, _, _ in self.struck]
        assert struck == sorted(struck), "job faults out of order"
        assert not struck or struck[-1] <= self.now
        for due, _, charge in self.charges:
            assert charge.node_id in self.nodes, f"a charge to unknown {charge.node_id}"
            assert due == charge.at + policy.cordon_spread_s and charge.at <= self.now
            assert not self.judging or due >= self.now, f"{charge!r} is overdue"
            assert charge.job_id is None or (charge.at, charge.job_id, charge.node_id) \
                in self.struck, f"{charge!r}: its own fault is no longer kept"
        entries: collections.Counter[int] = collections.Counter()
        for at, _, _, item in self.heap:
            if id(item) in live:
                entries[id(item)] += 1
                deadline = self.deadline(item)
                assert deadline is None or at <= deadline, "a heap entry is after its deadline"
        for job in self.jobs.values():
            for rank in job.ranks.values():
                self._check_timed(rank, entries[id(rank)])
        for node in self.nodes.values():
            self._check_timed(node, entries[id(node)])

    def _check_timed(self, item: RankHealth | NodeHealth, entries: int) -> None:
        assert entries == (1 if item.queued else 0), f"{item!r}: {entries} heap entries"
        deadline = self.deadline(item)
        if deadline is not None:
            assert item.queued, f"{item!r} is judged but has no deadline queued"
            assert not self.judging or deadline >= self.now, \
                f"{item!r} is overdue ({deadline} < {self.now})"



