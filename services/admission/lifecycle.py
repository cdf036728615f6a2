"""What each event does to the admission model, outside the pass: a job submitted,
restored, ended or requeued, a node changed, lost or removed, an operator's pin, the
size a job's runtime reports. Pure.

Each handler returns the decisions the event forces at once (an ended job's eviction, a
lost node's gangs shrunk or requeued, a pin's shrink); admitting what the event made
possible is the next pass's work (:mod:`.scheduling`). A lost node shrinks each elastic
gang on it to the largest allowed size its other replicas hold, and puts the rest back in
the queue whole. :func:`validate` refuses, before submission, a spec that could never run
here: more slots than the cluster has, or a replica (all of a group's ranks) larger than
its largest node.
"""

from __future__ import annotations

from phalanx.schemas.messages import JobSpec, JobState, ReasonCode, ScalingEventKind
from phalanx.schemas.scaling import ScalingRules
from phalanx.services.admission import changes
from phalanx.services.admission.changes import Announce
from phalanx.services.admission.events import (
    Decision,
    Event,
    Evict,
    Fail,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobRequeued,
    JobSubmitted,
    MembershipChanged,
    NodeRemoved,
    NodeUpdated,
    Reason,
    ScalePinned,
)
from phalanx.services.admission.model import AdmissionState, Capacity, Gang, Node


class SpecRejected(ValueError):
    """A job spec that can never be admitted here; the message names the field."""


def validate(state: AdmissionState, spec: JobSpec, registered: Capacity | None = None) -> None:
    """Refuse a spec that names an unknown class or could never fit this cluster.

    ``registered``: the slots of every registered node as the registry says them now
    (the service's view, which the core's event queue may lag while a pass runs);
    None: the nodes this core knows.

    Raises:
        SpecRejected: naming the field and the numbers.
    """
    if spec.priority_class not in state.policy.priority_classes:
        known = ", ".join(sorted(state.policy.priority_classes))
        raise SpecRejected(f"priority_class {spec.priority_class!r} is not one of: {known}")
    smallest = ScalingRules.of(spec).smallest
    field = "replicas.min" if smallest == spec.replicas.min else \
        "the smallest of scaling.replica_discrete_values"
    per_replica = spec.slots_per_group  # a group's ranks all sit on the replica's node
    need = smallest * per_replica
    # Every registered node counts, silent or not: "never fits" must not follow from a
    # moment when heartbeats lag (a new leader, a loaded bus) — such a job waits, with
    # its reason, for the nodes to be heard again. A node leaves the count when it
    # leaves the registry.
    capacity = registered if registered is not None else \
        Capacity.of(n.slots for n in state.nodes.values())
    if spec.ranks_per_replica > 1 and per_replica > capacity.largest:
        # Before the total: a group no node holds is what to change, whatever the total.
        raise SpecRejected(
            f"ranks_per_replica x slots_per_replica = {spec.ranks_per_replica} x "
            f"{spec.slots_per_replica} = {per_replica} slots on one node, but the largest "
            f"node has {capacity.largest}: a replica's ranks run on one node")
    if need > capacity.total:
        size = (f"slots_per_replica = {smallest} x {spec.slots_per_replica}"
                if spec.ranks_per_replica == 1 else
                f"ranks_per_replica x slots_per_replica = {smallest} x "
                f"{spec.ranks_per_replica} x {spec.slots_per_replica}")
        raise SpecRejected(f"{field} x {size} = {need} slots, but the whole cluster has "
                           f"{capacity.total}")
    if spec.slots_per_replica > capacity.largest:
        raise SpecRejected(f"slots_per_replica {spec.slots_per_replica} exceeds every "
                           "node's slots")
    ceiling = state.quota(spec.team).ceiling
    if need > ceiling:
        raise SpecRejected(f"needs {need} slots but team {spec.team!r} may hold at most "
                           f"{ceiling:g}")


