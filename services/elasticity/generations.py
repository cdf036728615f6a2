"""A managed job's generations: faults, replacements, joins and leaves, one at a time. Pure.

From its first ready replica on (:mod:`.gang` before that), a job's membership is a
sequence of generations: an ordered member list (rank = position), a fresh rendezvous
namespace, the step to resume at and why it changed. :func:`handle` applies one event
to it; :func:`decide` decides the next generation when one is due, and the replacements
to launch.
"""

from __future__ import annotations

import dataclasses

import msgspec

from phalanx.schemas.messages import (
    CAUSE_CHARS,
    HISTORY_LIMIT,
    Generation,
    GenerationReason,
    GenerationRecord,
    Member,
)
from phalanx.schemas.replicas import replica_id
from phalanx.services.elasticity.causes import brief, clip, listing
from phalanx.services.elasticity.events import (
    Decision,
    Event,
    GenerationAppliedSeen,
    GenerationGivenUpSeen,
    JobAdmitted,
    LaunchReplacement,
    MemberFailed,
    MemberFinished,
    PublishGeneration,
    ReplicaExited,
    ReplicaReadySeen,
    RetireReplica,
)
from phalanx.services.elasticity.history import within_budget
from phalanx.services.elasticity.model import JobMembership, Replica, slot_of

#: How long a job whose state no survivor holds waits for every replacement launched.
GATHER_S = 30.0


def handle(job: JobMembership, event: Event, now: float) -> list[Decision]:
    """Apply one event to a managed job at ``now``, then :func:`decide`.

    Once a member has finished the training, the core hands it nothing more.
    """
    decisions: list[Decision] = []
    match event:
        case MemberFinished():
            return _finished(job, event)
        case JobAdmitted():
            if event.slots == job.slots:
                return []  # the same record seen again
            decisions += _placed(job, event)
        case ReplicaExited():
            decisions += _left_uncleanly(job, event, now)
        case MemberFailed() if event.replica_id in job.departing:
            why = f"{event.replica_id} failed while leaving ({brief(event.detail)})"
            decisions += _leaver_failed(job, why, event.event_id, now)
        case MemberFailed():
            decisions += _failed(job, event)
        case ReplicaReadySeen():
            _ready(job, event)
        case GenerationGivenUpSeen():
            _given_up(job, event)
        case GenerationAppliedSeen():
            _applied(job, event)
    return decisions + decide(job, now, event.event_id)


def decide(job: JobMembership, now: float, cause: str) -> list[Decision]:
    """The next generation, if one is due at ``now``, and the replacements to ask for."""
    decisions = _advance(job, now, cause)
    return decisions + _launches(job)


def _placed(job: JobMembership, event: JobAdmitted) -> list[Decision]:
    """A record with other slots than the job's: new slots get ``r<s>-0`` (admission grew
    the job); slots gone get no more replacements, and their members leave
    (:func:`_slots_taken`)."""
    # Admission never reuses a slot number within an admission, so a number seen before
    # is not a new slot (nothing is launched for it).
    for slot in sorted(set(event.slots) - set(job.incarnation)):
        job.launched[replica_id(slot, 0)] = slot
        job.incarnation[slot] = 0
    stops = _slots_taken(job, set(job.slots) - set(event.slots), event.event_id)
    job.slots = dict(event.slots)
    return stops


def _applied(job: JobMembership, event: GenerationAppliedSeen) -> None:
    """A member applied the current generation (an older one's report only goes into the
    history). The highest step any member ever reported committed is the job's high
    water: every member that applied a generation holds that far; progress beyond it
    gives the replacement budget back (as health's restart guard counts), so a long job
    that trains through faults is never starved of replacements. The history keeps the
    longest pause any member reported applying it."""
    _record_resumed(job, event)
    if job.current is None or event.generation != job.current.generation \
            or event.replica_id not in job.member_set:
        return
    job.applied.add(event.replica_id)
    job.committed[event.replica_id] = max(
        event.committed_step, job.committed.get(event.replica_id, 0))
    if event.committed_step > job.high_water:
        job.high_water = event.committed_step
        if job.replacement_budget is not None:
            job.replacements_left = job.replacement_budget
    if not job.in_flight:
        job.departing.clear()  # the leave is done: the leavers are gone
        job.given_up = ""  # formed after all: nothing to decide again
    last = job.history[-1] if job.history else None
    if event.pause_s is not None and last is not None \
            and last.generation == event.generation \
            and (last.pause_s is None or event.pause_s > last.pause_s):
        job.history[-1] = msgspec.structs.replace(last, pause_s=event.pause_s)


