"""What each event does to the health model: watches, starts, exits, progress. Pure.

Rules 1, 2 and 9 of :mod:`.core`, and its *Departing* rule. :func:`handle` first applies
the timeouts due by the event's ``now`` (:func:`.detect.due`), then the event's own rule:
a watch replaces a job's placement (:func:`watched`), a start judges a rank afresh
(:func:`started`), an exit is a crash, a finish or nothing (:func:`exited`), a progress
report re-arms the hang rule and is judged for stragglers (:func:`progress`), a member's
first step in a generation makes it a reporting rank (:func:`applied`); heartbeats,
blindness and cordons go to :mod:`.detect` and :mod:`.cordon`.
"""

from __future__ import annotations

from phalanx.schemas.messages import FaultKind
from phalanx.schemas.replicas import another_admission, earlier
from phalanx.services.health import cordon, detect, outcome
from phalanx.services.health.crash import crash_detail
from phalanx.services.health.events import (
    EVENTS,
    ChaosInjected,
    Decision,
    Event,
    HeartbeatSeen,
    JobUnwatched,
    JobWatched,
    MemberApplied,
    NodeUncordoned,
    ProgressReported,
    RaiseFault,
    RankExitSeen,
    RankStartSeen,
    WatchLost,
    WatchResumed,
)
from phalanx.services.health.model import HealthState, JobHealth, RankExit, RankHealth
from phalanx.services.health.policy import Failure, classify_exit


def handle(state: HealthState, event: Event, now: float) -> list[Decision]:
    """Apply one event at ``now``: the timeouts due by then, then the event's own rules.

    Raises:
        TypeError: not one of :mod:`.events`' events.
    """
    if not isinstance(event, EVENTS):
        raise TypeError(f"unknown event {event!r}")
    now = state.advance(now)
    if isinstance(event, WatchLost):
        state.blind = True
        return []
    if isinstance(event, WatchResumed):
        state.blind = False
        state.silent_since = None  # a full timeout for everything, from now
        detect.resumed(state, now)  # before anything falls due: the silence proves nothing
        return detect.due(state, now)  # the charges that fell due meanwhile
    decisions = detect.due(state, now)
    match event:
        case JobWatched():
            watched(state, event)
        case JobUnwatched():
            job = state.jobs.pop(event.job_id, None)
            if job is not None:
                state.changed.add(event.job_id)
                if job.progress_due:  # its last step is stored: admitted again, it goes on
                    state.ended_progress.append(job.progress(now))
        case RankStartSeen():
            started(state, event)
        case RankExitSeen():
            decisions += exited(state, event, now)
        case ProgressReported():
            decisions += progress(state, event, now)
        case MemberApplied():
            applied(state, event, now)
        case HeartbeatSeen():
            decisions += detect.heartbeat(state, event.node_id, now)
        case NodeUncordoned():
            cordon.uncordon(state, event.node_id)
        case ChaosInjected():
            cordon.chaos(state, event.node_id, event.until)
    return decisions


def watched(state: HealthState, event: JobWatched) -> None:
    """Watch a job's (new) placement; a new placement of the same admission keeps its
    spending, progress and running ranks of the slots it no longer holds (departing)."""
    old = state.jobs.get(event.job_id)
    if old is not None and another_admission(old.admission, event.admission):
        old = None  # admitted again, the requeue between unseen: nothing carries over
    slots = tuple(event.slots) or tuple(range(len(event.nodes)))
    if (old is not None and old.nodes == event.nodes and old.slots == slots
            and old.hang_timeout_s == event.hang_timeout_s
            and old.budget.policy == event.restart_policy):
        return  # a replay
    job = JobHealth(event.job_id, tuple(event.nodes), event.hang_timeout_s, slots,
                    admission=event.admission)
    if old is not None:  # a new placement of the same admission: the spending goes on
        job.budget, job.completed, job.final_step = old.budget, old.completed, old.final_step
        job.track, job.progress_due = old.track, old.progress_due
        job.generation = old.generation
        job.progress_taken = old.progress_taken
        for slot, rank in [*old.ranks.items(), *old.departing.items()]:
            if slot not in slots and rank.exit is None:
                rank.job = job
                job.departing[slot] = rank
    job.budget.policy = event.restart_policy
    job.ranks = {slot: RankHealth(job, slot, node_id, round=job.budget.round)
                 for slot, node_id in zip(slots, job.nodes, strict=True)}
    state.jobs[event.job_id] = job  # old rank entries in the heap are stale now
    state.changed.add(event.job_id)


def started(state: HealthState, event: RankStartSeen) -> None:
    """A placed rank started (again): judged afresh, in the job's current restart round."""
    job = state.jobs.get(event.job_id)
    old = None if job is None else job.ranks.get(event.rank)
    if old is not None and not another_admission(old.job.admission, event.admission):
        old.job.ranks[event.rank] = RankHealth(old.job, event.rank, event.node_id,
                                               event.replica_id,
                                               round=old.job.budget.round)
        state.changed.add(event.job_id)


