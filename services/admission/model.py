"""The admission core's model: gangs, nodes, the queue, and who holds which slots. Pure.

:class:`AdmissionState` is everything the rules read, kept consistent by its own methods
alone: a gang is queued (:meth:`~AdmissionState.enqueue`) or admitted
(:meth:`~AdmissionState.admit`), and slots move only through
:meth:`~AdmissionState.allocate` and :meth:`~AdmissionState.release`, which keep the
indexes the admission pass reads instead of walking everything: the queue split by shape,
nodes by free slots, slots held per team and priority weight, running gangs by team and
weight, gangs that may shrink or grow, planned changes in progress, the heap of schedule
deadlines. :meth:`~AdmissionState.check_invariants` recomputes them from scratch.
The caches the pass keeps between passes (which shapes could ever fit, failure domains
per shape, what preemption could free) live here too, keyed by :attr:`~AdmissionState.version`
or cleared when nodes change. The rules themselves are elsewhere: :mod:`.lifecycle`
(events), :mod:`.scheduling` (the pass), :mod:`.placement`, :mod:`.preemption`,
:mod:`.explain`.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections.abc import Iterable

from phalanx.schemas.messages import (
    JobSpec,
    JobState,
    ReasonCode,
    ScalingChange,
    ScalingEventKind,
)
from phalanx.schemas.scaling import ScalingRules
from phalanx.services.admission import changes
from phalanx.services.admission.events import Decision, Reason, Shrink
from phalanx.services.admission.policy import AdmissionPolicy, TeamQuota


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


def admission_number(stored: JobState | None, admissions: int, state: JobState) -> int:
    """The record's ``admission`` once ``state`` is written over a record ``stored`` in
    (None: none yet) that counted ``admissions``: one more when the job goes from not
    admitted to admitted, the same otherwise (a leader writing the admitted record
    again, after a failover, counts nothing)."""
    if state is JobState.ADMITTED and stored is not JobState.ADMITTED:
        return admissions + 1
    return admissions


#: What admitting a gang depends on besides its place in the queue: weight, team, slots per
#: replica (all its group's ranks': ``JobSpec.slots_per_group``), smallest size, node
#: labels and spread (see :attr:`Gang.shape`).
Shape = tuple[int, str, int, int, tuple[tuple[str, str], ...], bool]


@dataclasses.dataclass(eq=False)
class Gang:
    """A job as admission holds it: its spec, where it stands (pending, admitted, ended)
    and, admitted, one node per replica (a node may repeat)."""

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
    shape: Shape = dataclasses.field(init=False)  # what admission depends on, besides order

    def __post_init__(self) -> None:
        spec = self.spec
        self.team = spec.team
        # A replica of several ranks (a group) takes all their slots on one node.
        self.per_replica = spec.slots_per_group
        self.rules = ScalingRules.of(spec)
        self.min_slots = self.rules.smallest * self.per_replica
        self.shape = (self.weight, self.team, self.per_replica, self.rules.smallest,
                      tuple(sorted(spec.placement.node_labels.items())),
                      spec.placement.spread_failure_domains)

    @property
    def slots(self) -> int:
        return len(self.nodes) * self.per_replica

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
    """A node as admission sees it: its slots, failure domain and labels, whether it may
    take work, and the replicas on it."""

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


class AdmissionState:
    """Gangs, nodes, the queue and the allocation, with the indexes over them."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self.gangs: dict[str, Gang] = {}
        self.nodes: dict[str, Node] = {}
        self.seq = 0  # the last submission's number (Gang.seq)
        self.pass_no = 0  # the last admission pass's number
        # The queue: pending gangs in admission order, and the same split by Gang.shape.
        self.queue: list[Gang] = []
        self._queue_keys: list[tuple[int, int]] = []  # order_key() of each queue entry
        self.by_shape: dict[Shape, list[Gang]] = {}
        self.shape_keys: dict[Shape, list[tuple[int, int]]] = {}
        self.pending_by_team: dict[str, int] = {}
        self.deadlines: list[tuple[float, int, Gang]] = []  # heap of schedule timeouts
        # The allocation.
        self.usage: dict[str, int] = {}  # team -> slots held
        self.by_free: dict[int, dict[str, None]] = {}  # free slots -> nodes (ordered set)
        self.free_total = 0
        self._admissions = 0
        self.running: dict[str, Gang] = {}  # admitted gangs
        self.running_tw: dict[str, dict[int, dict[str, Gang]]] = {}  # team -> weight -> gangs
        self.elastic: dict[str, Gang] = {}  # running gangs holding more than their min
        self.short: dict[str, Gang] = {}  # running gangs holding less than their max
        self.changing: dict[str, Gang] = {}  # gangs with a planned change in progress
        self.slots_by_weight: dict[int, int] = {}  # slots held by admitted gangs, per weight
        self.held: dict[str, dict[int, int]] = {}  # team -> weight -> slots held
        self.version = 0  # bumped on every allocation change; keys the caches below
        # What passes remember between them.
        self.shape_blocker: dict[Shape, Gang] = {}  # first gang of a shape the last pass held
        self.regrown_at = -1  # the version of the last growth attempt
        self.regrow_due = math.inf  # when a gang held back by its cooldown may grow
        self.free_sizes: tuple[int, list[int]] = (-1, [])  # sorted(by_free) at a version
        self.preemptible: dict[tuple[str, int, bool], tuple[int, int]] = {}  # preemption.py
        # spread: matching failure domains per (slots per replica, node labels)
        self.domain_cache: dict[tuple[int, tuple[tuple[str, str], ...]], int] = {}
        self.fit_cache: dict[Shape, bool] = {}  # could_ever_fit per shape
        self._quotas: dict[str, TeamQuota] = {}

    def quota(self, team: str) -> TeamQuota:
        quota = self._quotas.get(team)
        if quota is None:
            quota = self._quotas[team] = self.policy.quota(team)
        return quota

    def nodes_changed(self) -> None:
        """A node joined, changed or left: forget what was judged from the nodes alone."""
        self.fit_cache.clear()
        self.domain_cache.clear()

    # --- the queue ------------------------------------------------------------------------

    def enqueue(self, gang: Gang, now: float) -> None:
        """Queue ``gang`` in order; its schedule timeout runs from ``now`` (each requeue anew)."""
        if gang.spec.schedule_timeout_s is not None:
            gang.deadline = now + gang.spec.schedule_timeout_s
            heapq.heappush(self.deadlines, (gang.deadline, gang.seq, gang))
        key = gang.order_key()
        i = bisect.bisect(self._queue_keys, key)
        self._queue_keys.insert(i, key)
        self.queue.insert(i, gang)
        keys = self.shape_keys.setdefault(gang.shape, [])
        j = bisect.bisect(keys, key)
        keys.insert(j, key)
        self.by_shape.setdefault(gang.shape, []).insert(j, gang)
        self.pending_by_team[gang.team] = self.pending_by_team.get(gang.team, 0) + 1

    def queue_index(self, gang: Gang) -> int:
        """Where ``gang`` is in the queue (0-based)."""
        return bisect.bisect_left(self._queue_keys, gang.order_key())

    def dequeue(self, gang: Gang) -> None:
        """Take a pending ``gang`` off the queue."""
        i = self.queue_index(gang)
        assert self.queue[i] is gang
        del self.queue[i]
        del self._queue_keys[i]
        keys = self.shape_keys[gang.shape]
        j = bisect.bisect_left(keys, gang.order_key())
        del keys[j]
        del self.by_shape[gang.shape][j]
        if not keys:
            del self.shape_keys[gang.shape], self.by_shape[gang.shape]
        self.pending_by_team[gang.team] -= 1

    # --- the allocation -------------------------------------------------------------------

    def admit(self, gang: Gang, nodes: list[str]) -> None:
        """Take ``gang`` off the queue and run it on ``nodes``."""
        self.dequeue(gang)
        gang.state = JobState.ADMITTED
        self._admissions += 1
        gang.admitted_seq = self._admissions
        self.allocate(gang, nodes)
        self.admitted_reason(gang)

    def allocate(self, gang: Gang, nodes: list[str]) -> None:
        """``gang`` takes one replica's slots on each of ``nodes`` (a node may repeat)."""
        for node_id in nodes:
            node = self.nodes[node_id]
            self.index_remove(node)
            node.used += gang.per_replica
            node.replicas[gang.job_id] = node.replicas.get(gang.job_id, 0) + 1
            self.index_add(node)
        gang.nodes.extend(nodes)
        slots = len(nodes) * gang.per_replica
        self.usage[gang.team] = self.usage.get(gang.team, 0) + slots
        self.slots_by_weight[gang.weight] = self.slots_by_weight.get(gang.weight, 0) + slots
        held = self.held.setdefault(gang.team, {})
        held[gang.weight] = held.get(gang.weight, 0) + slots
        if gang.nodes:
            self.running[gang.job_id] = gang
            self.running_tw.setdefault(gang.team, {}).setdefault(
                gang.weight, {})[gang.job_id] = gang
        self.track_elastic(gang)

    def release(self, gang: Gang, nodes: list[str]) -> None:
        """``gang`` gives back one replica's slots on each of ``nodes``."""
        for node_id in nodes:
            gang.nodes.remove(node_id)
            node = self.nodes[node_id]
            self.index_remove(node)
            node.used -= gang.per_replica
            node.replicas[gang.job_id] -= 1
            if not node.replicas[gang.job_id]:
                del node.replicas[gang.job_id]
            self.index_add(node)
        slots = len(nodes) * gang.per_replica
        self.usage[gang.team] -= slots
        self.slots_by_weight[gang.weight] -= slots
        self.held[gang.team][gang.weight] -= slots
        if not gang.nodes:
            self.running.pop(gang.job_id, None)
            self.running_tw[gang.team][gang.weight].pop(gang.job_id, None)
            self.follow(gang, None)  # evicted or ended: no change left to follow
            gang.world_size = None
        self.track_elastic(gang)

    def track_elastic(self, gang: Gang) -> None:
        """File ``gang`` under the gangs that may shrink (above their smallest size) and
        those that may grow (running below their cap)."""
        if len(gang.nodes) > gang.smallest:
            self.elastic[gang.job_id] = gang
        else:
            self.elastic.pop(gang.job_id, None)
        if gang.nodes and len(gang.nodes) < gang.cap:
            self.short[gang.job_id] = gang
        else:
            self.short.pop(gang.job_id, None)

    def index_add(self, node: Node) -> None:
        """Put ``node`` back in the free-slot index (after :meth:`index_remove` and a change)."""
        self.version += 1
        if node.free > 0:
            self.by_free.setdefault(node.free, {})[node.node_id] = None
            self.free_total += node.free

    def index_remove(self, node: Node) -> None:
        """Take ``node`` out of the free-slot index, before its free slots change."""
        self.version += 1
        bucket = self.by_free.get(node.free)
        if bucket is not None and node.node_id in bucket:
            del bucket[node.node_id]
            if not bucket:
                del self.by_free[node.free]
            self.free_total -= node.free

    # --- size changes ---------------------------------------------------------------------

    def admitted_reason(self, gang: Gang) -> None:
        """A running gang's reason: its size and spread."""
        gang.reason = Reason(ReasonCode.ADMITTED, f"running {len(gang.nodes)} replica(s) on "
                                                  f"{len(set(gang.nodes))} node(s)")

    def shrunk(self, gang: Gang, why: Reason, cause: str) -> Shrink:
        """A running gang gave replicas back: its record says why, with the reason's code
        (elasticity tells a planned shrink, whose members leave, from a node lost)."""
        gang.reason = Reason(why.code, f"running {len(gang.nodes)} replica(s) on "
                                       f"{len(set(gang.nodes))} node(s); shrunk: {why.message}")
        return Shrink(gang.job_id, tuple(gang.nodes), why, cause)

    def resized(self, gang: Gang, kind: ScalingEventKind, before: int, reason: Reason,
                now: float, cause: str, *, planned: bool = True) -> list[Decision]:
        """``gang`` went from ``before`` replicas to its size now: announce it, and follow
        it if planned (a later change replaces one in progress)."""
        change, announced = changes.begin(
            gang.job_id, kind, before, len(gang.nodes), reason.message, planned=planned,
            world_size=gang.world_size, timeout_s=gang.spec.scaling.scaling_timeout_s,
            now=now, cause=cause)
        self.follow(gang, change)
        return list(announced)

    def follow(self, gang: Gang, change: ScalingChange | None) -> None:
        """Follow ``change``, a planned size change of ``gang`` (None: none is in progress)."""
        gang.change = change
        if change is None:
            self.changing.pop(gang.job_id, None)
        else:
            self.changing[gang.job_id] = gang

    # --- invariants -----------------------------------------------------------------------

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
        assert set(self.short) == {j for j, g in self.running.items()
                                   if len(g.nodes) < g.cap}, "short set drifted"
        assert set(self.changing) == {j for j, g in self.gangs.items()
                                      if g.change is not None}, "changing set drifted"
        assert set(self.changing) <= set(self.running), "a change of a gang not running"
        for team, slots in team_use.items():
            assert slots <= self.quota(team).ceiling, f"team {team} over quota"
            assert self.usage.get(team, 0) == slots, f"team {team} usage drifted"
        keys = [g.order_key() for g in self.queue]
        assert keys == sorted(keys) == self._queue_keys, "queue out of order"
        by_shape: dict[Shape, list[Gang]] = {}
        for gang in self.queue:
            by_shape.setdefault(gang.shape, []).append(gang)
        assert by_shape == self.by_shape, "shape queues drifted"
        assert {s: [g.order_key() for g in q] for s, q in by_shape.items()} == self.shape_keys
        assert self.free_total == sum(n.free for n in self.nodes.values()), "free index drifted"