def _failed(job: JobMembership, event: MemberFailed) -> list[Decision]:
    """A replica failed: a member is dropped in the next generation (:func:`_advance`),
    one launched or ready is forgotten, and its slot gets a new replica.

    Not when its node is lost (not ``replaceable``), its slot is gone, it is an earlier
    incarnation than the slot's latest, or the job's ``max_replacements`` are used up:
    that many without the job committing a step beyond its high water between them
    (:func:`_applied`). The replacement is asked for by :func:`_launches`.
    """
    replica = event.replica_id
    job.forming.discard(replica)
    if replica in job.member_set:
        if replica in job.failed:
            return []
        job.failed[replica] = brief(event.detail)
        job.applied.discard(replica)
        slot = job.replicas[replica].slot
    elif replica in job.launched:
        slot = job.launched.pop(replica)
    elif replica in job.replicas:  # ready, not yet a member
        slot = job.replicas.pop(replica).slot
        job.ready.remove(replica)
    else:
        return []  # an old incarnation, or never ours
    if not event.replaceable or job.replacements_left == 0 or slot not in job.slots \
            or job.incarnation.get(slot, 0) != slot_of(replica)[1]:
        return []
    job.replacements_left -= 1
    job.replaced += 1
    job.incarnation[slot] += 1
    new = replica_id(slot, job.incarnation[slot])
    job.launched[new] = slot
    job.to_launch.append(LaunchReplacement(job.job_id, slot, job.slots[slot], new,
                                           event.event_id))
    return []


def _slots_taken(job: JobMembership, slots: set[int], cause: str) -> list[Decision]:
    """Admission took ``slots``: their members leave; replicas there that are not
    members are stopped now.

    Members leave whatever the reason admission took the slots (preemption, reclaim, a
    pin, or a node lost: a shrink to an allowed size also gives back slots on healthy
    nodes, and a node judged lost may still run its ranks): as soon as no change is in
    flight, a ``leave`` generation without them is published (:func:`_advance`). They
    take part in the step in flight, every member switches after the same step, and the
    leavers then exit 0. A leaver that cannot take part (its node is gone) is failed by
    health's node-lost fault, which supersedes the leave.
    """
    stops: list[Decision] = []
    for replica in [r for r in job.members if job.replicas[r].slot in slots]:
        if replica not in job.failed and replica not in job.leaving:
            job.leaving.append(replica)
    for replica in [r for r in job.ready if job.replicas[r].slot in slots]:
        job.ready.remove(replica)
        slot = job.replicas.pop(replica).slot
        stops.append(RetireReplica(job.job_id, slot, job.slots[slot], replica, cause))
    for replica, slot in [(r, s) for r, s in job.launched.items() if s in slots]:
        del job.launched[replica]
        job.forming.discard(replica)
        stops.append(RetireReplica(job.job_id, slot, job.slots[slot], replica, cause))
    job.to_launch = [d for d in job.to_launch if d.slot not in slots]
    return stops


def _left_uncleanly(job: JobMembership, event: ReplicaExited, now: float) -> list[Decision]:
    """A leaver that did not leave by the step boundary (its agent stopped it after
    ``graceful_shutdown_timeout_s``): handled as a fault. Before the leave is published
    it is dropped like a failed member; after, see :func:`_leaver_failed`."""
    replica = event.replica_id
    why = f"{replica} did not leave cleanly ({brief(event.detail, 'stopped')})"
    if replica in job.leaving:
        job.leaving.remove(replica)
        if replica not in job.failed:
            job.failed[replica] = why
            job.applied.discard(replica)
        return []
    if replica in job.departing:
        return _leaver_failed(job, why, event.event_id, now)
    return []


def _leaver_failed(job: JobMembership, why: str, cause: str, now: float) -> list[Decision]:
    """A member of the previous generation that a leave dropped failed (stopped after
    overstaying, or its node lost) while the leave is in flight: the others may be
    blocked in a step with it, so the same members start over."""
    if not job.in_flight:
        return []  # the leave is done: it is gone already
    job.departing.clear()
    job.failed.clear()
    return _next(job, job.members, [], GenerationReason.FAULT, why, cause, now)


