"""Gang admission rules: who runs, where, and why the rest wait. Pure.

A *gang* is a job's set of data-parallel replicas; each replica needs
``slots_per_replica`` slots on one node. The rules, applied by
:meth:`AdmissionCore.schedule` in one pass over the queue:

1. **Order.** Pending gangs are considered by priority weight (high first),
   then submission order. Preempted or requeued gangs keep their place.
2. **All or nothing.** A gang is admitted only when its smallest allowed size
   (``replicas.min`` unless its scaling rules, :mod:`.scaling`, say otherwise) of
   replicas can be placed at once on schedulable (alive, uncordoned) nodes
   matching its labels; with ``spread_failure_domains`` no domain gets more
   than ``ceil(n / domains)`` of its replicas. Placement is best-fit (the
   fullest node that still fits first) to keep large holes for large gangs.
3. **Quota.** A team may hold at most ``nominal + borrow_limit`` slots.
4. **Preemption.** A gang that does not fit may free room by taking slots
   from *victims*: lower-priority gangs of its own team, and gangs of teams
   that are borrowing (above nominal) when the preemptor's team is within
   its nominal quota after admission (reclaim) or the victim has lower
   priority. Elastic victims are first shrunk toward their ``min``, one allowed size
   at a time; whole
   gangs are evicted only after that, lowest priority and newest first, and
   victims that turn out unnecessary are spared. Never a partial gang.
5. **Reservation and backfill.** The first ``max_reservations`` gangs that
   still do not fit hold the free slots they would use, so slots freed later
   accumulate for them; gangs behind them are admitted only into what is not
   reserved (backfill). A big gang therefore cannot starve behind a stream
   of small ones, as long as running work ends.
6. **Elastic growth.** After the pass, gangs admitted in it get replicas up
   to ``replicas.max`` (or an operator's pin) from what is still free and
   unreserved, to the largest allowed size that reaches. Running gangs below
   that (shrunk when a node was lost or by preemption, or admitted small) grow
   back the same way (:class:`Grow`), by priority, but only when no gang waits
   for capacity — a waiting gang gets freed slots first — and only once the
   gang's growth cooldown since its last size change is over.
8. **Pins.** An operator may pin a running or pending elastic gang to one of
   its allowed sizes (:class:`ScalePinned`): it grows no further than the pin,
   and one above it shrinks to it at once (:class:`Shrink`); a pin of ``None``
   releases it. Preemption may still shrink a pinned gang below its pin.
9. **Scaling events.** Every size change of a running gang, pin and release is
   announced (:class:`~.changes.Announce`); a planned change is followed until
   the job's runtime runs at its size (:class:`MembershipChanged`) or abandoned
   at its ``scaling_timeout_s`` deadline, a growth then shrinking back
   (:mod:`.changes`).
7. **Timeouts.** A gang that waits in the queue longer than its
   ``schedule_timeout_s`` fails, with the reason it was waiting for; the wait
   starts at submission and again each time it is put back in the queue
   (preempted, or its node lost), so running time never counts against it.

Every pending gang has a reason (:class:`Reason`); gangs a pass did not
reach are "queued" behind the ones it did. Capacity changes are events:
a lost node requeues the gangs on it (or shrinks elastic ones that keep
their ``min``). The core is synchronous, takes ``now`` as an argument, and
never reads a clock or does I/O; the service persists its decisions.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import operator
from collections.abc import Callable, Iterable, Iterator

from phalanx.schemas.messages import (
    JobSpec,
    JobState,
    ReasonCode,
    ScalingChange,
    ScalingEventKind,
)
from phalanx.services.admission import changes
from phalanx.services.admission.changes import Announce
from phalanx.services.admission.policy import AdmissionPolicy, TeamQuota
from phalanx.services.admission.scaling import ScalingRules


class Reason:
    """A reason code and the one-line message a user sees.

    The message may be given as a function: a pass sets a reason on every gang it
    looks at, but only the few that are read (explain, persisted) get rendered.
    """

    __slots__ = ("_message", "code")

    def __init__(self, code: ReasonCode, message: str | Callable[[], str]) -> None:
        self.code = code
        self._message = message

    @property
    def message(self) -> str:
        if not isinstance(self._message, str):
            self._message = self._message()
        return self._message

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Reason) and self.code is other.code
                and self.message == other.message)

    def __hash__(self) -> int:
        return hash((self.code, self.message))

    def __repr__(self) -> str:
        return f"Reason({self.code.value!r}, {self.message!r})"


# --- events --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What a cluster could ever offer one gang: all its nodes' slots, and the most
    slots one node has (what "never fits" is judged against)."""

    total: int
    largest: int

    @classmethod
    def of(cls, slots: Iterable[int]) -> Capacity:
        counts = list(slots)
        return cls(sum(counts), max(counts, default=0))


@dataclasses.dataclass(frozen=True)
class JobSubmitted:
    job_id: str
    spec: JobSpec
    submitted_at: float
    event_id: str = ""
    pinned_replicas: int | None = None  # an operator's pin, kept in the job record
    change: ScalingChange | None = None  # a planned change in progress, kept there too


@dataclasses.dataclass(frozen=True)
class ScalePinned:
    """An operator pins a job to ``replicas`` (None: releases the pin). Check it with
    :meth:`AdmissionCore.pin_problem` first."""

    job_id: str
    replicas: int | None
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class MembershipChanged:
    """The job's runtime runs at ``world_size`` replicas now (elasticity published a
    generation of that size; None: it has no generation, e.g. it stopped)."""

    job_id: str
    world_size: int | None
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class JobCancelled:
    job_id: str
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class JobFinished:
    job_id: str
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class JobFailed:
    """Health ended the job ``failed`` (its failures are past its restart policy)."""

    job_id: str
    reason_code: ReasonCode
    reason: str
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class JobRequeued:
    """The running gang lost too many members to go on (elasticity): back to the queue."""

    job_id: str
    reason: str
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class NodeUpdated:
    """A node joined, changed, was cordoned/uncordoned, or was found lost (``alive=False``)."""

    node_id: str
    slots: int
    failure_domain: str
    labels: dict[str, str]
    alive: bool = True
    cordoned: bool = False
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class NodeRemoved:
    node_id: str
    event_id: str = ""


Event = (JobSubmitted | JobCancelled | JobFinished | JobFailed | JobRequeued | NodeUpdated
         | NodeRemoved | ScalePinned | MembershipChanged)


# --- decisions -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Admit:
    """Run the gang with one replica on each listed node (a node may repeat)."""

    job_id: str
    nodes: tuple[str, ...]
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Shrink:
    """Keep only the listed replicas' nodes (an elastic gang gives slots back)."""

    job_id: str
    nodes: tuple[str, ...]
    reason: Reason
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Evict:
    """Stop the whole gang; back to the queue if ``requeue``, else it is over."""

    job_id: str
    reason: Reason
    requeue: bool
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Fail:
    """The gang will not run: its final reason."""

    job_id: str
    reason: Reason
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Grow:
    """A running elastic gang gets more replicas: it now runs one on each listed node."""

    job_id: str
    nodes: tuple[str, ...]
    cause: str = ""


