"""The health core under random event streams with a monotone clock.

A scenario is a policy and a list of operations on three nodes and two jobs:
watches (random placements and hang timeouts), job ends, rank starts, exits
and progress reports, heartbeats, uncordons, ticks and waits. Waits are
multiples of 0.25 s and timeouts whole or half seconds, so calls land exactly
on deadlines as often as just after them.

Every call is checked against a model kept outside the core: a plain
re-statement of the rules that scans everything each time (no heap, no lazy
entries) and predicts the decisions, compared as (type, job, kind, rank,
node) tuples. On top of that, stated directly from the stream: no hang fault
before its rank's last report plus the hang timeout, at most one hang fault
per silence, no fault for a job that is not watched, and ``next_deadline``
is the earliest moment a tick decides anything (a tick at it decides nothing,
just after it something). ``check_invariants`` runs after every call. Apart,
the decisions of a stream do not depend on how often it is ticked, and
heartbeats and reports within their timeouts never fault.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from collections.abc import Callable

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import FaultKind, RestartPolicy
from phalanx.services.health.core import HealthCore
from phalanx.services.health.events import (
    ChaosInjected,
    CordonNode,
    Decision,
    Event,
    FailJob,
    FinishJob,
    HeartbeatSeen,
    JobUnwatched,
    JobWatched,
    JudgementHeld,
    MarkNodeAlive,
    MarkNodeLost,
    NodeUncordoned,
    ProgressReported,
    RaiseFault,
    RankExitSeen,
    RankStartSeen,
    WatchResumed,
)
from phalanx.services.health.model import HealthPolicy
from phalanx.services.health.stored import snapshot

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)
T0 = 1_717_000_000.0
NODES = ("n0", "n1", "n2")
JOBS = ("j0", "j1")

# --- scenarios ------------------------------------------------------------------------------
# Plain tuples so a counterexample can be pasted into an @example.
#   ("watch", job, nodes, hang)  ("end", job)  ("start", job, rank, node)
#   ("exit", job, rank, code, signal, cause, node or "")  ("progress", job, rank, step_time)
#   ("beat", node)  ("beats",): every node  ("uncordon", node)  ("tick",)  ("wait", seconds)
#   ("slow", job, rank, n): n reports of a slow step in a row
#   ("final", job, rank): the rank reports its last step  ("chaos", node, seconds)
#   ("round", job, slow): every rank of the job reports a step, slow only for rank ``slow``
#   ("commit", job, rank, step): the rank reports ``step`` committed (progress past it)

Op = tuple
NODE = st.sampled_from(NODES)
JOB = st.sampled_from(JOBS)
RANK = st.integers(0, 4)
OP = st.one_of(
    st.tuples(st.just("watch"), JOB, st.lists(NODE, min_size=1, max_size=4).map(tuple),
              st.sampled_from([1.0, 2.0, 2.5, 5.0])),
    st.tuples(st.just("end"), JOB),
    st.tuples(st.just("start"), JOB, RANK, NODE),
    st.tuples(st.just("exit"), JOB, RANK, st.sampled_from([0, 0, 1, 137, None]),
              st.sampled_from([None, None, None, "SIGKILL"]),
              st.sampled_from(["exited", "exited", "stopped", "lost", "launch_failed"]),
              st.sampled_from(["", "", "", "n0"])),
    st.tuples(st.just("progress"), JOB, RANK, st.sampled_from([1.0, 1.0, 1.25, 3.0, 10.0])),
    st.tuples(st.just("progress"), JOB, RANK, st.sampled_from([1.0, 1.0, 1.25, 3.0, 10.0])),
    st.tuples(st.just("commit"), JOB, RANK, st.integers(0, 5)),
    st.tuples(st.just("beat"), NODE),
    st.tuples(st.just("beat"), NODE),
    st.tuples(st.just("uncordon"), NODE),
    st.tuples(st.just("final"), JOB, RANK),
    st.tuples(st.just("chaos"), NODE, st.sampled_from([0.0, 2.0, 10.0])),
    st.tuples(st.just("tick")),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 6.0])),
    st.tuples(st.just("wait"), st.sampled_from([0.25, 0.5, 1.0, 2.0])),
)
POLICY = st.builds(
    HealthPolicy,
    node_timeout_s=st.sampled_from([1.0, 2.0, 3.0]),
    straggler_factor=st.sampled_from([1.5, 2.0]),
    straggler_steps=st.integers(1, 3),
    straggler_min_ranks=st.integers(1, 3),
    cordon_faults=st.integers(1, 4),
    cordon_window_s=st.sampled_from([2.0, 5.0, 300.0]),
    cordon_spread_s=st.sampled_from([0.25, 1.0, 5.0]),
)
RESTARTS = st.builds(
    RestartPolicy,
    max_restarts=st.integers(0, 6),
    max_app_failures=st.integers(0, 2),
    max_restarts_in_window=st.integers(1, 4),
    window_s=st.sampled_from([1.0, 5.0, 300.0]),
)
OPENING = st.tuples(  # both jobs watched and every node heard from, so there is work to judge
    st.tuples(st.just("watch"), st.just("j0"), st.lists(NODE, min_size=2, max_size=4).map(tuple),
              st.sampled_from([1.0, 2.0, 2.5])),
    st.tuples(st.just("watch"), st.just("j1"), st.lists(NODE, min_size=1, max_size=3).map(tuple),
              st.sampled_from([2.0, 5.0])),
    *(st.just(("beat", n)) for n in NODES),
)
BUSY = st.one_of(  # what a running cluster mostly does
    st.tuples(st.just("progress"), JOB, st.integers(0, 3),
              st.sampled_from([1.0, 1.0, 1.0, 1.25, 3.0, 10.0])),
    st.just(("beats",)),
    st.tuples(st.just("wait"), st.sampled_from([0.25, 0.5, 1.0])),
    st.tuples(st.just("slow"), JOB, st.integers(0, 3), st.integers(1, 3)),
    st.tuples(st.just("round"), JOB, st.sampled_from([-1, -1, 0, 1, 2, 3])),
    st.tuples(st.just("exit"), JOB, st.integers(0, 3), st.sampled_from([0, 0, 0, 1, None]),
              st.just(None), st.sampled_from(["exited", "exited", "stopped"]), st.just("")),
    st.tuples(st.just("exit"), JOB, st.integers(0, 3), st.just(None), st.just("SIGKILL"),
              st.just("exited"), st.just("")),
    st.tuples(st.just("commit"), JOB, st.integers(0, 3), st.integers(1, 5)),
)
STREAM = st.builds(lambda opening, ops: [*opening, *ops], OPENING,
                   st.lists(st.one_of(BUSY, BUSY, OP), min_size=20, max_size=80))


def to_event(op: Op, jobs: dict[str, JobModel], restart: RestartPolicy,
             now: float = T0) -> Event | None:
    """The event for ``op``; rank exits default to the node the model says the rank is on."""
    match op:
        case ("watch", job, nodes, hang):
            return JobWatched(job, nodes, hang, restart_policy=restart)
        case ("end", job):
            return JobUnwatched(job)
        case ("start", job, rank, node):
            return RankStartSeen(job, rank, node, 1000 + rank)
        case ("exit", job, rank, code, signal, cause, node):
            if not node:
                model = jobs.get(job)
                r = model.rank(rank) if model else None
                node = r.node if r else "n0"
            return RankExitSeen(job, rank, node, code, signal, cause)
        case ("progress", job, rank, step_time):
            return ProgressReported(job, rank, 1, step_time)
        case ("commit", job, rank, step):
            return ProgressReported(job, rank, step, 1.0)
        case ("final", job, rank):
            return ProgressReported(job, rank, 2, 1.0, final=True)
        case ("chaos", node, seconds):
            return ChaosInjected(node, now + seconds)
        case ("beat", node):
            return HeartbeatSeen(node)
        case ("uncordon", node):
            return NodeUncordoned(node)
    return None


# --- the model outside the core -------------------------------------------------------------

Key = tuple  # (type, job, kind, rank, node) of one decision


def key(d: Decision) -> Key:
    match d:
        case RaiseFault():
            return ("fault", d.job_id, d.kind, d.rank, d.node_id)
        case FinishJob():
            return ("finish", d.job_id, None, None, None)
        case FailJob():
            return ("fail", d.job_id, d.reason_code, None, None)
        case MarkNodeLost() | MarkNodeAlive() | CordonNode():
            return (type(d).__name__, None, None, None, d.node_id)
        case JudgementHeld():
            return ("JudgementHeld", None, d.held, None, None)
    raise TypeError(d)


@dataclasses.dataclass
class RankModel:
    node: str
    exit: str | None = None
    last: float | None = None  # last report
    since: float = -math.inf  # hang clock start: last report, or its node's return
    covered: bool = False  # a hang or node-lost fault since the last report
    done: bool = False  # reported its final step
    step_time: float | None = None
    slow: int = 0
    straggled: bool = False
    round: int = 0  # the job's restart round when it was placed or started


@dataclasses.dataclass
class Budget:
    """The restart policy, restated: what one admission of a job has spent."""

    policy: RestartPolicy
    stalled: list[float] = dataclasses.field(default_factory=list)  # rounds since progress
    round: int = 0  # rounds begun
    step: int = 0  # the job's step when the latest round began
    app: int = 0
    completed: bool = False

    def charge(self, failure: str, at: float, started_in: int, step: int) -> str | None:
        """None: repaired (a restart); else the reason code the job fails with."""
        if self.stalled and started_in != self.round:
            return None  # a rank running since before the round began: the same incident
        if failure != "infra":
            self.app += 1
            if self.app > self.policy.max_app_failures:
                return "launch_failed" if failure == "launch" else "app_failed"
        if len(self.stalled) >= self.policy.max_restarts:
            return "restarts_exhausted"
        if len([t for t in self.stalled if at - t <= self.policy.window_s]) \
                >= self.policy.max_restarts_in_window:
            return "restart_rate"
        self.stalled.append(at)
        self.round += 1
        self.step = max(self.step, step)
        return None


def failure_class(e: RankExitSeen) -> str:
    if e.cause == "launch_failed":
        return "launch"
    if e.cause == "exited" and e.signal is None and e.exit_code is not None \
            and not 128 < e.exit_code <= 128 + 64:
        return "app"
    return "infra"


@dataclasses.dataclass
class JobModel:
    nodes: tuple[str, ...]
    hang: float
    ranks: list[RankModel]
    budget: Budget
    departing: dict[int, RankModel] = dataclasses.field(default_factory=dict)  # by slot
    step: int = 0  # the most any rank reported committed
    final: int | None = None  # the step a final report gave

    def node_count(self) -> int:
        return len({r.node for r in [*self.ranks, *self.departing.values()]})

    def rank(self, i: int) -> RankModel | None:
        """Slot ``i``'s rank: placed there, else departing."""
        return self.ranks[i] if 0 <= i < len(self.ranks) else self.departing.get(i)