def exited(state: HealthState, event: RankExitSeen, now: float) -> list[Decision]:
    """A rank's process ended: a crash, the training's completion, or nothing to say."""
    rank = state.rank(event.job_id, event.rank)
    if event.cause == "launch_failed" and rank is not None \
            and _succeeds(event.replica_id, rank.replica_id):
        # A command that cannot start never reports a start: its failure is its start
        # too, in the round now running (a replacement's, or a whole gang's again).
        started(state, RankStartSeen(event.job_id, event.rank, event.node_id, 0,
                                     event.replica_id, event.admission))
        rank = state.rank(event.job_id, event.rank)
    if rank is None or rank.exit is not None or rank.node_id != event.node_id \
            or another_admission(rank.job.admission, event.admission):
        return []  # not a rank watched now (an earlier admission's too: its ids recur)
    if rank.replica_id is None:
        rank.replica_id = event.replica_id
    elif event.replica_id is not None and event.replica_id != rank.replica_id:
        return []  # an earlier incarnation's late exit
    state.changed.add(event.job_id)
    job = rank.job
    if job.departing.get(event.rank) is rank:
        del job.departing[event.rank]
        if event.cause == "stopped" or (event.exit_code == 0 and event.signal is None):
            return []  # a leaver's end, whatever the others still do
    elif event.cause == "stopped":
        rank.exit = RankExit.STOPPED
        return outcome.finish_if_done(state, job)
    elif (event.exit_code == 0 and event.signal is None) or rank.done or job.completed:
        # Training was over: whatever ends a process after the last commit is not a
        # failure (an exit status lost with a restarted agent; gloo timing out at exit
        # in a script that never closed its session).
        rank.exit = RankExit.DONE
        job.completed = True
        return outcome.finish_if_done(state, job)
    rank.exit = RankExit.CRASHED
    failure = classify_exit(event.cause, event.exit_code, event.signal)
    fault = RaiseFault(event.job_id, FaultKind.CRASH, event.node_id, event.rank,
                       crash_detail(event), event.exit_code, event.signal,
                       rank.replica_id, admission=job.admission)
    decisions = outcome.rank_failed(state, rank, failure, now, fault)
    # The script's own failures are no node's, nor is its agent's orderly shutdown.
    if failure is Failure.INFRASTRUCTURE and not event.with_agent:
        cordon.charge(state, event.node_id, now, FaultKind.CRASH, job)
    if state.jobs.get(job.job_id) is job:
        decisions += outcome.finish_if_done(state, job)
    return decisions


def _succeeds(replica: str | None, watched: str | None) -> bool:
    """Whether ``replica`` succeeds ``watched`` in its slot: another replica, not an
    earlier incarnation (any replica succeeds a rank watched since its placement, not
    yet named)."""
    if replica is None or replica == watched:
        return False
    return watched is None or not earlier(replica, watched)


def _running(job: JobHealth, replica_id: str) -> RankHealth | None:
    """The running rank of ``replica_id``: first where its id says (``r<slot>-<n>`` runs
    as rank ``slot`` of a job of one-rank replicas), else the first of the job's ranks
    that is it. A scan of every rank for every report took 7 s of health's CPU for the
    applied reports of one 16,384-member generation, and held a crash's fault behind
    them."""
    slot, _, incarnation = replica_id.removeprefix("r").partition("-")
    if slot.isdigit() and incarnation.isdigit():
        rank = job.ranks.get(int(slot))
        if rank is not None and rank.replica_id == replica_id and rank.exit is None:
            return rank
    return next((r for r in job.ranks.values()
                 if r.replica_id == replica_id and r.exit is None), None)


def applied(state: HealthState, event: MemberApplied, now: float) -> None:
    """A replica committed its first step in a generation: it reports from now on (judged
    for hangs), even if no report of it was heard. A report says more, when there is one."""
    job = state.jobs.get(event.job_id)
    if job is not None and event.generation is not None:
        job.generation = max(job.generation, event.generation)
    rank = None if job is None else _running(job, event.replica_id)
    if rank is None or rank.reporting:
        return
    rank.reporting = True
    rank.hang_since = now  # no report yet: its step time and report time stay unknown
    rank.last_step = event.step
    rank.hang_raised = False
    state.arm(rank)
    state.changed.add(event.job_id)


def progress(state: HealthState, event: ProgressReported, now: float) -> list[Decision]:
    """A rank's progress report: the job's step, the hang rule re-armed, stragglers.

    A report of a generation older than the newest a member of the job applied or
    reported in is a rank the job moved past (cut from its peers or the bus and fenced
    out, still reporting until its agent stops it): it moves neither the job's step, nor
    its restart budget, nor any rank's hang timer."""
    rank = state.rank(event.job_id, event.rank)
    if rank is None or rank.exit is not None:
        return []
    if event.generation is not None:
        if event.generation < rank.job.generation:
            return []  # a rank fenced out, still reporting: neither the step nor a hang
        rank.job.generation = event.generation
    if rank.job.budget.progressed(event.step):  # a streak of restarts ended
        state.changed.add(event.job_id)
    if rank.job.departing.get(rank.rank) is rank:  # counts for the job's step, no more
        if rank.job.track.reported(event.step, event.total_steps, now):
            rank.job.progress_due = True
        return []
    if not rank.reporting or (rank.replica_id is None and event.replica_id is not None):
        rank.reporting = True
        rank.replica_id = rank.replica_id or event.replica_id
        state.changed.add(event.job_id)
    rank.last_progress = rank.hang_since = now
    if rank.job.track.reported(event.step, event.total_steps, now):
        rank.job.progress_due = True
    rank.done = event.final
    if event.final and rank.job.final_step != event.step:
        rank.job.completed, rank.job.final_step = True, event.step
        state.changed.add(event.job_id)
    rank.last_step = event.step
    rank.step_time = event.step_time_s
    rank.hang_raised = False
    state.arm(rank)
    return detect.straggler(state, rank, event, now)