def _finished(job: JobMembership, event: MemberFinished) -> list[Decision]:
    """A member exited 0: the training is over. Replicas still starting or waiting to
    join are stopped, and nothing is launched or published for the job any more."""
    if event.replica_id not in job.member_set:
        return []
    job.complete = True
    # Never asked for: nothing to stop (one asked of a spare may run).
    unlaunched = {d.replica_id for d in job.to_launch if not d.warm_only}
    # A member of the generation in flight that never trained (a joiner taken in as
    # the training ended) cannot form it without the member that finished, nor end
    # by itself: it would wait for a newer generation, and its job for it, for ever.
    joined = {r: job.replicas[r].slot for r in job.members
              if r not in job.committed and r != event.replica_id and r in job.replicas}
    waiting = {r: job.replicas[r].slot for r in job.ready} | joined | {
        r: slot for r, slot in job.launched.items() if r not in unlaunched}
    job.ready.clear()
    job.launched.clear()
    job.forming.clear()
    job.to_launch.clear()
    job.waiting_since = None
    return [RetireReplica(job.job_id, slot, job.slots[slot], replica, event.event_id)
            for replica, slot in sorted(waiting.items()) if slot in job.slots]


def _given_up(job: JobMembership, event: GenerationGivenUpSeen) -> None:
    """A member gave the current generation up: it is decided again (in
    :func:`_advance`), like a fault's: the same members, minus any that failed
    meanwhile, with joiners ready then, a fresh rendezvous namespace. A report that
    names members the reporter cannot reach drops them instead, as failed and not
    replaced (:func:`cut_off`), or, from the smaller side of a cut, changes nothing.

    Members that cannot form a generation (its rank 0's store timed out under load), or
    whose collectives in it failed with none of them faulted (a link between them cut or
    lossy), wait for a newer one, none of them dead, so no fault would ever supersede it.
    A report of an older generation (decided again already, or superseded), by a
    replica that is not a member, or repeated changes nothing, so it is re-formed at
    most once.
    """
    if job.current is None or event.generation != job.current.generation \
            or event.replica_id not in job.member_set or job.given_up or job.complete:
        return
    if event.unreachable:
        for replica in cut_off(job.members, event.replica_id, event.unreachable):
            if replica not in job.failed:
                job.failed[replica] = f"unreachable from {event.replica_id}"
                job.applied.discard(replica)
        return
    job.given_up = f"{event.replica_id} gave up generation {event.generation} " \
        f"({brief(event.reason, 'rendezvous failed')})"


def cut_off(members: list[str], reporter: str, unreachable: tuple[str, ...]) -> list[str]:
    """The members a report from ``reporter`` that it cannot reach ``unreachable`` drops.

    A link cut between nodes splits a generation in two sides, and the members of both
    report the other side unreachable. The larger side stays, so that one node cut off
    from the rest (its own link down) cannot drop the rest; on a tie, the side of the
    generation's rank 0 (``members[0]``) stays, so both sides' reports agree whichever
    comes first. A report from the side that does not stay drops nobody: it waits for
    the other side's, or for a newer generation. A cut that splits the members three
    ways is undone one report at a time (each newer generation that still cannot finish
    a collective is reported again), never dropping a reporter.
    """
    named = [r for r in members if r in unreachable and r != reporter]
    if reporter not in members or not named:
        return []
    stays = len(members) - len(named)
    if stays > len(named) or (stays == len(named) and members[0] not in named):
        return named
    return []


def _ready(job: JobMembership, event: ReplicaReadySeen) -> None:
    """A replica launched is ready: it joins in the next generation (:func:`_allowed`).
    A replica becomes a member only once ready, so survivors never wait for a process to
    start."""
    replica = event.replica_id
    if replica in job.member_set or replica in job.replicas:
        return  # repeated
    if job.launched.get(replica) != event.slot:
        return  # superseded by a newer incarnation, or unknown
    del job.launched[replica]
    job.forming.discard(replica)
    job.replicas[replica] = Replica(replica, event.slot, event.node_id, event.endpoint)
    job.ready.append(replica)
    if any(d.replica_id == replica and d.warm_only for d in job.to_launch):
        job.warm_ready.append(replica)