class Model:
    def __init__(self, policy: HealthPolicy) -> None:
        self.p = policy
        self.jobs: dict[str, JobModel] = {}
        self.heard: dict[str, float] = {}
        self.lost: set[str] = set()
        self.charges: dict[str, list[float]] = {}  # evidence against each node
        self.cordoned: set[str] = set()
        self.chaos: dict[str, float] = {}  # node -> injected faults until then
        self.struck: list[tuple[float, str, str]] = []  # every fault of a job: at, job, node
        # Charges to judge: (at, seq, node, job or None, nodes of the job, uncordons then).
        self.pending: list[tuple[float, int, str, str | None, int, int]] = []
        self.uncordons: dict[str, int] = {}
        self.seq = 0
        self.silent: float | None = None  # since when every node not lost is silent

    def hang_deadline(self, job: JobModel, r: RankModel) -> float | None:
        if r.exit or r.last is None or r.covered or r.done or r.node in self.lost:
            return None
        return r.since + job.hang

    def timed(self) -> list[tuple[float, tuple, object]]:
        """(deadline, fire order, what) of every judged rank and node."""
        out: list[tuple[float, tuple, object]] = [
            (at + self.p.node_timeout_s, (0, n, 0), n)
            for n, at in self.heard.items() if n not in self.lost]
        for job_id, job in self.jobs.items():
            for i, r in enumerate(job.ranks):
                d = self.hang_deadline(job, r)
                if d is not None:
                    out.append((d, (1, job_id, i), (job_id, i)))
        # A charge after a timeout of the same moment (which may strike the same job).
        out += [(c[0] + self.p.cordon_spread_s, (2, "", c[1]), c) for c in self.pending]
        return out

    def next_deadline(self) -> float | None:
        if self.silent is not None:
            return None
        return min((d for d, _, _ in self.timed()), default=None)

    def charge(self, node: str, at: float, job: str | None, nodes: int) -> None:
        if at > self.chaos.get(node, -math.inf):
            self.seq += 1
            self.pending.append((at, self.seq, node, job, nodes, self.uncordons.get(node, 0)))

    def judge(self, c: tuple[float, int, str, str | None, int, int]) -> list[Key]:
        at, _, node, job, nodes, uncordons = c
        self.pending.remove(c)
        if uncordons != self.uncordons.get(node, 0):
            return []
        if job is not None:
            struck = {n for t, j, n in self.struck
                      if j == job and abs(t - at) <= self.p.cordon_spread_s}
            if len(struck) >= 2 and 2 * len(struck) > nodes:
                return []
        times = [t for t in self.charges.get(node, []) if at - t <= self.p.cordon_window_s]
        self.charges[node] = [*times, at]
        if node in self.cordoned or len(times) + 1 < self.p.cordon_faults:
            return []
        self.cordoned.add(node)
        return [("CordonNode", None, None, None, node)]

    def due(self, now: float) -> list[Key]:
        out: list[Key] = []
        while self.silent is None:
            timed = [t for t in self.timed() if t[0] < now]
            if not timed:
                return out
            at, _, what = min(timed, key=lambda t: (t[0], t[1]))
            if isinstance(what, tuple) and len(what) == 6:
                out += self.judge(what)  # type: ignore[arg-type]
            elif self.everyone_silent(at):
                self.silent = at
                out.append(("JudgementHeld", None, True, None, None))
            elif isinstance(what, str):
                self.lost.add(what)
                out.append(("MarkNodeLost", None, None, None, what))
                for job_id, job in list(self.jobs.items()):
                    for i, r in [*enumerate(job.ranks), *job.departing.items()]:
                        if r.node == what and not r.exit and self.jobs.get(job_id) is job:
                            r.covered = True
                            if job.departing.get(i) is r:
                                del job.departing[i]
                            out += self.failed(job_id, "infra", at,
                                               ("fault", job_id, FaultKind.NODE_LOST, i, what),
                                               r)
                self.charge(what, at, None, 0)
            else:
                job_id, i = what  # type: ignore[misc]
                job = self.jobs[job_id]
                r = job.ranks[i]
                r.covered = True
                nodes = job.node_count()
                out += self.failed(job_id, "infra", at, ("fault", job_id, FaultKind.HANG, i,
                                                         r.node), r)
                self.charge(r.node, at, job_id, nodes)
        return out

    def everyone_silent(self, at: float) -> bool:
        """At least two nodes not lost, none heard within half a node timeout before
        ``at``."""
        heard = [t for n, t in self.heard.items() if n not in self.lost]
        return len(heard) >= 2 and all(at - t > self.p.node_timeout_s / 2 for t in heard)

    def failed(self, job_id: str, failure: str, at: float, fault: Key,
               r: RankModel) -> list[Key]:
        if at > self.chaos.get(fault[4], -math.inf):  # an injected fault strikes nothing
            self.struck.append((at, job_id, fault[4]))
        job = self.jobs[job_id]
        code = job.budget.charge(failure, at, r.round, max(job.step, job.final or 0))
        if code is None:
            return [fault]
        del self.jobs[job_id]
        return [("fail", job_id, code, None, None)]

    def rank(self, job_id: str, i: int) -> RankModel | None:
        """A placed rank (departing ones only exit or are lost)."""
        job = self.jobs.get(job_id)
        return job.ranks[i] if job is not None and 0 <= i < len(job.ranks) else None

    def apply(self, e: Event, now: float) -> list[Key]:
        out = self.due(now)
        match e:
            case JobWatched():
                old = self.jobs.get(e.job_id)
                if old is None or (old.nodes, old.hang) != (e.nodes, e.hang_timeout_s):
                    budget = old.budget if old is not None else Budget(e.restart_policy)
                    new = self.jobs[e.job_id] = JobModel(
                        e.nodes, e.hang_timeout_s,
                        [RankModel(n, round=budget.round) for n in e.nodes], budget)
                    if old is not None:  # the step, the final step and departing ranks go on
                        new.step, new.final = old.step, old.final
                        new.departing = {
                            i: r for i, r in [*enumerate(old.ranks), *old.departing.items()]
                            if i >= len(e.nodes) and not r.exit}
            case JobUnwatched():
                self.jobs.pop(e.job_id, None)
            case RankStartSeen():
                if self.rank(e.job_id, e.rank) is not None:
                    job = self.jobs[e.job_id]
                    job.ranks[e.rank] = RankModel(e.node_id, round=job.budget.round)
            case RankExitSeen():
                job = self.jobs.get(e.job_id)
                r = job.rank(e.rank) if job is not None else None
                leaving = r is not None and job.departing.get(e.rank) is r
                if r is None or r.exit or r.node != e.node_id:
                    pass
                elif leaving and (e.cause == "stopped"
                                  or (e.exit_code == 0 and e.signal is None)):
                    del job.departing[e.rank]  # a leaver's end: no event
                elif not leaving and e.cause == "stopped":
                    r.exit = "stopped"
                elif not leaving and ((e.exit_code == 0 and e.signal is None) or r.done
                                      or job.budget.completed):
                    r.exit = "done"  # after the training completed, any end is a finish
                    job.budget.completed = True
                else:
                    if leaving:
                        del job.departing[e.rank]
                    r.exit = "crashed"
                    failure = failure_class(e)
                    nodes = job.node_count()
                    out += self.failed(e.job_id, failure, now,
                                       ("fault", e.job_id, FaultKind.CRASH, e.rank, e.node_id), r)
                    if failure == "infra":  # only the infrastructure's failures cordon
                        self.charge(e.node_id, now, e.job_id, nodes)
                if r is not None and r.node == e.node_id and r.exit \
                        and self.jobs.get(e.job_id) is job:
                    exits = [x.exit for x in self.jobs[e.job_id].ranks]
                    if "done" in exits and None not in exits:  # nothing runs any more
                        del self.jobs[e.job_id]
                        out.append(("finish", e.job_id, None, None, None))
            case ProgressReported():
                job = self.jobs.get(e.job_id)
                anyone = job.rank(e.rank) if job is not None else None
                if anyone is not None and not anyone.exit:  # placed or departing: progress
                    job.step = max(job.step, e.step)
                    if e.step > job.budget.step:
                        job.budget.stalled.clear()
                r = self.rank(e.job_id, e.rank)
                if r is not None and not r.exit:
                    r.last = r.since = now
                    r.covered = False
                    r.step_time = e.step_time_s
                    r.done = e.final
                    if e.final:
                        self.jobs[e.job_id].budget.completed = True
                        self.jobs[e.job_id].final = e.step
                    out += self.straggler(e.job_id, e.rank, r, now)
            case HeartbeatSeen():
                if self.silent is not None:  # the silence ends: a full timeout for the
                    self.silent = None  # ranks, the span no node was heard in for the nodes
                    out.append(("JudgementHeld", None, False, None, None))
                    blind = now - max((t for n, t in self.heard.items() if n not in self.lost),
                                      default=now)
                    self.heard = {n: t + blind for n, t in self.heard.items()}
                    for job in self.jobs.values():
                        for r in job.ranks:
                            r.since = max(r.since, now)
                    out += self.due(now)  # the charges that fell due meanwhile
                if e.node_id in self.lost:
                    self.lost.discard(e.node_id)
                    out.append(("MarkNodeAlive", None, None, None, e.node_id))
                    for job in self.jobs.values():
                        for r in job.ranks:
                            if r.node == e.node_id and not r.exit:
                                r.since = max(r.since, now)
                self.heard[e.node_id] = now
            case NodeUncordoned():
                self.cordoned.discard(e.node_id)
                self.charges.pop(e.node_id, None)
                self.uncordons[e.node_id] = self.uncordons.get(e.node_id, 0) + 1
            case ChaosInjected():
                self.chaos[e.node_id] = max(self.chaos.get(e.node_id, -math.inf), e.until)
        return out

    def straggler(self, job_id: str, i: int, r: RankModel, now: float) -> list[Key]:
        assert r.step_time is not None
        others = [x.step_time for x in self.jobs[job_id].ranks
                  if x is not r and not x.exit and x.step_time is not None]
        if len(others) + 1 < self.p.straggler_min_ranks or not others:
            r.slow = 0
            return []
        if r.step_time <= self.p.straggler_factor * statistics.median(others):
            r.slow, r.straggled = 0, False
            return []
        r.slow += 1
        if r.straggled or r.slow < self.p.straggler_steps:
            return []
        r.straggled = True
        self.struck.append((now, job_id, r.node))
        self.charge(r.node, now, job_id, self.jobs[job_id].node_count())
        return [("fault", job_id, FaultKind.STRAGGLER, i, r.node)]