Decision = Admit | Shrink | Grow | Evict | Fail | Announce


def carry_slots(old_nodes: list[str], old_slots: list[int], new_nodes: list[str],
                next_slot: int = 0) -> list[int]:
    """Slot numbers for ``new_nodes``: an entry that stays keeps its slot (the k-th entry of
    a node keeps the k-th of that node's old slots); a new entry gets a fresh number, from
    ``next_slot`` on (numbers used before, by entries since dropped, are not reused)."""
    old_slots = old_slots or list(range(len(old_nodes)))
    free: dict[str, list[int]] = {}
    for node, slot in zip(old_nodes, old_slots, strict=True):
        free.setdefault(node, []).append(slot)
    fresh = max(max(old_slots, default=-1) + 1, next_slot)
    slots = []
    for node in new_nodes:
        if free.get(node):
            slots.append(free[node].pop(0))
        else:
            slots.append(fresh)
            fresh += 1
    return slots


# --- state ---------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Gang:
    job_id: str
    spec: JobSpec
    weight: int
    seq: int
    submitted_at: float
    state: JobState = JobState.PENDING
    nodes: list[str] = dataclasses.field(default_factory=list)
    reason: Reason = dataclasses.field(default_factory=lambda: Reason(
        ReasonCode.QUEUED, "waiting for the first admission pass"))
    reason_pass: int = 0
    admitted_seq: int = 0
    deadline: float | None = None  # schedule timeout of the current wait
    pinned: int | None = None  # an operator's pin: grow no further, shrink to it
    changed_at: float = 0.0  # the last size change: growth waits out the cooldown from it
    change: ScalingChange | None = None  # a planned size change in progress
    world_size: int | None = None  # the size its runtime last reported (None: none yet)
    # Copied out of the spec once: the pass reads them for every gang it looks at.
    team: str = dataclasses.field(init=False)
    per_replica: int = dataclasses.field(init=False)
    min_slots: int = dataclasses.field(init=False)
    rules: ScalingRules = dataclasses.field(init=False)
    shape: tuple = dataclasses.field(init=False)  # what admission depends on, besides order

    def __post_init__(self) -> None:
        spec = self.spec
        self.team = spec.team
        self.per_replica = spec.slots_per_replica
        self.rules = ScalingRules.of(spec)
        self.min_slots = self.rules.smallest * spec.slots_per_replica
        self.shape = (self.weight, self.team, spec.slots_per_replica, self.rules.smallest,
                      tuple(sorted(spec.placement.node_labels.items())),
                      spec.placement.spread_failure_domains)

    @property
    def slots(self) -> int:
        return len(self.nodes) * self.spec.slots_per_replica

    @property
    def smallest(self) -> int:
        """The size it is admitted at, and below which a planned change never takes it."""
        return self.rules.smallest

    @property
    def cap(self) -> int:
        """The size it may grow to: its pin, else its largest allowed size."""
        return self.rules.largest if self.pinned is None else self.pinned

    def order_key(self) -> tuple[int, int]:
        return (-self.weight, self.seq)


@dataclasses.dataclass
class Node:
    node_id: str
    slots: int
    failure_domain: str
    labels: dict[str, str]
    alive: bool = True
    cordoned: bool = False
    used: int = 0
    replicas: dict[str, int] = dataclasses.field(default_factory=dict)  # job -> replicas here

    @property
    def schedulable(self) -> bool:
        return self.alive and not self.cordoned

    @property
    def free(self) -> int:
        return self.slots - self.used if self.schedulable else 0

    def matches(self, spec: JobSpec) -> bool:
        return all(self.labels.get(k) == v for k, v in spec.placement.node_labels.items())


_ADMITTED_SEQ = operator.attrgetter("admitted_seq")


class SpecRejected(ValueError):
    """A job spec that can never be admitted here; the message names the field."""


