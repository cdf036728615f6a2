"""What the health core hears and what it decides: its events and decisions. Pure.

Events are what the service saw (a job watched, a rank's start or exit, a progress
report, a heartbeat, an operator's uncordon or chaos, the bus lost or back), each a
frozen dataclass named for the sighting, not for the wire message it came in
(:class:`RankExitSeen`, not ``RankExited``); decisions are what the service is to do
(:class:`RaiseFault`, :class:`CordonNode` ...). The rules that connect them are
:class:`~phalanx.services.health.core.HealthCore`'s.
"""

from __future__ import annotations

import dataclasses
import math

from phalanx.schemas.messages import FaultKind, ReasonCode, RestartPolicy

EXIT_CAUSES = frozenset({"exited", "stopped", "lost", "launch_failed", "gpu_fault", "oom"})
DEFAULT_RESTART_POLICY = RestartPolicy()  # frozen: one instance serves every default


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
    admission: int = 0  # the record's (JobRecord.admission; 0: not known)

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
class JobUnwatched:
    """The job is no longer admitted (cancelled, preempted, finished): stop watching it."""

    job_id: str


@dataclasses.dataclass(frozen=True)
class RankStartSeen:
    """An agent started a rank's process; the rank is judged afresh from here."""

    job_id: str
    rank: int
    node_id: str
    pid: int
    replica_id: str | None = None
    admission: int = 0  # the job's admission it was started for (0: not known)


@dataclasses.dataclass(frozen=True)
class RankExitSeen:
    """A rank's process ended; ``cause`` is ``exited``, ``stopped``, ``lost``,
    ``launch_failed`` or ``gpu_fault`` (its agent killed it: its GPU failed, an
    infrastructure fault like a crash); ``detail`` is its error or last output, when it
    failed (a GPU fault's first line names the GPU and the fault);
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
    admission: int = 0  # the job's admission it was started for (0: not known)

    def __post_init__(self) -> None:
        if self.cause not in EXIT_CAUSES:
            raise ValueError(f"RankExitSeen cause must be one of {sorted(EXIT_CAUSES)}, "
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
    #: The generation the rank committed ``step`` in (None: not said).
    generation: int | None = None


@dataclasses.dataclass(frozen=True)
class MemberApplied:
    """Replica ``replica_id`` of a job switched to a generation and committed ``step``, its
    first step in it: past its start-up. Unlike a report, this comes from the stored
    job events, so a leader that heard none of the replica's reports (they went to a
    leader that died, or through a bus restart) still learns that it trains."""

    job_id: str
    replica_id: str
    step: int
    generation: int | None = None


@dataclasses.dataclass(frozen=True)
class HeartbeatSeen:
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


Event = (JobWatched | JobUnwatched | RankStartSeen | RankExitSeen | ProgressReported
         | MemberApplied | HeartbeatSeen | NodeUncordoned | ChaosInjected | WatchLost
         | WatchResumed)
EVENTS = (JobWatched, JobUnwatched, RankStartSeen, RankExitSeen, ProgressReported,
          MemberApplied, HeartbeatSeen, NodeUncordoned, ChaosInjected, WatchLost,
          WatchResumed)


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
    admission: int = 0  # the job's admission the rank was of (0: not known)


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
class JudgementHeld:
    """A mass silence began (``held``: no timeout is judged until a node is heard
    again), or ended (a node was heard: every node and rank has a full timeout from
    then)."""

    held: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class CordonNode:
    """The node faults too often: no new work on it until an operator uncordons it."""

    node_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FinishJob:
    """The job's training completed (:mod:`.core` rule 2), at ``step`` if a rank reported it."""

    job_id: str
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class FailJob:
    """The job's failures are past its restart policy (:mod:`.core` rule 8): it ends ``failed``."""

    job_id: str
    reason_code: ReasonCode
    reason: str


Decision = (RaiseFault | MarkNodeLost | MarkNodeAlive | JudgementHeld | CordonNode
            | FinishJob | FailJob)