# --- one run ----------------------------------------------------------------------------------


class Run:
    """Feeds a stream to a core and the model, checking every call."""

    def __init__(self, policy: HealthPolicy, restart: RestartPolicy, *, probe: int = 3) -> None:
        self.restart = restart
        self.core = HealthCore(policy)
        self.model = Model(policy)
        self.probe = probe  # tick a copy of the core at every probe-th deadline check (0: never)
        self.checks = 0
        self.now = T0
        self.log: list[Decision] = []
        # Straight from the stream: each rank's last report (since its watch or start).
        self.reported: dict[tuple[str, int], float] = {}
        self.hung: set[tuple[str, int]] = set()  # a hang fault since the last report
        self.hang: dict[str, float] = {}  # each job's hang timeout, from its latest watch

    def op(self, op: Op) -> None:
        if op[0] == "wait":
            self.now += op[1]
            return
        if op[0] == "tick":
            watched = set(self.model.jobs)  # before the ticks: a failed job is dropped
            self.call(self.core.tick(self.now), self.model.due(self.now), watched)
            self.check_deadline()
            return
        if op[0] == "beats":
            for node in NODES:
                self.op(("beat", node))
            return
        if op[0] == "round":
            job = self.model.jobs.get(op[1])
            for rank in range(len(job.ranks) if job else 1):
                self.op(("progress", op[1], rank, 10.0 if rank == op[2] else 1.0))
            return
        if op[0] == "slow":
            for _ in range(op[3]):
                self.op(("progress", op[1], op[2], 10.0))
            return
        event = to_event(op, self.model.jobs, self.restart, self.now)
        assert event is not None
        watched = set(self.model.jobs)
        then = self.then(event)  # judged on the state before the event
        got = self.core.handle(event, self.now)
        self.call(got, self.model.apply(event, self.now), watched)
        then()
        self.check_deadline()

    def then(self, event: Event) -> Callable[[], None]:
        """What ``event`` does to the reports on record, once its call is checked."""
        match event:
            case ProgressReported() if self.model.rank(event.job_id, event.rank):
                rank = (event.job_id, event.rank)
                if not self.model.rank(*rank).exit:  # type: ignore[union-attr]
                    return lambda: self.report(rank)
            case JobWatched():
                old = self.model.jobs.get(event.job_id)
                replay = old is not None and (old.nodes, old.hang) == (event.nodes,
                                                                      event.hang_timeout_s)
                if not replay:
                    def watch() -> None:
                        self.hang[event.job_id] = event.hang_timeout_s
                        self.reset(lambda r: r[0] == event.job_id)
                    return watch
            case JobUnwatched():
                return lambda: self.reset(lambda r: r[0] == event.job_id)
            case RankStartSeen():
                return lambda: self.reset(lambda r: r == (event.job_id, event.rank))
        return lambda: None

    def report(self, rank: tuple[str, int]) -> None:
        self.reported[rank] = self.now
        self.hung.discard(rank)

    def reset(self, which: Callable[[tuple[str, int]], bool]) -> None:
        for rank in [r for r in self.reported if which(r)]:
            del self.reported[rank]
            self.hung.discard(rank)

    def call(self, got: list[Decision], want: list[Key], watched: set[str]) -> None:
        self.core.check_invariants()
        assert [key(d) for d in got] == want
        self.log += got
        # Stated directly: the restart policy's promises.
        for d in got:
            if isinstance(d, FailJob):
                assert d.reason and d.reason_code.value in (
                    "app_failed", "launch_failed", "restarts_exhausted", "restart_rate")
        for job in self.core.jobs.values():
            stalled = job.budget.stalled
            assert len(stalled) <= self.restart.max_restarts, "more rounds than max_restarts"
            assert job.budget.round >= len(stalled)
        for d in got:
            if isinstance(d, RaiseFault):
                assert d.job_id in watched, f"fault for unwatched job {d.job_id}"
            if isinstance(d, RaiseFault) and d.kind is FaultKind.HANG:
                assert d.rank is not None
                rank = (d.job_id, d.rank)
                assert rank in self.reported, "hang fault for a rank that never reported"
                assert self.now > self.reported[rank] + self.hang[d.job_id], "hang too early"
                assert rank not in self.hung, "two hang faults in one silence"
                self.hung.add(rank)

    def check_deadline(self) -> None:
        """``next_deadline`` is the model's; a tick at it decides nothing, just after, something."""
        deadline = self.core.next_deadline()
        assert deadline == self.model.next_deadline()
        assert deadline is None or deadline >= self.now, "a due timeout was not decided"
        self.checks += 1
        if not self.probe or self.checks % self.probe:
            return
        if deadline is None:
            assert copy.deepcopy(self.core).tick(self.now + 1e6) == []
            return
        probe = copy.deepcopy(self.core)
        assert probe.tick(deadline) == []
        charges = len(probe.state.charges)
        # Just after it something is decided, or a charge to a node judged (it may turn out
        # to be the job's, or not enough for a cordon).
        assert probe.tick(math.nextafter(deadline, math.inf)) != [] \
            or len(probe.state.charges) < charges


