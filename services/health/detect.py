"""Detection by time and by comparison: hangs, lost nodes, stragglers, blindness. Pure.

Rules 3, 4, 5 and 7 of :mod:`.core`. :func:`due` judges, in time order, every timeout
and every node charge that fell due by ``now`` (nothing while the detector is blind): a
rank silent past its hang timeout hangs (:func:`hang`), a node silent past the node
timeout is lost with its ranks (:func:`lose`). :func:`heartbeat` brings a lost node back
and re-arms its ranks; :func:`resumed` gives everything a full timeout after blindness;
:func:`straggler` compares a rank's step time with the other ranks'.
:func:`next_deadline` says when :func:`due` has something to judge next.
"""

from __future__ import annotations

import heapq
import math
import statistics

from phalanx.schemas.messages import FaultKind
from phalanx.schemas.registry import mass_silence
from phalanx.services.health import cordon, outcome
from phalanx.services.health.events import (
    Decision,
    JudgementHeld,
    MarkNodeAlive,
    MarkNodeLost,
    ProgressReported,
    RaiseFault,
)
from phalanx.services.health.model import HealthState, NodeHealth, RankHealth
from phalanx.services.health.policy import Failure

#: A job of more ranks than this is judged for stragglers against the median of all its
#: ranks' step times, taken at most every MEDIAN_EVERY_S (else: of the others', each report).
LARGE_JOB_RANKS = 1024
MEDIAN_EVERY_S = 1.0


def due(state: HealthState, now: float) -> list[Decision]:
    """Timeouts and charges to judge due by ``now``, in time order (a timeout first
    on a tie: a fault at the very edge of a charge's spread counts for it)."""
    decisions: list[Decision] = []
    while state.judging:
        entry = state.peek()
        timeout = entry[0] if entry is not None and entry[0] < now else math.inf
        charge = state.charges[0][0] if state.charges else math.inf
        if charge < now and charge < timeout:
            decisions += cordon.judge(state, heapq.heappop(state.charges)[2])
        elif timeout < now:
            at, _, _, item = heapq.heappop(state.heap)
            item.queued = False
            if silenced(state, at):
                decisions += hold(state, item, at)
            elif isinstance(item, NodeHealth):
                decisions += lose(state, item, at)
            else:
                decisions += hang(state, item, at)
        else:
            return decisions
    return decisions


def next_deadline(state: HealthState) -> float | None:
    """The earliest deadline of a judged rank or node, or of a node's charge to judge;
    None when nothing is timed (nor while the detector is blind or a mass silence holds
    judgement: only an event ends that)."""
    if not state.judging:
        return None
    entry = state.peek()
    deadlines = [entry[0]] if entry is not None else []
    if state.charges:
        deadlines.append(state.charges[0][0])
    return min(deadlines, default=None)


def hang(state: HealthState, rank: RankHealth, at: float) -> list[Decision]:
    """``rank`` reported nothing past its hang timeout, which ran out at ``at``."""
    rank.hang_raised = True
    job = rank.job
    after = ("since this health service began watching it" if rank.last_step is None
             else f"after step {rank.last_step}")
    detail = (f"rank {rank.rank} reported no progress for more than "
              f"{job.hang_timeout_s:g} s {after}")
    fault = RaiseFault(job.job_id, FaultKind.HANG, rank.node_id, rank.rank, detail,
                       replica_id=rank.replica_id, admission=job.admission)
    decisions = outcome.rank_failed(state, rank, Failure.INFRASTRUCTURE, at, fault)
    cordon.charge(state, rank.node_id, at, FaultKind.HANG, job)
    return decisions


def lose(state: HealthState, node: NodeHealth, at: float) -> list[Decision]:
    """``node`` sent no heartbeat past the node timeout, which ran out at ``at``."""
    node.lost = True
    why = f"no heartbeat for more than {state.policy.node_timeout_s:g} s"
    decisions: list[Decision] = [MarkNodeLost(node.node_id, why)]
    for rank in state.ranks_on(node.node_id):
        if state.jobs.get(rank.job.job_id) is not rank.job:
            continue  # the job failed with an earlier rank on this node
        rank.hang_raised = True
        if rank.job.departing.get(rank.rank) is rank:
            del rank.job.departing[rank.rank]  # its fault is all that is left to say
        fault = RaiseFault(rank.job.job_id, FaultKind.NODE_LOST, node.node_id, rank.rank,
                           f"rank {rank.rank}'s node {node.node_id} was lost: {why}",
                           replica_id=rank.replica_id, admission=rank.job.admission)
        decisions += outcome.rank_failed(state, rank, Failure.INFRASTRUCTURE, at, fault)
    cordon.charge(state, node.node_id, at, FaultKind.NODE_LOST, None)
    return decisions


def _heard(state: HealthState) -> dict[str, float]:
    """When each node whose silence is judged (heard from, not lost) was last heard, or
    is judged as heard."""
    return {node.node_id: heard for node in state.nodes.values()
            if not node.lost and (heard := node.heard) is not None}


def silenced(state: HealthState, at: float) -> bool:
    """Whether every node not lost, at least two, is silent at ``at``
    (:func:`~phalanx.schemas.registry.mass_silence`): a node or a rank timing out then
    is not judged. A rank's hang timeout is often the shorter (2 s by default against
    the node's 3 s), and its reports stop with its node's heartbeats."""
    return mass_silence(_heard(state).values(), at, state.policy.node_timeout_s)