def handle(state: AdmissionState, event: Event, now: float) -> list[Decision]:
    """Apply one event; returns the decisions it forces at once (not an admission pass)."""
    match event:
        case JobSubmitted():
            return _submitted(state, event)
        case JobCancelled():
            return _ended(state, event.job_id, JobState.CANCELLED, event.event_id)
        case JobFinished():
            return _ended(state, event.job_id, JobState.FINISHED, event.event_id)
        case JobFailed():
            return _ended(state, event.job_id, JobState.FAILED, event.event_id,
                          Reason(event.reason_code, event.reason))
        case JobRequeued():
            return _requeued(state, event, now)
        case NodeUpdated():
            return _node_updated(state, event, now)
        case NodeRemoved():
            return _node_gone(state, event.node_id, event.event_id, now, remove=True)
        case ScalePinned():
            return _pinned(state, event, now)
        case MembershipChanged():
            return _membership(state, event)
    raise TypeError(f"unknown event {event!r}")


def pin_problem(state: AdmissionState, job_id: str, replicas: int | None) -> str | None:
    """Why ``job_id`` cannot be pinned to ``replicas`` now (None: it can).

    Raises:
        KeyError: unknown job.
    """
    gang = state.gangs[job_id]
    if gang.state.terminal:
        return f"{job_id} is {gang.state.value}"
    if replicas is None:
        return None
    if gang.rules.largest == gang.rules.smallest:
        return f"{job_id} is rigid: it runs {gang.rules.smallest} replica(s)"
    return gang.rules.pin_problem(replicas)


def _pinned(state: AdmissionState, event: ScalePinned, now: float) -> list[Decision]:
    gang = state.gangs.get(event.job_id)
    if gang is None or pin_problem(state, event.job_id, event.replicas) is not None:
        return []
    gang.pinned = event.replicas
    state.track_elastic(gang)
    state.regrown_at = -1  # a released pin may let it grow now
    size = len(gang.nodes)
    decisions: list[Decision] = [
        Announce(gang.job_id, ScalingEventKind.RELEASE, size, size,
                 "pin released: admission sizes it", cause=event.event_id)
        if event.replicas is None else
        Announce(gang.job_id, ScalingEventKind.PIN, size, event.replicas,
                 f"pinned to {event.replicas} replica(s)", cause=event.event_id)]
    if event.replicas is None or size <= event.replicas:
        return decisions
    state.release(gang, gang.nodes[event.replicas:])
    gang.changed_at = now
    reason = Reason(ReasonCode.SCALED, f"pinned to {event.replicas} replica(s)")
    return [*decisions, state.shrunk(gang, reason, event.event_id),
            *state.resized(gang, ScalingEventKind.SHRINK, size, reason, now,
                           event.event_id)]


def _membership(state: AdmissionState, event: MembershipChanged) -> list[Decision]:
    gang = state.gangs.get(event.job_id)
    if gang is None or gang.state is not JobState.ADMITTED:
        return []
    gang.world_size = event.world_size
    change, announced = changes.applied(gang.job_id, gang.change, event.world_size,
                                        event.event_id)
    state.follow(gang, change)
    return list(announced)


def _submitted(state: AdmissionState, event: JobSubmitted) -> list[Decision]:
    if event.job_id in state.gangs:
        return []  # a replayed submission: already known
    weight = state.policy.priority_classes.get(event.spec.priority_class)
    state.seq += 1
    gang = Gang(event.job_id, event.spec, weight if weight is not None else 0, state.seq,
                event.submitted_at, pinned=event.pinned_replicas)
    state.gangs[gang.job_id] = gang
    if weight is None:
        gang.state = JobState.FAILED
        gang.reason = Reason(ReasonCode.UNSCHEDULABLE,
                             f"unknown priority class {event.spec.priority_class!r}")
        return [Fail(gang.job_id, gang.reason, event.event_id)]
    state.enqueue(gang, event.submitted_at)
    return []


def restore(state: AdmissionState, event: JobSubmitted, nodes: list[str],
            now: float = 0.0) -> list[Decision]:
    """Rebuild a gang the ledger says runs on ``nodes`` (a new leader loading state).

    Call after the nodes are known. A gang whose nodes are gone, lost or now too
    small goes back to the queue (returned as an :class:`Evict`).
    """
    decisions = _submitted(state, event)
    gang = state.gangs[event.job_id]
    if gang.state is not JobState.PENDING or not nodes:
        return decisions
    need: dict[str, int] = {}
    for node_id in nodes:
        need[node_id] = need.get(node_id, 0) + gang.per_replica
    if all(node_id in state.nodes and state.nodes[node_id].alive
           and state.nodes[node_id].slots - state.nodes[node_id].used >= slots
           for node_id, slots in need.items()):
        state.admit(gang, list(nodes))
        gang.changed_at = now  # a new leader waits out a cooldown before growing it
        state.follow(gang, event.change)  # done or abandoned as if it had not left
        return decisions
    gang.reason = Reason(ReasonCode.NODE_LOST, f"a node of its placement {sorted(need)} "
                                               "is gone or full after a leader change")
    return [*decisions, Evict(gang.job_id, gang.reason, requeue=True, cause=event.event_id)]