@SETTINGS
@given(policy=POLICY, ops=STREAM, restart=RESTARTS)
@example(policy=HealthPolicy(straggler_steps=1), restart=RestartPolicy(), ops=[
    # straggles, recovers, straggles again
    ("watch", "j0", ("n0", "n1", "n2"), 2.0), ("beats",), ("round", "j0", -1),
    ("round", "j0", 2), ("round", "j0", 2), ("round", "j0", -1), ("round", "j0", 2)])
def test_core_follows_the_rules(policy: HealthPolicy, ops: list[Op],
                                restart: RestartPolicy) -> None:
    run = Run(policy, restart)
    for op in ops:
        run.op(op)


@settings(SETTINGS, max_examples=150)
@given(policy=POLICY, ops=STREAM, every=st.integers(1, 3), restart=RESTARTS)
def test_decisions_do_not_depend_on_how_often_it_ticks(policy: HealthPolicy, ops: list[Op],
                                                       every: int,
                                                       restart: RestartPolicy) -> None:
    """Ticks only move decisions earlier; the sequence of all of them is the same."""
    sparse, dense = Run(policy, restart, probe=0), Run(policy, restart, probe=0)
    for i, op in enumerate(ops):
        if op[0] != "tick":
            sparse.op(op)
        dense.op(op)
        if i % every == 0:
            dense.op(("tick",))
    sparse.op(("tick",))
    dense.op(("tick",))
    assert sparse.log == dense.log