def hold(state: HealthState, item: RankHealth | NodeHealth, at: float) -> list[Decision]:
    """A mass silence from ``at`` on: nothing is judged until a node is heard again."""
    state.silent_since = at
    state.arm(item)  # judged again once the silence ends, after a full timeout
    silent = sorted(_heard(state))
    return [JudgementHeld(True, (
        f"every node fell silent at once ({', '.join(silent)}): more likely this service's "
        "or the network's fault than every node's; no node or rank is judged until one "
        "is heard again"))]


def heartbeat(state: HealthState, node_id: str, now: float) -> list[Decision]:
    """A heartbeat from ``node_id`` at ``now``: alive again if it was lost; the end of a
    mass silence (every node and rank a full timeout from now) if one was under way."""
    node = state.node(node_id)
    decisions: list[Decision] = []
    if state.silent_since is not None:
        decisions.append(JudgementHeld(False, (
            f"{node_id} heard after {now - state.silent_since:.1f} s in which no node was: "
            "every node and rank is judged again, the silence not held against any")))
        state.silent_since = None
        resumed(state, now, unheard_since=max(_heard(state).values(), default=now))
        decisions += due(state, now)  # the charges that fell due meanwhile
    if node.lost:
        heard = node.heard
        assert heard is not None
        node.lost = False
        decisions.append(MarkNodeAlive(node_id, (
            f"heartbeats resumed after {now - heard:.1f} s of silence")))
        for rank in state.ranks_on(node_id):
            rank.hang_since = max(rank.hang_since, now)  # a full timeout from the return
            state.arm(rank)
    node.last_heartbeat = now
    state.arm(node)
    return decisions


def resumed(state: HealthState, now: float, unheard_since: float | None = None) -> None:
    """The detector hears again at ``now``: every reporting rank gets a full timeout from
    then, and every node too; or, after a mass silence (``unheard_since``: when the last
    node was heard before it), only the span no node was heard in is held against no node.
    A node silent before that span stays that long closer to its timeout: with a full
    timeout each time, a dead node whose survivors' heartbeats came late at each of its
    deadlines (a loaded machine) was never judged lost.

    After blindness (a takeover, a reconnection) a node that a running rank of a watched
    job is on is judged too, though this detector never heard it: as if heard at ``now``.
    A node that died just before a takeover sends nothing the new leader could hear; its
    ranks, if still starting up or with a long hang timeout, were otherwise never judged,
    and the job waited on them for good."""
    running_on = {rank.node_id for job in state.jobs.values()
                  for rank in [*job.ranks.values(), *job.departing.values()]
                  if rank.exit is None} if unheard_since is None else set()
    for node_id in running_on:
        state.node(node_id)
    for node in state.nodes.values():
        heard = node.heard
        if unheard_since is None:
            if heard is not None or node.node_id in running_on:
                node.heard_from = now
        elif heard is not None:
            node.heard_from = heard + now - unheard_since
        state.arm(node)
    for job in state.jobs.values():
        for rank in job.ranks.values():
            rank.hang_since = max(rank.hang_since, now)
            state.arm(rank)


def straggler(state: HealthState, rank: RankHealth, event: ProgressReported,
              now: float) -> list[Decision]:
    """Judge ``rank``'s latest step time against the median of the other ranks'."""
    policy = state.policy
    job = rank.job
    if len(job.ranks) > LARGE_JOB_RANKS:
        # The median of all of a large job's ranks, taken at most once a second: one
        # rank moves it by nothing that matters, and taking it at every report (O(ranks))
        # was 1.3 ms a report at 16,384 ranks, more than health's whole core.
        if job.median is None or now - job.median[0] >= MEDIAN_EVERY_S:
            times = [r.step_time for r in job.ranks.values()
                     if r.exit is None and r.step_time is not None]
            job.median = (now, statistics.median(times) if times else 0.0, len(times) - 1)
        _, median, count = job.median
        others: list[float] | None = None
    else:
        others = [r.step_time for r in job.ranks.values()
                  if r is not rank and r.exit is None and r.step_time is not None]
        median, count = (statistics.median(others) if others else 0.0), len(others)
    if count < 1 or count + 1 < policy.straggler_min_ranks:
        rank.slow_reports = 0
        return []
    if not event.step_time_s > policy.straggler_factor * median:
        rank.slow_reports = 0
        rank.straggler_raised = False
        return []
    rank.slow_reports += 1
    if rank.straggler_raised or rank.slow_reports < policy.straggler_steps:
        return []
    rank.straggler_raised = True
    detail = (f"rank {rank.rank} took {event.step_time_s:.3g} s for step {event.step}, "
              f"over {policy.straggler_factor:g} x the median {median:.3g} s of the other "
              f"{count} rank(s), for {rank.slow_reports} reports in a row")
    fault = RaiseFault(rank.job.job_id, FaultKind.STRAGGLER, rank.node_id, rank.rank, detail,
                       replica_id=rank.replica_id, admission=rank.job.admission)
    cordon.strike(state, rank.job.job_id, rank.node_id, now)
    cordon.charge(state, rank.node_id, now, FaultKind.STRAGGLER, rank.job)
    return [fault]