def _advance(job: JobMembership, now: float, cause: str) -> list[Decision]:
    """Decide the next generation if one is due.

    * Generation 0 forms once every replica launched at first is ready or failed, from
      the ready ones in slot order, if at least ``min``.
    * One change at a time: a generation is in flight until every member has applied it;
      joins and leaves arriving meanwhile wait for it. A fault, or a member giving it up,
      supersedes it (the members cannot finish building a process group with a dead
      peer), and so does a warm spare's replacement ready meanwhile: the survivors
      rebuild once more with it, rather than train a step short-handed and pause for it
      a step later.
    * A fault drops the failed members if at least ``min`` remain; survivors keep their
      relative order (and so their ranks); leavers not yet gone go with it. Below ``min``
      the job waits (:func:`_wait`).
    """
    if job.current is None:
        if job.forming or len(job.ready) < job.min_members:
            return _wait(job, now, len(job.ready))
        joiners = _allowed(job, 0, sorted(job.ready, key=lambda r: job.replicas[r].slot))
        return _next(job, [], joiners, GenerationReason.START, "admitted", cause, now)
    job.warm_ready = [r for r in job.warm_ready if r in job.ready]
    # A fault, or members that gave the generation in flight up: it cannot complete,
    # so the next one is decided now.
    restart = bool(job.failed) or bool(job.given_up)
    if job.in_flight and not restart and not job.warm_ready:
        return []  # joins and leaves wait for the change in flight (but a spare's)
    if not restart and not job.ready and not job.leaving:
        return []  # nothing to change (before the survivors are listed: O(members))
    survivors = [r for r in job.members if r not in job.failed and r not in job.leaving]
    if job.leaving and not restart and len(survivors) >= job.min_members:
        return _next(job, survivors, [], GenerationReason.LEAVE,
                     "left: " + listing(_depart(job)), cause, now)
    if not restart and not job.ready:
        return []
    joiners = _allowed(job, len(survivors), job.ready)
    if len(survivors) + len(joiners) < job.min_members:
        return _wait(job, now, len(survivors) + len(joiners))
    if not restart and not joiners:
        return []  # at max: ready replicas wait for room
    if _gathering(job, survivors, now):
        return []
    if restart:
        reasons = [job.given_up] if job.given_up else []
        if job.failed:
            reasons.append("dropped " + listing([f"{r} ({d})"
                                                 for r, d in sorted(job.failed.items())]))
        why = "; ".join(reasons)
        if job.leaving:  # a fault starts over anyway: the leavers go with it
            why += "; left " + listing(job.leaving)
            for replica in job.leaving:
                job.committed.pop(replica, None)
                job.replicas.pop(replica, None)
            job.leaving.clear()
        if joiners:
            why += "; joined " + listing(joiners)
        return _next(job, survivors, joiners, GenerationReason.FAULT, why, cause, now)
    why = "joined " + listing(joiners)
    if job.leaving:
        # The leave waited below min for these joiners: both are one planned change, the
        # leavers switching out after the same step as everyone (and exiting 0).
        why += "; left " + listing(_depart(job))
    return _next(job, survivors, joiners, GenerationReason.JOIN, why, cause, now)


def _depart(job: JobMembership) -> list[str]:
    """The leavers go in the next generation: no longer the job's replicas, and departing
    until it is applied. Returns them."""
    left, job.departing, job.leaving = list(job.leaving), list(job.leaving), []
    for replica in left:
        job.committed.pop(replica, None)
        job.replicas.pop(replica, None)
    return left


def _gathering(job: JobMembership, survivors: list[str], now: float) -> bool:
    """Whether the next generation waits for more replacements.

    When no survivor holds the job's state (every member died, or those left are
    replacements that never applied a generation), it comes back from the checkpoint
    tiers, each node's memory holding its own ranks' shards: a generation of the first
    replacements ready might see only some nodes' shards and start over while the
    others hold the step. So it waits until every replacement launched is ready, at
    most GATHER_S (one whose node died must not hold the job for ever).
    """
    if job.high_water == 0 or not job.launched \
            or any(r in job.committed for r in survivors):
        job.gather_since = None
        return False
    if job.gather_since is None:
        job.gather_since = now
    return now - job.gather_since < GATHER_S