@SETTINGS
@given(policy=POLICY, hang=st.sampled_from([1.0, 2.5]), ranks=st.integers(1, 4),
       gaps=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40))
def test_no_false_positives_within_the_timeouts(policy: HealthPolicy, hang: float, ranks: int,
                                                gaps: list[float]) -> None:
    """Heartbeats and reports that come late, but within their timeouts, never fault."""
    core = HealthCore(policy)
    now = T0
    nodes = tuple(NODES[i % len(NODES)] for i in range(ranks))
    core.handle(JobWatched("j", nodes, hang), now)
    for gap in gaps:
        # A fraction of the tighter timeout, up to all of it: late, never too late.
        now += gap * min(hang, policy.node_timeout_s)
        assert core.tick(now) == []
        for node in NODES:
            assert core.handle(HeartbeatSeen(node), now) == []
        for rank in range(ranks):
            decisions = core.handle(ProgressReported("j", rank, 1, 1.0), now)
            assert not any(isinstance(d, RaiseFault) and d.kind is not FaultKind.STRAGGLER
                           for d in decisions)
        core.check_invariants()


def crash_and_finish(decisions: list[Decision]) -> list[Key]:
    """The decisions a restart must not change: crash faults, finished and failed jobs."""
    return [key(d) for d in decisions
            if isinstance(d, FinishJob | FailJob)
            or (isinstance(d, RaiseFault) and d.kind is FaultKind.CRASH)]


