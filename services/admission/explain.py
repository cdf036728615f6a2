"""Why a job is where it is: the explanation a user reads, and the messages of the
reasons the admission pass gives a gang it could not admit. Pure.

A pending gang's reason is the one the last pass that reached it gave, with its queue
position; a gang the last pass did not reach is either held the same way as the first
gang of its shape (same team, priority, size and constraints) that the pass did reach,
or "queued" behind the ones it did. Messages state the numbers (slots needed, free,
held, quota) and name the nodes that would count but are cordoned or lost, since a
cordon is often the whole reason a job waits.
"""

from __future__ import annotations

from phalanx.schemas.messages import JobState, ReasonCode
from phalanx.services.admission.events import Reason
from phalanx.services.admission.model import AdmissionState, Gang


def explain(state: AdmissionState, job_id: str) -> Reason:
    """Why ``job_id`` is where it is, with its queue position if pending.

    Raises:
        KeyError: unknown job.
    """
    gang = state.gangs[job_id]
    if gang.state is not JobState.PENDING:
        return gang.reason
    place = position(state, job_id)
    blocker = state.shape_blocker.get(gang.shape)
    if (gang.reason_pass != state.pass_no and blocker is not None and blocker is not gang
            and blocker.reason_pass == state.pass_no and blocker.state is JobState.PENDING):
        return Reason(blocker.reason.code, (
            f"{blocker.reason.message}; {blocker.job_id}, ahead of it with the same "
            f"team, priority, size and constraints, is held the same way "
            f"(position {place} of {len(state.queue)})"))
    if gang.reason_pass != state.pass_no:
        return Reason(ReasonCode.QUEUED, (
            f"position {place} of {len(state.queue)} in the queue; the last pass stopped "
            f"before it (no free or preemptible slots for gangs of priority "
            f"{gang.spec.priority_class} or lower)"))
    return Reason(gang.reason.code,
                  f"{gang.reason.message} (position {place} of {len(state.queue)})")


def position(state: AdmissionState, job_id: str) -> int | None:
    """1-based place of a pending job in the queue; None if it is not pending."""
    gang = state.gangs[job_id]
    return state.queue_index(gang) + 1 if gang.state is JobState.PENDING else None


def need_text(gang: Gang) -> str:
    """What admitting ``gang`` takes: its smallest size in replicas and slots."""
    return (f"{gang.smallest} replica(s) x {gang.per_replica} slot(s) = "
            f"{gang.min_slots} slots")


def quota_message(state: AdmissionState, gang: Gang, used: int) -> str:
    """``gang`` would take its team, holding ``used`` slots, past its quota ceiling."""
    quota = state.quota(gang.team)
    limit = "unlimited" if quota.borrow_limit is None else str(quota.borrow_limit)
    return (f"team {gang.team} quota: {used}/{quota.ceiling:g} slots used (nominal "
            f"{quota.nominal} + borrow limit {limit}); needs {gang.min_slots} more")


def unschedulable_message(state: AdmissionState, gang: Gang) -> str:
    """``gang`` would not fit even if every node it may use were empty."""
    matching = [n for n in state.nodes.values() if n.schedulable and n.matches(gang.spec)]
    labels = gang.spec.placement.node_labels
    where = f"nodes labelled {labels}" if labels else "schedulable nodes"
    spread = ", spread over failure domains" if gang.spec.placement.spread_failure_domains \
        else ""
    return (f"needs {need_text(gang)}{spread}, but the {len(matching)} {where} "
            f"offer {sum(n.slots for n in matching)} slots in all"
            f"{unavailable_text(state, gang)}")


def capacity_message(state: AdmissionState, gang: Gang, free: int,
                     holders: tuple[str, ...]) -> str:
    """``gang`` waits for capacity: ``free`` unreserved slots, ``holders`` reserving."""
    held = f"; freed slots are reserved for {', '.join(holders)}" if holders else ""
    return (f"needs {need_text(gang)} placed at once; {free} unreserved slot(s) "
            f"free in the cluster{held}{unavailable_text(state, gang)}")


def unavailable_text(state: AdmissionState, gang: Gang) -> str:
    """The nodes that would take the gang but may not now, when there are any: a
    cordon (health's or an operator's) is often the whole reason a job waits."""
    parts = []
    for what, unavailable in (("cordoned", lambda n: n.alive and n.cordoned),
                              ("lost", lambda n: not n.alive)):
        names = sorted(n.node_id for n in state.nodes.values()
                       if unavailable(n) and n.matches(gang.spec))
        if names:
            slots = sum(state.nodes[name].slots for name in names)
            parts.append(f"{slots} slot(s) on {what} node(s) {', '.join(names)}")
    return f"; not counted: {'; '.join(parts)}" if parts else ""
