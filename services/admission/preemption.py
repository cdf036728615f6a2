"""Preemption: which running gangs give way to a gang that does not fit, and how. Pure.

A gang may take slots from *victims*: lower-priority gangs of its own team, and gangs of
teams borrowing above their nominal quota — whatever their priority when the preemptor's
team stays within its nominal after admission (a reclaim), else only lower-priority ones.
A team within its nominal keeps its slots. Victims are taken in steps
(:func:`steps`): elastic gangs shrink first, one allowed size at a time, then whole
gangs are evicted; each kind lowest priority first, newest first. :func:`plan` simulates
the steps on the live state until the gang fits, spares the victims that proved
unnecessary (greedily, most valuable first: a minimum set is NP-hard in general), undoes
everything and returns the plan; :func:`preempt` carries it out. :func:`may_help` is the
cheap bound that keeps a pass from planning when no plan could succeed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator

from phalanx.schemas.messages import JobState, ReasonCode, ScalingEventKind
from phalanx.services.admission import placement
from phalanx.services.admission.events import Decision, Evict, Reason
from phalanx.services.admission.model import AdmissionState, Gang

_ADMITTED_SEQ = operator.attrgetter("admitted_seq")


def may_help(state: AdmissionState, gang: Gang, free: int) -> bool:
    """A cheap upper bound: could free slots plus every slot ``gang`` may take hold it?"""
    reclaim = (state.usage.get(gang.team, 0) + gang.min_slots
               <= state.quota(gang.team).nominal)
    key = (gang.team, gang.weight, reclaim)
    cached = state.preemptible.get(key)
    if cached is None or cached[0] != state.version:
        total = 0
        for team, held in state.held.items():
            if team != gang.team and state.usage.get(team, 0) <= state.quota(team).nominal:
                continue  # not borrowing: untouchable
            everything = reclaim and team != gang.team
            total += sum(s for w, s in held.items() if everything or w < gang.weight)
        cached = state.preemptible[key] = (state.version, total)
    return free + cached[1] >= gang.min_slots


def plan(state: AdmissionState, gang: Gang,
         reserved: dict[str, int]) -> list[tuple[Gang, int]] | None:
    """Victims (gang, replicas to take) that make room for ``gang``, or None.

    Tries shrinking elastic victims before evicting whole gangs; simulates on
    the live state and undoes every change before returning.
    """
    reclaim = (state.usage.get(gang.team, 0) + gang.min_slots
               <= state.quota(gang.team).nominal)
    taken: list[tuple[Gang, list[str]]] = []
    ceiling = state.quota(gang.team).ceiling
    labels = gang.spec.placement.node_labels
    need = gang.min_slots - (state.free_total - sum(reserved.values()))

    def useful(nodes: list[str]) -> int:
        """Slots freed on nodes the gang could use (a cheap gate before placing)."""
        if not labels:
            return len(nodes)
        return sum(1 for n in nodes if state.nodes[n].matches(gang.spec))

    def fits() -> bool:
        return (need <= 0 and state.usage.get(gang.team, 0) + gang.min_slots <= ceiling
                and placement.place(state, gang, gang.smallest, reserved) is not None)

    def take(victim: Gang, count: int) -> list[str]:
        nonlocal need
        nodes = list(victim.nodes) if count < 0 else victim.nodes[-count:]
        state.release(victim, nodes)
        need -= useful(nodes) * victim.per_replica
        return nodes

    try:
        # steps() yields only gangs ``gang`` may take by team and priority; what
        # can change while taking is whether another team still borrows.
        nominal = {t: state.quota(t).nominal for t in state.running_tw}
        usage = state.usage
        for victim, count in steps(state, gang, reclaim):
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
            state.allocate(victim, nodes)
            if fits():
                taken.pop(i)
            else:
                state.release(victim, nodes)
        by_job: dict[str, tuple[Gang, int]] = {}
        for victim, nodes in taken:
            prev = by_job.get(victim.job_id, (victim, 0))[1]
            by_job[victim.job_id] = (victim, prev + len(nodes))
        return list(by_job.values())
    finally:
        for victim, nodes in reversed(taken):
            state.allocate(victim, nodes)


def steps(state: AdmissionState, gang: Gang, reclaim: bool) -> Iterator[tuple[Gang, int]]:
    """Preemption steps in order: shrink elastic extras, then evict whole gangs.

    Each in order of priority (lowest first), then newest first; built lazily,
    weight by weight, since a plan rarely needs more than the lowest.
    """
    def eligible(team: str) -> Callable[[int], bool] | None:
        if team == gang.team:
            return lambda w: w < gang.weight
        if state.usage.get(team, 0) <= state.quota(team).nominal:
            return None  # not borrowing: its slots are its own
        return (lambda w: True) if reclaim else (lambda w: w < gang.weight)

    rules = {t: rule for t in state.running_tw if (rule := eligible(t)) is not None}
    weights = sorted({w for t in rules for w, gangs in state.running_tw[t].items()
                      if gangs and rules[t](w)})

    def by_weight() -> Iterator[Gang]:
        for w in weights:
            bucket = [g for t in rules if rules[t](w)
                      for g in state.running_tw[t].get(w, {}).values()]
            yield from sorted(bucket, key=_ADMITTED_SEQ, reverse=True)

    extras = sorted((g for g in state.elastic.values() if g.team in rules
                     and rules[g.team](g.weight)),
                    key=lambda g: (g.weight, -g.admitted_seq))
    for victim in extras:  # one allowed size at a time: a shrink takes only what is needed
        size = len(victim.nodes)
        while (lower := victim.rules.step_down(size)) is not None:
            yield victim, size - lower
            size = lower
    for victim in by_weight():
        yield victim, -1  # -1: evict whatever it still holds


def preempt(state: AdmissionState, victims: list[tuple[Gang, int]], gang: Gang, cause: str,
            now: float) -> list[Decision]:
    """Carry out a :func:`plan`: shrink or evict each victim, for ``gang``."""
    decisions: list[Decision] = []
    why = (f"preempted for {gang.job_id} (priority {gang.spec.priority_class}, "
           f"team {gang.team})")
    for victim, count in victims:
        reason = Reason(ReasonCode.PREEMPTED, why)
        victim.changed_at = now
        if len(victim.nodes) - count >= victim.smallest:
            before = len(victim.nodes)
            state.release(victim, victim.nodes[-count:])
            decisions.append(state.shrunk(victim, reason, cause))
            decisions += state.resized(victim, ScalingEventKind.SHRINK, before, reason,
                                       now, cause)
        else:
            state.release(victim, list(victim.nodes))
            victim.state = JobState.PENDING
            victim.reason = reason
            state.enqueue(victim, now)
            decisions.append(Evict(victim.job_id, reason, requeue=True, cause=cause))
    return decisions