def plain_events(op: Op, nodes: dict[str, tuple[str, ...]],
                 restart: RestartPolicy, now: float) -> list[Event]:
    """``op`` as plain core events (no model): busy ops become their reports and beats."""
    match op:
        case ("beats",):
            return [HeartbeatSeen(n) for n in NODES]
        case ("round", job, _):
            return [ProgressReported(job, r, 1, 1.0) for r in range(len(nodes.get(job, ())))]
        case ("slow", job, rank, n):
            return [ProgressReported(job, rank, 1, 10.0)] * n
        case ("exit", job, rank, code, signal, cause, node):
            placed = nodes.get(job, ())
            node = node or (placed[rank] if rank < len(placed) else "n0")
            return [RankExitSeen(job, rank, node, code, signal, cause, replica_id=f"r{rank}")]
        case ("start", job, rank, node):
            return [RankStartSeen(job, rank, node, 1000 + rank, replica_id=f"r{rank}")]
    event = to_event(op, {}, restart, now)
    return [] if event is None else [event]


def restored_run(policy: HealthPolicy, restart: RestartPolicy, ops: list[Op], cut: int
                 ) -> tuple[HealthCore, HealthCore, list[Decision], list[Decision]]:
    """Feed ``ops`` to a core that never stops (blind for a moment before op ``cut``) and to
    one that is restored from the other's snapshots then; returns both and their decisions
    after the cut."""
    steady, before = HealthCore(policy), HealthCore(policy)
    restored: HealthCore | None = None
    nodes: dict[str, tuple[str, ...]] = {}
    now = T0
    after_cut: tuple[list[Decision], list[Decision]] = ([], [])
    for i, op in enumerate(ops):
        if i == min(cut, len(ops) - 1):  # the leader dies here; a new one takes over
            restored = HealthCore(policy)
            for job in before.jobs.values():
                restored.restore(snapshot(job), now)
            restored.handle(WatchResumed(), now)
            restored.check_invariants()
            # The steady core is blind at the cut too: both judge the nodes that ranks run
            # on from there, though neither heard them (rule 7).
            steady.handle(WatchResumed(), now)
        if op[0] == "watch":
            nodes[op[1]] = op[2]
        if op[0] == "wait":
            now += op[1]
        events: list[Event | None] = [None] if op[0] in ("tick", "wait") else plain_events(
            op, nodes, restart, now)
        for event in events:
            for core, out in ((steady, after_cut[0]), (restored or before, after_cut[1])):
                got = core.tick(now) if event is None else core.handle(event, now)
                if restored is not None:
                    out += got
    assert restored is not None
    return steady, restored, *after_cut