class AdmissionCore:
    """The admission state machine. Feed events with :meth:`handle`, run :meth:`schedule`."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self.gangs: dict[str, Gang] = {}
        self.nodes: dict[str, Node] = {}
        self.queue: list[Gang] = []  # pending, in admission order
        self._queue_keys: list[tuple[int, int]] = []  # order_key() of each queue entry
        self._by_shape: dict[tuple, list[Gang]] = {}  # the queue split by Gang.shape
        self._shape_keys: dict[tuple, list[tuple[int, int]]] = {}
        self._shape_blocker: dict[tuple, Gang] = {}  # first gang of a shape the last pass held
        self.usage: dict[str, int] = {}  # team -> slots held
        self._by_free: dict[int, dict[str, None]] = {}  # free slots -> nodes (ordered set)
        self._free_total = 0
        self._seq = 0
        self._admissions = 0
        self.pass_no = 0
        self.running: dict[str, Gang] = {}  # admitted gangs
        self._running_tw: dict[str, dict[int, dict[str, Gang]]] = {}  # team -> weight -> gangs
        self._elastic: dict[str, Gang] = {}  # running gangs holding more than their min
        self._short: dict[str, Gang] = {}  # running gangs holding less than their max
        self._regrown_at = -1  # the _version of the last growth attempt
        self._regrow_due = math.inf  # when a gang held back by its cooldown may grow
        self._changing: dict[str, Gang] = {}  # gangs with a planned change in progress
        self._slots_by_weight: dict[int, int] = {}  # slots held by admitted gangs, per weight
        self._held: dict[str, dict[int, int]] = {}  # team -> weight -> slots held
        self._domain_cache: dict[tuple, int] = {}  # spread: matching domains per shape
        self._pending_by_team: dict[str, int] = {}
        self._fit_cache: dict[tuple, bool] = {}  # _could_ever_fit per shape; cleared on node change
        self._deadlines: list[tuple[float, int, Gang]] = []  # heap of schedule timeouts
        self._quotas: dict[str, TeamQuota] = {}
        self._version = 0  # bumped on every allocation change; keys the caches below
        self._free_sizes: tuple[int, list[int]] = (-1, [])
        self._preemptible: dict[tuple[str, int, bool], tuple[int, int]] = {}

    def _quota(self, team: str) -> TeamQuota:
        quota = self._quotas.get(team)
        if quota is None:
            quota = self._quotas[team] = self.policy.quota(team)
        return quota

    # --- validation ---------------------------------------------------------------------

    def validate(self, spec: JobSpec, registered: Capacity | None = None) -> None:
        """Refuse a spec that names an unknown class or could never fit this cluster.

        ``registered``: the slots of every registered node as the registry says them now
        (the service's view, which the core's event queue may lag while a pass runs);
        None: the nodes this core knows.

        Raises:
            SpecRejected: naming the field and the numbers.
        """
        if spec.priority_class not in self.policy.priority_classes:
            known = ", ".join(sorted(self.policy.priority_classes))
            raise SpecRejected(f"priority_class {spec.priority_class!r} is not one of: {known}")
        smallest = ScalingRules.of(spec).smallest
        field = "replicas.min" if smallest == spec.replicas.min else \
            "the smallest of scaling.replica_discrete_values"
        need = smallest * spec.slots_per_replica
        # Every registered node counts, silent or not: "never fits" must not follow from a
        # moment when heartbeats lag (a new leader, a loaded bus) — such a job waits, with
        # its reason, for the nodes to be heard again. A node leaves the count when it
        # leaves the registry.
        capacity = registered if registered is not None else \
            Capacity.of(n.slots for n in self.nodes.values())
        if need > capacity.total:
            raise SpecRejected(
                f"{field} x slots_per_replica = {smallest} x "
                f"{spec.slots_per_replica} = {need} slots, but the whole cluster has "
                f"{capacity.total}")
        if spec.slots_per_replica > capacity.largest:
            raise SpecRejected(f"slots_per_replica {spec.slots_per_replica} exceeds every "
                               "node's slots")
        ceiling = self._quota(spec.team).ceiling
        if need > ceiling:
            raise SpecRejected(f"needs {need} slots but team {spec.team!r} may hold at most "
                               f"{ceiling:g}")

    # --- events -------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Decision]:
        """Apply one event; returns the decisions it forces at once (not an admission pass)."""
        match event:
            case JobSubmitted():
                return self._submitted(event)
            case JobCancelled():
                return self._ended(event.job_id, JobState.CANCELLED, event.event_id)
            case JobFinished():
                return self._ended(event.job_id, JobState.FINISHED, event.event_id)
            case JobFailed():
                return self._ended(event.job_id, JobState.FAILED, event.event_id,
                                   Reason(event.reason_code, event.reason))
            case JobRequeued():
                return self._requeued(event, now)
            case NodeUpdated():
                return self._node_updated(event, now)
            case NodeRemoved():
                return self._node_gone(event.node_id, event.event_id, now, remove=True)
            case ScalePinned():
                return self._pinned(event, now)
            case MembershipChanged():
                return self._membership(event)
        raise TypeError(f"unknown event {event!r}")

    def pin_problem(self, job_id: str, replicas: int | None) -> str | None:
        """Why ``job_id`` cannot be pinned to ``replicas`` now (None: it can).

        Raises:
            KeyError: unknown job.
        """
        gang = self.gangs[job_id]
        if gang.state.terminal:
            return f"{job_id} is {gang.state.value}"
        if replicas is None:
            return None
        if gang.rules.largest == gang.rules.smallest:
            return f"{job_id} is rigid: it runs {gang.rules.smallest} replica(s)"
        return gang.rules.pin_problem(replicas)

    def _pinned(self, event: ScalePinned, now: float) -> list[Decision]:
        gang = self.gangs.get(event.job_id)
        if gang is None or self.pin_problem(event.job_id, event.replicas) is not None:
            return []
        gang.pinned = event.replicas
        self._track_elastic(gang)
        self._regrown_at = -1  # a released pin may let it grow now
        size = len(gang.nodes)
        decisions: list[Decision] = [
            Announce(gang.job_id, ScalingEventKind.RELEASE, size, size,
                     "pin released: admission sizes it", cause=event.event_id)
            if event.replicas is None else
            Announce(gang.job_id, ScalingEventKind.PIN, size, event.replicas,
                     f"pinned to {event.replicas} replica(s)", cause=event.event_id)]
        if event.replicas is None or size <= event.replicas:
            return decisions
        self._release(gang, gang.nodes[event.replicas:])
        gang.changed_at = now
        reason = Reason(ReasonCode.SCALED, f"pinned to {event.replicas} replica(s)")
        return [*decisions, self._shrunk(gang, reason, event.event_id),
                *self._resized(gang, ScalingEventKind.SHRINK, size, reason, now,
                               event.event_id)]

    def _membership(self, event: MembershipChanged) -> list[Decision]:
        gang = self.gangs.get(event.job_id)
        if gang is None or gang.state is not JobState.ADMITTED:
            return []
        gang.world_size = event.world_size
        change, announced = changes.applied(gang.job_id, gang.change, event.world_size,
                                            event.event_id)
        self._follow(gang, change)
        return list(announced)

    def _resized(self, gang: Gang, kind: ScalingEventKind, before: int, reason: Reason,
                 now: float, cause: str, *, planned: bool = True) -> list[Decision]:
        """``gang`` went from ``before`` replicas to its size now: announce it, and follow
        it if planned (a later change replaces one in progress)."""
        change, announced = changes.begin(
            gang.job_id, kind, before, len(gang.nodes), reason.message, planned=planned,
            world_size=gang.world_size, timeout_s=gang.spec.scaling.scaling_timeout_s,
            now=now, cause=cause)
        self._follow(gang, change)
        return list(announced)

    def _follow(self, gang: Gang, change: ScalingChange | None) -> None:
        gang.change = change
        if change is None:
            self._changing.pop(gang.job_id, None)
        else:
            self._changing[gang.job_id] = gang

    def _abandon_overdue(self, now: float) -> list[Decision]:
        """Planned changes past their deadline: reported, and a growth shrinks back."""
        decisions: list[Decision] = []
        for gang in [g for g in self._changing.values() if changes.overdue(g.change, now)]:
            change = gang.change
            assert change is not None
            timeout_s = gang.spec.scaling.scaling_timeout_s
            announced = changes.abandoned(gang.job_id, change, timeout_s, "scaling-timeout")
            decisions.append(announced)
            self._follow(gang, None)
            size = len(gang.nodes)
            if change.kind is not ScalingEventKind.GROW or size <= change.from_replicas:
                continue
            self._release(gang, gang.nodes[change.from_replicas:])
            gang.changed_at = now
            reason = Reason(ReasonCode.SCALED, announced.reason)
            decisions += [self._shrunk(gang, reason, "scaling-timeout"),
                          *self._resized(gang, ScalingEventKind.SHRINK, size, reason, now,
                                         "scaling-timeout")]
        return decisions

    def _submitted(self, event: JobSubmitted) -> list[Decision]:
        if event.job_id in self.gangs:
            return []  # a replayed submission: already known
        weight = self.policy.priority_classes.get(event.spec.priority_class)
        self._seq += 1
        gang = Gang(event.job_id, event.spec, weight if weight is not None else 0, self._seq,
                    event.submitted_at, pinned=event.pinned_replicas)
        self.gangs[gang.job_id] = gang
        if weight is None:
            gang.state = JobState.FAILED
            gang.reason = Reason(ReasonCode.UNSCHEDULABLE,
                                      f"unknown priority class {event.spec.priority_class!r}")
            return [Fail(gang.job_id, gang.reason, event.event_id)]
        self._enqueue(gang, event.submitted_at)
        return []

    def restore(self, event: JobSubmitted, nodes: list[str],
                now: float = 0.0) -> list[Decision]:
        """Rebuild a gang the ledger says runs on ``nodes`` (a new leader loading state).

        Call after the nodes are known. A gang whose nodes are gone, lost or now too
        small goes back to the queue (returned as an :class:`Evict`).
        """
        decisions = self._submitted(event)
        gang = self.gangs[event.job_id]
        if gang.state is not JobState.PENDING or not nodes:
            return decisions
        need: dict[str, int] = {}
        for node_id in nodes:
            need[node_id] = need.get(node_id, 0) + gang.per_replica
        if all(node_id in self.nodes and self.nodes[node_id].alive
               and self.nodes[node_id].slots - self.nodes[node_id].used >= slots
               for node_id, slots in need.items()):
            self._admit(gang, list(nodes))
            gang.changed_at = now  # a new leader waits out a cooldown before growing it
            self._follow(gang, event.change)  # done or abandoned as if it had not left
            return decisions
        gang.reason = Reason(ReasonCode.NODE_LOST, f"a node of its placement {sorted(need)} "
                                                   "is gone or full after a leader change")
        return [*decisions, Evict(gang.job_id, gang.reason, requeue=True, cause=event.event_id)]

    def _ended(self, job_id: str, state: JobState, cause: str,
               reason: Reason | None = None) -> list[Decision]:
        gang = self.gangs.get(job_id)
        if gang is None or gang.state not in (JobState.PENDING, JobState.ADMITTED):
            return []
        decisions: list[Decision] = []
        if gang.state is JobState.ADMITTED:
            self._release(gang, list(gang.nodes))
            decisions.append(Evict(job_id, reason or Reason(ReasonCode(state.value), state.value),
                                   requeue=False, cause=cause))
        else:
            self._dequeue(gang)
        gang.state = state
        gang.reason = reason or Reason(ReasonCode(state.value), "cancelled by request"
                                       if state is JobState.CANCELLED else state.value)
        return decisions

    def _node_updated(self, event: NodeUpdated, now: float) -> list[Decision]:
        self._fit_cache.clear()
        self._domain_cache.clear()
        node = self.nodes.get(event.node_id)
        if node is None:
            node = Node(event.node_id, event.slots, event.failure_domain, dict(event.labels))
            self.nodes[node.node_id] = node
        else:
            self._index_remove(node)
            node.slots, node.failure_domain = event.slots, event.failure_domain
            node.labels = dict(event.labels)
        node.alive, node.cordoned = event.alive, event.cordoned
        self._index_add(node)
        if not node.alive:
            return self._node_gone(node.node_id, event.event_id, now, remove=False)
        decisions: list[Decision] = []
        # A node that shrank below what runs on it gives back its newest gangs.
        while node.used > node.slots:
            newest = max((self.gangs[j] for j in node.replicas), key=lambda g: g.admitted_seq)
            decisions += self._evict_for_node(newest, node, event.event_id, now,
                                              f"node {node.node_id} shrank to {node.slots} slots")
        return decisions

    def _node_gone(self, node_id: str, cause: str, now: float, *,
                   remove: bool) -> list[Decision]:
        self._fit_cache.clear()
        self._domain_cache.clear()
        node = self.nodes.get(node_id)
        if node is None:
            return []
        decisions: list[Decision] = []
        for job_id in list(node.replicas):
            decisions += self._evict_for_node(self.gangs[job_id], node, cause, now,
                                              f"node {node_id} lost")
        if remove:
            self._index_remove(node)
            del self.nodes[node_id]
        return decisions

    def _requeued(self, event: JobRequeued, now: float) -> list[Decision]:
        gang = self.gangs.get(event.job_id)
        if gang is None or gang.state is not JobState.ADMITTED:
            return []  # not running (any more): nothing to give back
        self._release(gang, list(gang.nodes))
        gang.state = JobState.PENDING
        gang.reason = Reason(ReasonCode.MEMBERS_LOST, event.reason)
        self._enqueue(gang, now)
        return [Evict(gang.job_id, gang.reason, requeue=True, cause=event.event_id)]

    def _evict_for_node(self, gang: Gang, node: Node, cause: str, now: float,
                        why: str) -> list[Decision]:
        """Shrink ``gang`` off ``node`` to the largest allowed size the rest of its replicas
        hold, else requeue it whole."""
        keep = [n for n in gang.nodes if n != node.node_id]
        reason = Reason(ReasonCode.NODE_LOST, why)
        size = gang.rules.at_most(len(keep))
        if size is not None:
            before = len(gang.nodes)
            self._release(gang, [n for n in gang.nodes if n == node.node_id])
            if len(gang.nodes) > size:  # also give back what an allowed size does not use
                self._release(gang, gang.nodes[size:])
            gang.changed_at = now
            return [self._shrunk(gang, reason, cause),
                    *self._resized(gang, ScalingEventKind.SHRINK, before, reason, now, cause,
                                   planned=False)]
        self._release(gang, list(gang.nodes))
        gang.state = JobState.PENDING
        gang.reason = reason
        self._enqueue(gang, now)
        return [Evict(gang.job_id, reason, requeue=True, cause=cause)]

    def expire(self, now: float) -> list[Decision]:
        """Fail pending gangs that waited longer than their ``schedule_timeout_s``."""
        decisions: list[Decision] = []
        while self._deadlines and self._deadlines[0][0] < now:
            deadline, _, gang = heapq.heappop(self._deadlines)
            if gang.state is JobState.PENDING and gang.deadline == deadline:
                timeout = gang.spec.schedule_timeout_s
                self._dequeue(gang)
                last = gang.reason.message
                gang.state = JobState.FAILED
                gang.reason = Reason(ReasonCode.TIMEOUT,
                                     f"not admitted within {timeout:g} s; last waiting for: {last}")
                decisions.append(Fail(gang.job_id, gang.reason, "timeout"))
        return decisions

    # --- the admission pass -------------------------------------------------------------

    def schedule(self, now: float) -> list[Decision]:
        """One admission pass over the queue (see the module docstring for the rules)."""
        self.pass_no += 1
        cause = f"pass-{self.pass_no}"
        decisions: list[Decision] = self.expire(now)
        if self._changing:
            decisions += self._abandon_overdue(now)
        reserved: dict[str, int] = {}
        reserved_total = 0
        holders: list[str] = []
        waiting_for_capacity = False  # a reached gang waits for slots: none to grow into
        admitted: list[Gang] = []
        lowest_running = min((w for w, s in self._slots_by_weight.items() if s), default=None)
        reclaimers = self._reclaimers()
        # The queue is walked in order, merged from per-shape queues: once a gang fails,
        # every later gang of the same shape (team, priority, size, constraints) would fail
        # for the same reason in this pass, so the rest of that shape is skipped at once.
        heap = [(keys[0], shape) for shape, keys in self._shape_keys.items() if keys]
        heapq.heapify(heap)
        blocked: set[tuple] = set()
        while heap:
            key, shape = heapq.heappop(heap)
            if shape in blocked:
                continue
            keys = self._shape_keys.get(shape, [])
            j = bisect.bisect_left(keys, key)
            if j == len(keys):
                continue  # the shape's queue emptied during the pass
            gang = self._by_shape[shape][j]
            if keys[j] != key:  # that gang left the queue; resume at its successor
                heapq.heappush(heap, (keys[j], shape))
                continue
            quota = self._quota(gang.team)
            used = self.usage.get(gang.team, 0)
            free_now = self._free_total - reserved_total
            if free_now <= 0 and (lowest_running is None or gang.weight <= lowest_running):
                # Nothing free and nothing of lower priority to preempt: only a team under
                # its nominal quota may still reclaim borrowed slots.
                if not reclaimers:
                    break  # the rest stay queued
                if gang.team not in reclaimers or used + gang.min_slots > quota.nominal:
                    blocked.add(shape)
                    gang.reason_pass = self.pass_no
                    self._shape_blocker[shape] = gang
                    if used + gang.min_slots > quota.ceiling:
                        gang.reason = Reason(ReasonCode.QUOTA, self._quota_message(gang, used))
                    elif not self._could_ever_fit(gang):
                        gang.reason = Reason(ReasonCode.UNSCHEDULABLE,
                                             self._unschedulable_message(gang))
                    else:
                        gang.reason = Reason(ReasonCode.INSUFFICIENT_CAPACITY, (
                            f"needs {self._need_text(gang)}; no slot is free and none is held "
                            f"by lower-priority work it may preempt; teams under their "
                            f"nominal quota are reclaiming borrowed slots first"))
                    continue
            gang.reason_pass = self.pass_no
            quota_ok = used + gang.min_slots <= quota.ceiling
            victims: list[tuple[Gang, int]] | None = None
            nodes = (self._place(gang, gang.smallest, reserved)
                     if quota_ok and gang.min_slots <= free_now else None)
            # A gang that would not fit an empty cluster gains nothing from victims: planning
            # them anyway walks every running gang for each such shape in every pass.
            if (nodes is None and self._could_ever_fit(gang)
                    and self._preemption_may_help(gang, free_now)):
                victims = self._plan_preemption(gang, reserved)
                if victims is not None:
                    decisions += self._preempt(victims, gang, cause, now)
                    nodes = self._place(gang, gang.smallest, reserved)
                    assert nodes is not None, "preemption plan promised room"
            if nodes is not None:
                self._admit(gang, nodes)
                admitted.append(gang)
                reclaimers = self._reclaimers()
                if j < len(keys):
                    heapq.heappush(heap, (keys[j], shape))
                # Evicted victims are queued again, possibly ahead of this gang: give them
                # a look in this pass, so they may land elsewhere at once.
                for victim, _ in victims or ():
                    if victim.state is JobState.PENDING:
                        blocked.discard(victim.shape)
                        heapq.heappush(heap, (victim.order_key(), victim.shape))
                continue
            blocked.add(shape)
            self._shape_blocker[shape] = gang
            if not quota_ok:
                gang.reason = Reason(ReasonCode.QUOTA, self._quota_message(gang, used))
            elif not self._could_ever_fit(gang):
                gang.reason = Reason(ReasonCode.UNSCHEDULABLE, self._unschedulable_message(gang))
            elif len(holders) < self.policy.max_reservations:
                holders.append(gang.job_id)
                held = self._reserve(gang, reserved)
                reserved_total += held
                gang.reason = Reason(ReasonCode.RESERVED, (
                    f"needs {self._need_text(gang)}; holding {held} freed slot(s) for it "
                    f"until {gang.min_slots - held} more free up"))
                blocked.discard(shape)  # the next of its shape may still backfill elsewhere
                if j + 1 < len(keys):
                    heapq.heappush(heap, (keys[j + 1], shape))
            else:
                waiting_for_capacity = True
                gang.reason = Reason(
                    ReasonCode.INSUFFICIENT_CAPACITY,
                    lambda g=gang, f=free_now, h=tuple(holders): self._capacity_message(g, f, h))
        for gang in dict.fromkeys(admitted):  # a gang may be admitted, evicted, re-admitted
            if gang.state is not JobState.ADMITTED:
                continue  # admitted earlier in this pass, then preempted by a reclaim
            self._grow(gang, reserved)
            gang.changed_at = now
            self._admitted_reason(gang)
            decisions.append(Admit(gang.job_id, tuple(gang.nodes), cause))
        # Growth is tried only with free slots nobody waits for, and once per allocation
        # state (a pass that changed nothing would find what the last one found) or when a
        # gang's cooldown ends.
        if self._short and not holders and not waiting_for_capacity \
                and self._free_total > 0 and (self._regrown_at != self._version
                                              or now >= self._regrow_due):
            decisions += self._regrow({g.job_id for g in admitted}, cause, now)
            self._regrown_at = self._version
        return decisions

    def _regrow(self, admitted: set[str], cause: str, now: float) -> list[Decision]:
        """Running gangs below their cap take free slots back, highest priority first; a
        gang within its cooldown is skipped and looked at again when it ends."""
        grown: list[Decision] = []
        self._regrow_due = math.inf
        for gang in sorted(self._short.values(), key=Gang.order_key):
            if self._free_total <= 0:
                break
            if gang.job_id in admitted:
                continue  # grew with its Admit
            if not gang.rules.may_grow(gang.changed_at, now):
                self._regrow_due = min(self._regrow_due, gang.changed_at + gang.rules.cooldown_s)
                continue
            before = len(gang.nodes)
            self._grow(gang, {})
            if len(gang.nodes) > before:
                gang.changed_at = now
                self._admitted_reason(gang)
                grown.append(Grow(gang.job_id, tuple(gang.nodes), cause))
                why = "free slots" if gang.pinned is None else \
                    f"free slots, toward its pin of {gang.pinned}"
                grown += self._resized(gang, ScalingEventKind.GROW, before,
                                       Reason(ReasonCode.ADMITTED, f"grew into {why}"), now,
                                       cause)
        return grown

    def _reclaimers(self) -> set[str]:
        """Teams below their nominal quota with gangs waiting, while any team borrows."""
        if not any(used > self._quota(t).nominal for t, used in self.usage.items()):
            return set()
        return {t for t, n in self._pending_by_team.items()
                if n and self.usage.get(t, 0) < self._quota(t).nominal}

    def step(self, events: Iterable[Event], now: float) -> list[Decision]:
        """Apply ``events`` then run one pass: what the service does per batch."""
        decisions: list[Decision] = []
        for event in events:
            decisions += self.handle(event, now)
        return decisions + self.schedule(now)

    # --- placement ----------------------------------------------------------------------

    def _candidates(self, gang: Gang, reserved: dict[str, int]) -> Iterator[tuple[Node, int]]:
        """Schedulable matching nodes with room for a replica, fullest first, and their room."""
        k = gang.per_replica
        if self._free_sizes[0] != self._version:
            self._free_sizes = (self._version, sorted(self._by_free))
        sizes = self._free_sizes[1]
        for free in sizes[bisect.bisect_left(sizes, k):]:
            for node_id in self._by_free[free]:
                node = self.nodes[node_id]
                room = free - reserved.get(node_id, 0)
                if room >= k and node.matches(gang.spec):
                    yield node, room

    def _place(self, gang: Gang, replicas: int, reserved: dict[str, int],
               existing: Iterable[str] = ()) -> list[str] | None:
        """Nodes for ``replicas`` more replicas of ``gang`` (all or None)."""
        k = gang.per_replica
        cap = math.inf
        per_domain: dict[str, int] = {}
        if gang.spec.placement.spread_failure_domains:
            total = replicas + len(list(existing))
            cap = math.ceil(total / max(1, self._domains(gang)))
            for node_id in existing:
                domain = self.nodes[node_id].failure_domain
                per_domain[domain] = per_domain.get(domain, 0) + 1
        chosen: list[str] = []
        for node, room in self._candidates(gang, reserved):
            domain = node.failure_domain
            take = min(room // k, replicas - len(chosen), cap - per_domain.get(domain, 0))
            if take > 0:
                chosen += [node.node_id] * int(take)
                per_domain[domain] = per_domain.get(domain, 0) + int(take)
                if len(chosen) == replicas:
                    return chosen
        return None

    def _domains(self, gang: Gang) -> int:
        """How many failure domains have a schedulable node that could host a replica (cached)."""
        labels = tuple(sorted(gang.spec.placement.node_labels.items()))
        key = (gang.per_replica, labels)
        count = self._domain_cache.get(key)
        if count is None:
            count = self._domain_cache[key] = len({
                n.failure_domain for n in self.nodes.values()
                if n.schedulable and n.matches(gang.spec) and n.slots >= gang.per_replica})
        return count

    def _reserve(self, gang: Gang, reserved: dict[str, int]) -> int:
        """Hold free slots for ``gang`` on the nodes it will land on; returns slots held.

        The target nodes are the matching ones with the most free slots, taken until
        they could host the gang's smallest size once empty (at most a fair share per
        failure domain for a spread gang). Everything free on them is held, even less
        than a replica, so slots freed there a few at a time add up to whole replicas
        instead of being backfilled away. Held slots only grow on the targets, so the
        same nodes stay the targets from pass to pass.
        """
        k = gang.per_replica
        n = gang.smallest
        share = (math.ceil(n / max(1, self._domains(gang)))
                 if gang.spec.placement.spread_failure_domains else n)
        per_domain: dict[str, int] = {}
        held = assigned = 0
        for free in sorted(self._by_free, reverse=True):
            for node_id in self._by_free[free]:
                node = self.nodes[node_id]
                room = free - reserved.get(node_id, 0)
                if room <= 0 or node.slots < k or not node.matches(gang.spec):
                    continue
                domain = node.failure_domain
                replicas = min(node.slots // k, n - assigned, share - per_domain.get(domain, 0))
                if replicas <= 0:
                    continue
                take = min(room, replicas * k)
                reserved[node_id] = reserved.get(node_id, 0) + take
                per_domain[domain] = per_domain.get(domain, 0) + replicas
                held += take
                assigned += replicas
                if assigned >= n:
                    return held
        return held

    def _could_ever_fit(self, gang: Gang) -> bool:
        """Would ``gang`` fit if every matching schedulable node were empty? (cached)"""
        fits = self._fit_cache.get(gang.shape)
        if fits is None:
            fits = self._fit_cache[gang.shape] = self._could_fit_empty(gang)
        return fits

    def _could_fit_empty(self, gang: Gang) -> bool:
        k = gang.per_replica
        by_domain: dict[str, int] = {}
        for node in self.nodes.values():
            if node.schedulable and node.slots >= k and node.matches(gang.spec):
                by_domain[node.failure_domain] = (by_domain.get(node.failure_domain, 0)
                                                  + node.slots // k)
        n = gang.smallest
        if gang.spec.placement.spread_failure_domains and by_domain:
            cap = math.ceil(n / len(by_domain))
            return sum(min(c, cap) for c in by_domain.values()) >= n
        return sum(by_domain.values()) >= n

    def _grow(self, gang: Gang, reserved: dict[str, int]) -> None:
        """Give an elastic gang extra replicas from unreserved free slots, up to the largest
        allowed size within its cap that they reach (none if they reach no allowed size)."""
        ceiling = self._quota(gang.team).ceiling
        before = len(gang.nodes)
        added: list[str] = []
        while before + len(added) < gang.cap:
            if self.usage.get(gang.team, 0) + gang.per_replica > ceiling:
                break
            extra = self._place(gang, 1, reserved, existing=gang.nodes)
            if extra is None:
                break
            self._allocate(gang, extra)
            added += extra
        target = gang.rules.grow_target(before, before + len(added), gang.cap) or before
        if len(gang.nodes) > target:
            self._release(gang, gang.nodes[target:])

    # --- preemption ---------------------------------------------------------------------

    def _preemption_may_help(self, gang: Gang, free: int) -> bool:
        """A cheap upper bound: could free slots plus every slot ``gang`` may take hold it?"""
        reclaim = (self.usage.get(gang.team, 0) + gang.min_slots
                   <= self._quota(gang.team).nominal)
        key = (gang.team, gang.weight, reclaim)
        cached = self._preemptible.get(key)
        if cached is None or cached[0] != self._version:
            total = 0
            for team, held in self._held.items():
                if team != gang.team and self.usage.get(team, 0) <= self._quota(team).nominal:
                    continue  # not borrowing: untouchable
                everything = reclaim and team != gang.team
                total += sum(s for w, s in held.items() if everything or w < gang.weight)
            cached = self._preemptible[key] = (self._version, total)
        return free + cached[1] >= gang.min_slots

    def _plan_preemption(self, gang: Gang,
                         reserved: dict[str, int]) -> list[tuple[Gang, int]] | None:
        """Victims (gang, replicas to take) that make room for ``gang``, or None.

        Tries shrinking elastic victims before evicting whole gangs; simulates on
        the live state and undoes every change before returning.
        """
        reclaim = (self.usage.get(gang.team, 0) + gang.min_slots
                   <= self._quota(gang.team).nominal)
        taken: list[tuple[Gang, list[str]]] = []
        ceiling = self._quota(gang.team).ceiling
        labels = gang.spec.placement.node_labels
        need = gang.min_slots - (self._free_total - sum(reserved.values()))

        def useful(nodes: list[str]) -> int:
            """Slots freed on nodes the gang could use (a cheap gate before placing)."""
            if not labels:
                return len(nodes)
            return sum(1 for n in nodes if self.nodes[n].matches(gang.spec))

        def fits() -> bool:
            return (need <= 0 and self.usage.get(gang.team, 0) + gang.min_slots <= ceiling
                    and self._place(gang, gang.smallest, reserved) is not None)

        def take(victim: Gang, count: int) -> list[str]:
            nonlocal need
            nodes = list(victim.nodes) if count < 0 else victim.nodes[-count:]
            self._release(victim, nodes)
            need -= useful(nodes) * victim.per_replica
            return nodes

        try:
            # _victims() yields only gangs ``gang`` may take by team and priority; what
            # can change while taking is whether another team still borrows.
            nominal = {t: self._quota(t).nominal for t in self._running_tw}
            usage = self.usage
            for victim, count in self._victims(gang, reclaim):
                team = victim.team
                if not victim.nodes or (team != gang.team
                                        and usage.get(team, 0) <= nominal[team]):
                    continue
                taken.append((victim, take(victim, count)))
                if fits():
                    break
            else:
                return None
            # Spare victims that turned out unnecessary, most valuable first.
            need = 0  # from here on fits() must place for real
            for i in range(len(taken) - 2, -1, -1):
                victim, nodes = taken[i]
                if any(later is victim for later, _ in taken[i + 1:]):
                    continue  # only a victim's last step down may be spared: sizes stay allowed
                self._allocate(victim, nodes)
                if fits():
                    taken.pop(i)
                else:
                    self._release(victim, nodes)
            plan: dict[str, tuple[Gang, int]] = {}
            for victim, nodes in taken:
                prev = plan.get(victim.job_id, (victim, 0))[1]
                plan[victim.job_id] = (victim, prev + len(nodes))
            return list(plan.values())
        finally:
            for victim, nodes in reversed(taken):
                self._allocate(victim, nodes)

    def _victims(self, gang: Gang, reclaim: bool) -> Iterator[tuple[Gang, int]]:
        """Preemption steps in order: shrink elastic extras, then evict whole gangs.

        Each in order of priority (lowest first), then newest first; built lazily,
        weight by weight, since a plan rarely needs more than the lowest.
        """
        def eligible(team: str) -> Callable[[int], bool] | None:
            if team == gang.team:
                return lambda w: w < gang.weight
            if self.usage.get(team, 0) <= self._quota(team).nominal:
                return None  # not borrowing: its slots are its own
            return (lambda w: True) if reclaim else (lambda w: w < gang.weight)

        rules = {t: rule for t in self._running_tw if (rule := eligible(t)) is not None}
        weights = sorted({w for t in rules for w, gangs in self._running_tw[t].items()
                          if gangs and rules[t](w)})

        def by_weight() -> Iterator[Gang]:
            for w in weights:
                bucket = [g for t in rules if rules[t](w)
                          for g in self._running_tw[t].get(w, {}).values()]
                yield from sorted(bucket, key=_ADMITTED_SEQ, reverse=True)

        extras = sorted((g for g in self._elastic.values() if g.team in rules
                         and rules[g.team](g.weight)),
                        key=lambda g: (g.weight, -g.admitted_seq))
        for victim in extras:  # one allowed size at a time: a shrink takes only what is needed
            size = len(victim.nodes)
            while (lower := victim.rules.step_down(size)) is not None:
                yield victim, size - lower
                size = lower
        for victim in by_weight():
            yield victim, -1  # -1: evict whatever it still holds

    def _preempt(self, victims: list[tuple[Gang, int]], gang: Gang, cause: str,
                 now: float) -> list[Decision]:
        decisions: list[Decision] = []
        why = (f"preempted for {gang.job_id} (priority {gang.spec.priority_class}, "
               f"team {gang.team})")
        for victim, count in victims:
            reason = Reason(ReasonCode.PREEMPTED, why)
            victim.changed_at = now
            if len(victim.nodes) - count >= victim.smallest:
                before = len(victim.nodes)
                self._release(victim, victim.nodes[-count:])
                decisions.append(self._shrunk(victim, reason, cause))
                decisions += self._resized(victim, ScalingEventKind.SHRINK, before, reason,
                                           now, cause)
            else:
                self._release(victim, list(victim.nodes))
                victim.state = JobState.PENDING
                victim.reason = reason
                self._enqueue(victim, now)
                decisions.append(Evict(victim.job_id, reason, requeue=True, cause=cause))
        return decisions

    # --- bookkeeping --------------------------------------------------------------------

    def _admit(self, gang: Gang, nodes: list[str]) -> None:
        self._dequeue(gang)
        gang.state = JobState.ADMITTED
        self._admissions += 1
        gang.admitted_seq = self._admissions
        self._allocate(gang, nodes)
        self._admitted_reason(gang)

    def _admitted_reason(self, gang: Gang) -> None:
        gang.reason = Reason(ReasonCode.ADMITTED, f"running {len(gang.nodes)} replica(s) on "
                                                  f"{len(set(gang.nodes))} node(s)")

    def _shrunk(self, gang: Gang, why: Reason, cause: str) -> Shrink:
        """A running gang gave replicas back: its record says why, with the reason's code
        (elasticity tells a planned shrink, whose members leave, from a node lost)."""
        gang.reason = Reason(why.code, f"running {len(gang.nodes)} replica(s) on "
                                       f"{len(set(gang.nodes))} node(s); shrunk: {why.message}")
        return Shrink(gang.job_id, tuple(gang.nodes), why, cause)

    def _allocate(self, gang: Gang, nodes: list[str]) -> None:
        for node_id in nodes:
            node = self.nodes[node_id]
            self._index_remove(node)
            node.used += gang.per_replica
            node.replicas[gang.job_id] = node.replicas.get(gang.job_id, 0) + 1
            self._index_add(node)
        gang.nodes.extend(nodes)
        slots = len(nodes) * gang.per_replica
        self.usage[gang.team] = self.usage.get(gang.team, 0) + slots
        self._slots_by_weight[gang.weight] = self._slots_by_weight.get(gang.weight, 0) + slots
        held = self._held.setdefault(gang.team, {})
        held[gang.weight] = held.get(gang.weight, 0) + slots
        if gang.nodes:
            self.running[gang.job_id] = gang
            self._running_tw.setdefault(gang.team, {}).setdefault(
                gang.weight, {})[gang.job_id] = gang
        self._track_elastic(gang)

    def _release(self, gang: Gang, nodes: list[str]) -> None:
        for node_id in nodes:
            gang.nodes.remove(node_id)
            node = self.nodes[node_id]
            self._index_remove(node)
            node.used -= gang.per_replica
            node.replicas[gang.job_id] -= 1
            if not node.replicas[gang.job_id]:
                del node.replicas[gang.job_id]
            self._index_add(node)
        slots = len(nodes) * gang.per_replica
        self.usage[gang.team] -= slots
        self._slots_by_weight[gang.weight] -= slots
        self._held[gang.team][gang.weight] -= slots
        if not gang.nodes:
            self.running.pop(gang.job_id, None)
            self._running_tw[gang.team][gang.weight].pop(gang.job_id, None)
            self._follow(gang, None)  # evicted or ended: no change left to follow
            gang.world_size = None
        self._track_elastic(gang)

    def _track_elastic(self, gang: Gang) -> None:
        if len(gang.nodes) > gang.smallest:
            self._elastic[gang.job_id] = gang
        else:
            self._elastic.pop(gang.job_id, None)
        if gang.nodes and len(gang.nodes) < gang.cap:
            self._short[gang.job_id] = gang
        else:
            self._short.pop(gang.job_id, None)

    def _index_add(self, node: Node) -> None:
        self._version += 1
        if node.free > 0:
            self._by_free.setdefault(node.free, {})[node.node_id] = None
            self._free_total += node.free

    def _index_remove(self, node: Node) -> None:
        self._version += 1
        bucket = self._by_free.get(node.free)
        if bucket is not None and node.node_id in bucket:
            del bucket[node.node_id]
            if not bucket:
                del self._by_free[node.free]
            self._free_total -= node.free

    def _enqueue(self, gang: Gang, now: float) -> None:
        """Queue ``gang`` in order; its schedule timeout runs from ``now`` (each requeue anew)."""
        if gang.spec.schedule_timeout_s is not None:
            gang.deadline = now + gang.spec.schedule_timeout_s
            heapq.heappush(self._deadlines, (gang.deadline, gang.seq, gang))
        key = gang.order_key()
        i = bisect.bisect(self._queue_keys, key)
        self._queue_keys.insert(i, key)
        self.queue.insert(i, gang)
        keys = self._shape_keys.setdefault(gang.shape, [])
        j = bisect.bisect(keys, key)
        keys.insert(j, key)
        self._by_shape.setdefault(gang.shape, []).insert(j, gang)
        self._pending_by_team[gang.team] = self._pending_by_team.get(gang.team, 0) + 1

    def _queue_index(self, gang: Gang) -> int:
        return bisect.bisect_left(self._queue_keys, gang.order_key())

    def _dequeue(self, gang: Gang) -> None:
        i = self._queue_index(gang)
        assert self.queue[i] is gang
        del self.queue[i]
        del self._queue_keys[i]
        keys = self._shape_keys[gang.shape]
        j = bisect.bisect_left(keys, gang.order_key())
        del keys[j]
        del self._by_shape[gang.shape][j]
        if not keys:
            del self._shape_keys[gang.shape], self._by_shape[gang.shape]
        self._pending_by_team[gang.team] -= 1

    # --- explanations -------------------------------------------------------------------

    def explain(self, job_id: str) -> Reason:
        """Why ``job_id`` is where it is, with its queue position if pending.

        Raises:
            KeyError: unknown job.
        """
        gang = self.gangs[job_id]
        if gang.state is not JobState.PENDING:
            return gang.reason
        position = self.position(job_id)
        blocker = self._shape_blocker.get(gang.shape)
        if (gang.reason_pass != self.pass_no and blocker is not None and blocker is not gang
                and blocker.reason_pass == self.pass_no and blocker.state is JobState.PENDING):
            return Reason(blocker.reason.code, (
                f"{blocker.reason.message}; {blocker.job_id}, ahead of it with the same "
                f"team, priority, size and constraints, is held the same way "
                f"(position {position} of {len(self.queue)})"))
        if gang.reason_pass != self.pass_no:
            return Reason(ReasonCode.QUEUED, (
                f"position {position} of {len(self.queue)} in the queue; the last pass stopped "
                f"before it (no free or preemptible slots for gangs of priority "
                f"{gang.spec.priority_class} or lower)"))
        return Reason(gang.reason.code,
                           f"{gang.reason.message} (position {position} of {len(self.queue)})")

    def position(self, job_id: str) -> int | None:
        """1-based place of a pending job in the queue; None if it is not pending."""
        gang = self.gangs[job_id]
        return self._queue_index(gang) + 1 if gang.state is JobState.PENDING else None

    def _need_text(self, gang: Gang) -> str:
        return (f"{gang.smallest} replica(s) x {gang.per_replica} slot(s) = "
                f"{gang.min_slots} slots")

    def _quota_message(self, gang: Gang, used: int) -> str:
        quota = self._quota(gang.team)
        limit = "unlimited" if quota.borrow_limit is None else str(quota.borrow_limit)
        return (f"team {gang.team} quota: {used}/{quota.ceiling:g} slots used (nominal "
                f"{quota.nominal} + borrow limit {limit}); needs {gang.min_slots} more")

    def _unschedulable_message(self, gang: Gang) -> str:
        matching = [n for n in self.nodes.values() if n.schedulable and n.matches(gang.spec)]
        labels = gang.spec.placement.node_labels
        where = f"nodes labelled {labels}" if labels else "schedulable nodes"
        spread = ", spread over failure domains" if gang.spec.placement.spread_failure_domains \
            else ""
        return (f"needs {self._need_text(gang)}{spread}, but the {len(matching)} {where} "
                f"offer {sum(n.slots for n in matching)} slots in all"
                f"{self._unavailable_text(gang)}")

    def _capacity_message(self, gang: Gang, free: int, holders: tuple[str, ...]) -> str:
        held = f"; freed slots are reserved for {', '.join(holders)}" if holders else ""
        return (f"needs {self._need_text(gang)} placed at once; {free} unreserved slot(s) "
                f"free in the cluster{held}{self._unavailable_text(gang)}")

    def _unavailable_text(self, gang: Gang) -> str:
        """The nodes that would take the gang but may not now, when there are any: a
        cordon (health's or an operator's) is often the whole reason a job waits."""
        parts = []
        for what, unavailable in (("cordoned", lambda n: n.alive and n.cordoned),
                                  ("lost", lambda n: not n.alive)):
            names = sorted(n.node_id for n in self.nodes.values()
                           if unavailable(n) and n.matches(gang.spec))
            if names:
                slots = sum(self.nodes[name].slots for name in names)
                parts.append(f"{slots} slot(s) on {what} node(s) {', '.join(names)}")
        return f"; not counted: {'; '.join(parts)}" if parts else ""

    # --- invariants ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the state is consistent (used by tests after every step)."""
        used: dict[str, int] = {}
        team_use: dict[str, int] = {}
        queued = {g.job_id for g in self.queue}
        assert len(queued) == len(self.queue), "a gang is queued twice"
        for gang in self.gangs.values():
            if gang.state is JobState.ADMITTED:
                assert len(gang.nodes) >= gang.spec.replicas.min, f"{gang.job_id} below min"
                assert len(gang.nodes) <= gang.spec.replicas.max, f"{gang.job_id} above max"
                assert gang.rules.allows(len(gang.nodes)), f"{gang.job_id} at a size not allowed"
                for node_id in gang.nodes:
                    used[node_id] = used.get(node_id, 0) + gang.per_replica
                team_use[gang.team] = team_use.get(gang.team, 0) + gang.slots
            else:
                assert not gang.nodes, f"{gang.job_id} is {gang.state} but holds slots"
            assert (gang.job_id in queued) == (gang.state is JobState.PENDING), gang.job_id
        for node in self.nodes.values():
            assert node.used == used.get(node.node_id, 0), f"{node.node_id} usage drifted"
            assert node.used <= node.slots, f"{node.node_id} over capacity"
        assert set(self.running) == {g.job_id for g in self.gangs.values()
                                     if g.state is JobState.ADMITTED}, "running set drifted"
        assert set(self._short) == {j for j, g in self.running.items()
                                    if len(g.nodes) < g.cap}, "short set drifted"
        assert set(self._changing) == {j for j, g in self.gangs.items()
                                       if g.change is not None}, "changing set drifted"
        assert set(self._changing) <= set(self.running), "a change of a gang not running"
        for team, slots in team_use.items():
            assert slots <= self._quota(team).ceiling, f"team {team} over quota"
            assert self.usage.get(team, 0) == slots, f"team {team} usage drifted"
        keys = [g.order_key() for g in self.queue]
        assert keys == sorted(keys) == self._queue_keys, "queue out of order"
        by_shape: dict[tuple, list[Gang]] = {}
        for gang in self.queue:
            by_shape.setdefault(gang.shape, []).append(gang)
        assert by_shape == self._by_shape, "shape queues drifted"
        assert {s: [g.order_key() for g in q] for s, q in by_shape.items()} == self._shape_keys
        assert self._free_total == sum(n.free for n in self.nodes.values()), "free index drifted"