def _wait(job: JobMembership, now: float, have: int) -> list[Decision]:
    """Below ``min``: survivors keep their state; the timeout starts (a job still short
    after the core's ``wait_timeout_s`` is requeued)."""
    if have < job.min_members and job.waiting_since is None and not job.forming:
        job.waiting_since = now
    return []


def _next(job: JobMembership, survivors: list[str], joiners: list[str],
          reason: GenerationReason, why: str, cause: str, now: float) -> list[Decision]:
    """Publish the next generation: ``survivors`` then ``joiners``, ranked in that order.

    Its resume step is the highest step a survivor reported committed, never less than
    the high water; the members agree on the exact value when they apply it (a report
    can lag behind a commit). It goes into the history (the latest ``HISTORY_LIMIT``)
    with when it was decided.
    """
    for replica in job.failed:
        job.committed.pop(replica, None)
        job.replicas.pop(replica, None)
    for replica in joiners:
        job.ready.remove(replica)
    job.warm_ready = [r for r in job.warm_ready if r in job.ready]
    # Every member that applied a generation holds at least the high-water mark, so a
    # generation whose members cannot provide it has lost the job's state: the runtime
    # refuses it rather than train from scratch (the checkpoint tier's case).
    resume = max([job.committed.get(r, 0) for r in survivors] + [job.high_water])
    number = 0 if job.current is None else job.current.generation + 1
    members = [job.replicas[r] for r in survivors + joiners]
    why = clip(why, CAUSE_CHARS)
    job.current = Generation(
        job_id=job.job_id, generation=number,
        members=[Member(replica_id=r.replica_id, rank=i, node_id=r.node_id,
                        endpoint=r.endpoint) for i, r in enumerate(members)],
        world_size=len(members), rendezvous=f"{job.job_id}-g{number}", resume_step=resume,
        reason=reason, cause=why)
    job.history = within_budget([*job.history[-(HISTORY_LIMIT - 1):], GenerationRecord(
        generation=number, reason=reason, world_size=len(members),
        members=[r.replica_id for r in members], resume_step=resume, decided_at=now,
        cause=why)])
    job.failed.clear()
    job.applied.clear()
    job.given_up = ""
    job.waiting_since = job.gather_since = None
    return [PublishGeneration(job.current, cause)]


def _launches(job: JobMembership) -> list[Decision]:
    """The replacements to ask for now.

    At once while the job has no generation, waits below ``min`` or gathers (nothing
    trains then anyway).

    A cold start (Python, torch, the script's model build) would take the CPU from the
    survivors' repair, so it waits until they have applied the change in flight. A warm
    spare costs that repair nothing: while the change is in flight each replacement is
    asked for once from a spare (``warm_only``), and asked for again, cold, after it.
    The agent starts a replica id at most once, so whichever comes second is a no-op;
    one that became ready or was superseded meanwhile is not asked for again.
    """
    job.to_launch = [d for d in job.to_launch if job.launched.get(d.replica_id) == d.slot]
    if job.current is None or not job.in_flight or job.waiting_since is not None \
            or job.gather_since is not None:
        launches: list[Decision] = [dataclasses.replace(d, warm_only=False)
                                    for d in job.to_launch]
        job.to_launch = []
        return launches
    warm = [dataclasses.replace(d, warm_only=True) for d in job.to_launch if not d.warm_only]
    job.to_launch = [d for d in job.to_launch if d.warm_only] + warm
    return list(warm)


def _record_resumed(job: JobMembership, event: GenerationAppliedSeen) -> None:
    """Keep in the history the step the members of ``event``'s generation resumed after,
    from the first report of it (they all agreed on it when they applied it)."""
    if event.resume_step is None:
        return
    for i in range(len(job.history) - 1, -1, -1):
        record = job.history[i]
        if record.generation == event.generation:
            if record.applied_resume_step is None:
                job.history[i] = msgspec.structs.replace(
                    record, applied_resume_step=event.resume_step,
                    restored_from=event.restored_from)
            return
        if record.generation < event.generation:
            return


def _allowed(job: JobMembership, members: int, ready: list[str]) -> list[str]:
    """The first of ``ready`` that join ``members`` members: up to ``max``, and as many as
    reach the largest allowed size (none if no allowed size above ``members`` is reached)."""
    reach = min(job.max_members, members + len(ready))
    if job.sizes:
        fits = [size for size in job.sizes if members < size <= reach]
        reach = fits[-1] if fits else members
    return ready[:max(0, reach - members)]