def lasting(job: object, *, budget: bool) -> dict:
    """A job's snapshot as a map; without what timeouts spent of its budget unless
    ``budget`` (a restored core judges timeouts afresh, so those may differ)."""
    kept = msgspec.msgpack.decode(snapshot(job))  # type: ignore[arg-type]
    if not budget:
        for spent in ("restarts", "recent_restarts", "restart_round", "stalled_step"):
            kept.pop(spent)
        # A departing rank is dropped by its node's loss (a timeout); the round a rank
        # starts in counts the rounds that timeouts began too.
        kept["ranks"] = [r for r in kept["ranks"] if not r.pop("departing")]
        for rank in kept["ranks"]:
            rank.pop("round")
    return kept


GENEROUS = RestartPolicy(max_restarts=10**6, max_app_failures=10**6,
                         max_restarts_in_window=10**6)


@settings(SETTINGS, max_examples=200)
@given(policy=POLICY, ops=STREAM, cut=st.integers(0, 100))
def test_a_core_restored_at_any_point_decides_crashes_and_finishes_as_one_that_never_stopped(
        policy: HealthPolicy, ops: list[Op], cut: int) -> None:
    """Timeouts are judged afresh after a restore; what exits decide is not."""
    steady, restored, want, got = restored_run(policy, GENEROUS, ops, cut)
    assert crash_and_finish(got) == crash_and_finish(want)
    for job_id, job in steady.jobs.items():  # what is kept is kept exactly
        assert lasting(restored.jobs[job_id], budget=False) == lasting(job, budget=False)
    assert set(restored.jobs) == set(steady.jobs)