def _ended(state: AdmissionState, job_id: str, end: JobState, cause: str,
           reason: Reason | None = None) -> list[Decision]:
    gang = state.gangs.get(job_id)
    if gang is None or gang.state not in (JobState.PENDING, JobState.ADMITTED):
        return []
    decisions: list[Decision] = []
    if gang.state is JobState.ADMITTED:
        state.release(gang, list(gang.nodes))
        decisions.append(Evict(job_id, reason or Reason(ReasonCode(end.value), end.value),
                               requeue=False, cause=cause))
    else:
        state.dequeue(gang)
    gang.state = end
    gang.reason = reason or Reason(ReasonCode(end.value), "cancelled by request"
                                   if end is JobState.CANCELLED else end.value)
    return decisions


def _node_updated(state: AdmissionState, event: NodeUpdated, now: float) -> list[Decision]:
    state.nodes_changed()
    node = state.nodes.get(event.node_id)
    if node is None:
        node = Node(event.node_id, event.slots, event.failure_domain, dict(event.labels))
        state.nodes[node.node_id] = node
    else:
        state.index_remove(node)
        node.slots, node.failure_domain = event.slots, event.failure_domain
        node.labels = dict(event.labels)
    node.alive, node.cordoned = event.alive, event.cordoned
    state.index_add(node)
    if not node.alive:
        return _node_gone(state, node.node_id, event.event_id, now, remove=False)
    decisions: list[Decision] = []
    # A node that shrank below what runs on it gives back its newest gangs.
    while node.used > node.slots:
        newest = max((state.gangs[j] for j in node.replicas), key=lambda g: g.admitted_seq)
        decisions += _evict_for_node(state, newest, node, event.event_id, now,
                                     f"node {node.node_id} shrank to {node.slots} slots")
    return decisions


def _node_gone(state: AdmissionState, node_id: str, cause: str, now: float, *,
               remove: bool) -> list[Decision]:
    state.nodes_changed()
    node = state.nodes.get(node_id)
    if node is None:
        return []
    decisions: list[Decision] = []
    for job_id in list(node.replicas):
        decisions += _evict_for_node(state, state.gangs[job_id], node, cause, now,
                                     f"node {node_id} lost")
    if remove:
        state.index_remove(node)
        del state.nodes[node_id]
    return decisions


def _requeued(state: AdmissionState, event: JobRequeued, now: float) -> list[Decision]:
    gang = state.gangs.get(event.job_id)
    if gang is None or gang.state is not JobState.ADMITTED:
        return []  # not running (any more): nothing to give back
    state.release(gang, list(gang.nodes))
    gang.state = JobState.PENDING
    gang.reason = Reason(ReasonCode.MEMBERS_LOST, event.reason)
    state.enqueue(gang, now)
    return [Evict(gang.job_id, gang.reason, requeue=True, cause=event.event_id)]


def _evict_for_node(state: AdmissionState, gang: Gang, node: Node, cause: str, now: float,
                    why: str) -> list[Decision]:
    """Shrink ``gang`` off ``node`` to the largest allowed size the rest of its replicas
    hold, else requeue it whole."""
    keep = [n for n in gang.nodes if n != node.node_id]
    reason = Reason(ReasonCode.NODE_LOST, why)
    size = gang.rules.at_most(len(keep))
    if size is not None:
        before = len(gang.nodes)
        state.release(gang, [n for n in gang.nodes if n == node.node_id])
        if len(gang.nodes) > size:  # also give back what an allowed size does not use
            state.release(gang, gang.nodes[size:])
        gang.changed_at = now
        return [state.shrunk(gang, reason, cause),
                *state.resized(gang, ScalingEventKind.SHRINK, before, reason, now, cause,
                               planned=False)]
    state.release(gang, list(gang.nodes))
    gang.state = JobState.PENDING
    gang.reason = reason
    state.enqueue(gang, now)
    return [Evict(gang.job_id, reason, requeue=True, cause=cause)]
