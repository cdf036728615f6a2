"""The admission pass: one walk of the queue that admits, preempts, reserves and
backfills, then grows running gangs into what is left; and the deadlines a pass enforces
first. Pure.

The rules are :mod:`.core`'s docstring (1-9); this is the walk. The queue is taken in
order, merged from per-shape queues: once a gang of a shape fails, every later gang of the
same shape would fail for the same reason in this pass, so the rest of that shape is
skipped at once. The walk stops early when nothing is free, no later gang could preempt
and no team under its nominal quota waits. Placement is :mod:`.placement`, victims
:mod:`.preemption`, the messages of the reasons given :mod:`.explain`.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math

from phalanx.schemas.messages import JobState, ReasonCode, ScalingEventKind
from phalanx.services.admission import changes, explain, placement, preemption
from phalanx.services.admission.events import Admit, Decision, Fail, Grow, Reason
from phalanx.services.admission.model import AdmissionState, Gang, Shape


def schedule(state: AdmissionState, now: float) -> list[Decision]:
    """One admission pass over the queue (see the module docstring for the rules)."""
    state.pass_no += 1
    cause = f"pass-{state.pass_no}"
    decisions: list[Decision] = expire(state, now)
    if state.changing:
        decisions += abandon_overdue(state, now)
    reserved: dict[str, int] = {}
    reserved_total = 0
    holders: list[str] = []
    waiting_for_capacity = False  # a reached gang waits for slots: none to grow into
    admitted: list[Gang] = []
    lowest_running = min((w for w, s in state.slots_by_weight.items() if s), default=None)
    reclaimers = reclaiming_teams(state)
    # The queue is walked in order, merged from per-shape queues: once a gang fails,
    # every later gang of the same shape (team, priority, size, constraints) would fail
    # for the same reason in this pass, so the rest of that shape is skipped at once.
    heap = [(keys[0], shape) for shape, keys in state.shape_keys.items() if keys]
    heapq.heapify(heap)
    blocked: set[Shape] = set()
    while heap:
        key, shape = heapq.heappop(heap)
        if shape in blocked:
            continue
        keys = state.shape_keys.get(shape, [])
        j = bisect.bisect_left(keys, key)
        if j == len(keys):
            continue  # the shape's queue emptied during the pass
        gang = state.by_shape[shape][j]
        if keys[j] != key:  # that gang left the queue; resume at its successor
            heapq.heappush(heap, (keys[j], shape))
            continue
        quota = state.quota(gang.team)
        used = state.usage.get(gang.team, 0)
        free_now = state.free_total - reserved_total
        if free_now <= 0 and (lowest_running is None or gang.weight <= lowest_running):
            # Nothing free and nothing of lower priority to preempt: only a team under
            # its nominal quota may still reclaim borrowed slots.
            if not reclaimers:
                break  # the rest stay queued
            if gang.team not in reclaimers or used + gang.min_slots > quota.nominal:
                blocked.add(shape)
                gang.reason_pass = state.pass_no
                state.shape_blocker[shape] = gang
                if used + gang.min_slots > quota.ceiling:
                    gang.reason = Reason(ReasonCode.QUOTA,
                                         explain.quota_message(state, gang, used))
                elif not placement.could_ever_fit(state, gang):
                    gang.reason = Reason(ReasonCode.UNSCHEDULABLE,
                                         explain.unschedulable_message(state, gang))
                else:
                    gang.reason = Reason(ReasonCode.INSUFFICIENT_CAPACITY, (
                        f"needs {explain.need_text(gang)}; no slot is free and none is held "
                        f"by lower-priority work it may preempt; teams under their "
                        f"nominal quota are reclaiming borrowed slots first"))
                continue
        gang.reason_pass = state.pass_no
        quota_ok = used + gang.min_slots <= quota.ceiling
        victims: list[tuple[Gang, int]] | None = None
        nodes = (placement.place(state, gang, gang.smallest, reserved)
                 if quota_ok and gang.min_slots <= free_now else None)
        # A gang that would not fit an empty cluster gains nothing from victims: planning
        # them anyway walks every running gang for each such shape in every pass.
        if (nodes is None and placement.could_ever_fit(state, gang)
                and preemption.may_help(state, gang, free_now)):
            victims = preemption.plan(state, gang, reserved)
            if victims is not None:
                decisions += preemption.preempt(state, victims, gang, cause, now)
                nodes = placement.place(state, gang, gang.smallest, reserved)
                assert nodes is not None, "preemption plan promised room"
        if nodes is not None:
            state.admit(gang, nodes)
            admitted.append(gang)
            reclaimers = reclaiming_teams(state)
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
        state.shape_blocker[shape] = gang
        if not quota_ok:
            gang.reason = Reason(ReasonCode.QUOTA, explain.quota_message(state, gang, used))
        elif not placement.could_ever_fit(state, gang):
            gang.reason = Reason(ReasonCode.UNSCHEDULABLE,
                                 explain.unschedulable_message(state, gang))
        elif len(holders) < state.policy.max_reservations:
            holders.append(gang.job_id)
            held = placement.reserve(state, gang, reserved)
            reserved_total += held
            gang.reason = Reason(ReasonCode.RESERVED, (
                f"needs {explain.need_text(gang)}; holding {held} freed slot(s) for it "
                f"until {gang.min_slots - held} more free up"))
            blocked.discard(shape)  # the next of its shape may still backfill elsewhere
            if j + 1 < len(keys):
                heapq.heappush(heap, (keys[j + 1], shape))
        else:
            waiting_for_capacity = True
            gang.reason = Reason(
                ReasonCode.INSUFFICIENT_CAPACITY,
                functools.partial(explain.capacity_message, state, gang, free_now,
                                  tuple(holders)))
    for gang in dict.fromkeys(admitted):  # a gang may be admitted, evicted, re-admitted
        if gang.state is not JobState.ADMITTED:
            continue  # admitted earlier in this pass, then preempted by a reclaim
        placement.grow(state, gang, reserved)
        gang.changed_at = now
        state.admitted_reason(gang)
        decisions.append(Admit(gang.job_id, tuple(gang.nodes), cause))
    # Growth is tried only with free slots nobody waits for, and once per allocation
    # state (a pass that changed nothing would find what the last one found) or when a
    # gang's cooldown ends.
    if state.short and not holders and not waiting_for_capacity \
            and state.free_total > 0 and (state.regrown_at != state.version
                                          or now >= state.regrow_due):
        decisions += regrow(state, {g.job_id for g in admitted}, cause, now)
        state.regrown_at = state.version
    return decisions


def regrow(state: AdmissionState, admitted: set[str], cause: str, now: float) -> list[Decision]:
    """Running gangs below their cap take free slots back, highest priority first; a
    gang within its cooldown is skipped and looked at again when it ends."""
    grown: list[Decision] = []
    state.regrow_due = math.inf
    for gang in sorted(state.short.values(), key=Gang.order_key):
        if state.free_total <= 0:
            break
        if gang.job_id in admitted:
            continue  # grew with its Admit
        if not gang.rules.may_grow(gang.changed_at, now):
            state.regrow_due = min(state.regrow_due, gang.changed_at + gang.rules.cooldown_s)
            continue
        before = len(gang.nodes)
        placement.grow(state, gang, {})
        if len(gang.nodes) > before:
            gang.changed_at = now
            state.admitted_reason(gang)
            grown.append(Grow(gang.job_id, tuple(gang.nodes), cause))
            why = "free slots" if gang.pinned is None else \
                f"free slots, toward its pin of {gang.pinned}"
            grown += state.resized(gang, ScalingEventKind.GROW, before,
                                   Reason(ReasonCode.ADMITTED, f"grew into {why}"), now,
                                   cause)
    return grown


def reclaiming_teams(state: AdmissionState) -> set[str]:
    """Teams below their nominal quota with gangs waiting, while any team borrows."""
    if not any(used > state.quota(t).nominal for t, used in state.usage.items()):
        return set()
    return {t for t, n in state.pending_by_team.items()
            if n and state.usage.get(t, 0) < state.quota(t).nominal}


def expire(state: AdmissionState, now: float) -> list[Decision]:
    """Fail pending gangs that waited longer than their ``schedule_timeout_s``."""
    decisions: list[Decision] = []
    while state.deadlines and state.deadlines[0][0] < now:
        deadline, _, gang = heapq.heappop(state.deadlines)
        if gang.state is JobState.PENDING and gang.deadline == deadline:
            timeout = gang.spec.schedule_timeout_s
            state.dequeue(gang)
            last = gang.reason.message
            gang.state = JobState.FAILED
            gang.reason = Reason(ReasonCode.TIMEOUT,
                                 f"not admitted within {timeout:g} s; last waiting for: {last}")
            decisions.append(Fail(gang.job_id, gang.reason, "timeout"))
    return decisions


def abandon_overdue(state: AdmissionState, now: float) -> list[Decision]:
    """Planned changes past their deadline: reported, and a growth shrinks back."""
    decisions: list[Decision] = []
    for gang in [g for g in state.changing.values() if changes.overdue(g.change, now)]:
        change = gang.change
        assert change is not None
        timeout_s = gang.spec.scaling.scaling_timeout_s
        announced = changes.abandoned(gang.job_id, change, timeout_s, "scaling-timeout")
        decisions.append(announced)
        state.follow(gang, None)
        size = len(gang.nodes)
        if change.kind is not ScalingEventKind.GROW or size <= change.from_replicas:
            continue
        state.release(gang, gang.nodes[change.from_replicas:])
        gang.changed_at = now
        reason = Reason(ReasonCode.SCALED, announced.reason)
        decisions += [state.shrunk(gang, reason, "scaling-timeout"),
                      *state.resized(gang, ScalingEventKind.SHRINK, size, reason, now,
                                     "scaling-timeout")]
    return decisions