EXITS_ONLY = st.lists(st.one_of(  # no timeouts: a restore changes nothing that is judged
    st.tuples(st.just("watch"), JOB, st.lists(NODE, min_size=1, max_size=4).map(tuple),
              st.just(2.0)),
    st.tuples(st.just("start"), JOB, RANK, NODE),
    st.tuples(st.just("exit"), JOB, RANK, st.sampled_from([0, 1, 1, 137, None]),
              st.sampled_from([None, None, "SIGKILL"]),
              st.sampled_from(["exited", "exited", "lost", "launch_failed"]), st.just("")),
    st.tuples(st.just("wait"), st.sampled_from([0.5, 2.0, 6.0])),
), min_size=5, max_size=60)
# No step reports either: a restored core takes the first it hears as where the job is, not
# as progress (tests/unit/services/health/test_restart_budget.py), so a report between a
# takeover and a round may forgive one round less than a core that never stopped would.


@settings(SETTINGS, max_examples=200)
@given(policy=POLICY, ops=EXITS_ONLY, cut=st.integers(0, 60), restart=RESTARTS)
def test_a_restored_core_goes_on_spending_the_same_restart_budget(
        policy: HealthPolicy, ops: list[Op], cut: int, restart: RestartPolicy) -> None:
    steady, restored, want, got = restored_run(policy, restart, ops, cut)
    assert [key(d) for d in got] == [key(d) for d in want]
    for job_id, job in steady.jobs.items():
        assert lasting(restored.jobs[job_id], budget=True) == lasting(job, budget=True)
    assert set(restored.jobs) == set(steady.jobs)


@settings(SETTINGS, max_examples=150)
@given(policy=POLICY, restart=RESTARTS, ops=st.lists(st.one_of(
    st.tuples(st.just("watch"), JOB, st.lists(NODE, min_size=1, max_size=4).map(tuple),
              st.just(2.0)),
    st.tuples(st.just("start"), JOB, RANK, NODE),
    st.tuples(st.just("exit"), JOB, RANK, st.sampled_from([1, 2, 127]), st.just(None),
              st.sampled_from(["exited", "launch_failed"]), st.just("")),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.5])),
), min_size=5, max_size=60))
def test_application_failures_never_cordon_a_node(policy: HealthPolicy, restart: RestartPolicy,
                                                  ops: list[Op]) -> None:
    """However many scripts fail by themselves, on however few nodes, within however short
    a window: no node is cordoned, and each failure is an application fault or ends its
    job with an application reason."""
    run = Run(policy, restart, probe=0)
    for op in ops:
        run.op(op)
    assert not any(isinstance(d, CordonNode) for d in run.log)
    for d in run.log:
        if isinstance(d, RaiseFault):
            assert d.application
        if isinstance(d, FailJob):
            assert d.reason_code.value in ("app_failed", "launch_failed", "restarts_exhausted",
                                           "restart_rate")
