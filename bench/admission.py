"""Benchmark of the gang-admission core: decisions per second with a big cluster and a deep queue.

What it measures
----------------
The pure :class:`~phalanx.services.admission.core.AdmissionCore`, in process,
with no bus, no persistence and no clock of its own (``now`` is a counter
advanced by one second per pass). Only the core's own calls are timed
(:func:`time.perf_counter_ns` around ``handle``/``schedule``/``step``);
building specs, picking which job finishes and checking invariants are not.

The cluster: ``--nodes`` nodes of 8 slots in 10 failure domains, a quarter of
them labelled ``accel=fast``, announced with ``NodeUpdated`` events. The
policy: priority classes low/normal/high (0/100/1000), five teams whose
nominal quotas sum to the cluster's slots, two of them allowed to borrow
without limit, two up to a fixed limit, one not at all. The gangs, drawn from
a seeded :class:`random.Random`: ``replicas.min`` from {1, 2, 4, 8, 16, 32}
weighted toward small, a quarter elastic (``max = 2 x min``),
``slots_per_replica`` from {1, 2, 4}, a random team and priority class, ~5%
needing ``accel=fast`` nodes, ~5% spread over failure domains, ~2% with a
``schedule_timeout_s``. A spec :meth:`AdmissionCore.validate` rejects (too big
for its team's quota ceiling) is drawn again, as the service would refuse it.

1. **Fill.** Submit ``--queue`` gangs (``JobSubmitted``), then one
   ``schedule`` pass admits what fits (with preemption, reservation and
   backfill). Submitting and the pass are timed separately.
2. **Steady state (the main figure).** Repeatedly a random admitted gang
   finishes (``JobFinished``) and one ``step([event], now)`` runs: the event
   plus a full admission pass, which is what the service does per batch.
   ``--steps`` passes, or fewer if the queue empties, nothing runs, or the
   variant has used ``--budget-s`` of wall time (no pass starts after that;
   the stop reason is reported). Decisions per second = decisions returned /
   time spent inside ``step``. The per-pass latency p50/p99/max is that of
   single ``step`` calls.
3. **Churn.** The same on a freshly filled core, but each pass also carries a
   new ``JobSubmitted``, so the queue stays as deep as the fill left it.

   Both variants run ``--runs`` times (5), each on a fresh fill: the tables show the
   first run, the min / median / max of decisions/s over all runs is reported, and the
   target holds only if every run meets it (one good run proves nothing on a machine
   whose speed varies between runs by a third).
4. **Scaling.** Fill then churn (``--scaling-steps`` passes or
   ``--scaling-budget-s``) for nodes in {100, 1000, 3000} x queued gangs in
   {1000, 10000, 30000}. Churn keeps the depth the fill left, where the
   no-arrival variant would drain it; a cluster that admits the whole queue
   at the fill shows the cost of passes over an empty queue.

:meth:`AdmissionCore.check_invariants` runs (untimed) after every phase; in
the scaling table once per combination, after its churn (the check is
quadratic in the number of gangs: seconds at 30,000). A failed check is
reported with its message and fails the run instead of aborting it.

What counts as a decision: every ``Admit``, ``Shrink``, ``Evict`` or ``Fail``
object the core returns. That includes the ``Evict(requeue=False)`` with
which ``step`` acknowledges the finished job, the ``Shrink``/``Evict`` of
preemption victims and the ``Fail`` of timed-out gangs. Admissions
(``Admit`` only) are also reported on their own, as is the breakdown by kind.

5. **End to end over the real bus** (``bench/admission_bus.py``): a real
   nats-server, real agents and the admission service in its own process; a
   client submits one-replica gangs with 64 requests in flight and waits for
   each job's *admitted* state event. Jobs/s = jobs / (last admitted - first
   submit); also submit->admitted latency p50/p99, and a small grid of nodes
   x jobs (``--no-e2e`` skips it).

Targets: steady-state decisions/s >= 2,000 with 1,000 nodes and 10,000
queued gangs in every run (the churn variant is held to the same figure, and
so is every row of the scaling table with 10,000 gangs or more); end-to-end
submit -> admitted >= 500 jobs/s (Slurm's documented high-throughput figure).

Output: progress lines, then one JSON object with every figure as the last
line. Unless ``--no-record``, a section is appended to ``bench/RESULTS.md``.
The exit status is 1 when a target is missed.

Run: ``.venv/bin/python bench/admission.py [--nodes N] [--queue N] [--steps N] [--budget-s S]
[--scaling-steps N] [--scaling-budget-s S] [--no-scaling] [--seed N] [--quick] [--no-record]``
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from phalanx.bench.results import RESULTS_PATH, append, command_line, utc_date
from phalanx.schemas.messages import JobSpec, Placement, ReplicaRange
from phalanx.services.admission.core import AdmissionCore
from phalanx.services.admission.events import (
    Decision,
    Event,
    JobFinished,
    JobSubmitted,
    NodeUpdated,
)
from phalanx.services.admission.lifecycle import SpecRejected
from phalanx.services.admission.policy import AdmissionPolicy, TeamQuota

SLOTS_PER_NODE = 8
FAILURE_DOMAINS = 10
LABEL = ("accel", "fast")  # on every LABEL_EVERY-th node
LABEL_EVERY = 4

PRIORITY_CLASSES = {"low": 0, "normal": 100, "high": 1000}
PRIORITY_MIX = {"low": 30, "normal": 55, "high": 15}  # share of gangs per class
# team -> (share of the cluster as nominal quota, borrow limit as a share or None = unlimited,
#          share of submitted gangs)
TEAMS: dict[str, tuple[float, float | None, int]] = {
    "vision": (0.30, None, 25),
    "language": (0.25, 0.25, 30),
    "speech": (0.20, 0.10, 15),
    "robotics": (0.15, 0.0, 10),
    "research": (0.10, None, 20),
}
REPLICAS_MIN = {1: 40, 2: 25, 4: 15, 8: 10, 16: 6, 32: 4}  # weighted toward small
SLOTS_PER_REPLICA = {1: 60, 2: 30, 4: 10}
ELASTIC_SHARE = 0.25
LABELLED_SHARE = 0.05
SPREAD_SHARE = 0.05
TIMEOUT_SHARE = 0.02
TIMEOUT_RANGE_S = (300.0, 3000.0)
PASS_INTERVAL_S = 1.0  # how far ``now`` advances per pass
NOT_CHECKED = "not checked here"

TARGET_DECISIONS_PER_S = 2000.0
TARGET_E2E_JOBS_PER_S = 500
# End-to-end grid: (agents, jobs); the first row is the target figure.
E2E_GRID = ((10, 2000), (50, 2000), (10, 5000))

SCALING_NODES = (100, 1000, 3000)
SCALING_QUEUES = (1000, 10_000, 30_000)
FULL: dict[str, Any] = {"nodes": 1000, "queue": 10_000, "steps": 3000, "budget_s": 30.0,
                        "scaling_steps": 500, "scaling_budget_s": 5.0,
                        "scaling_nodes": SCALING_NODES, "scaling_queues": SCALING_QUEUES}
QUICK: dict[str, Any] = {"nodes": 100, "queue": 1000, "steps": 300, "budget_s": 10.0,
                         "scaling_steps": 100, "scaling_budget_s": 2.0,
                         "scaling_nodes": (50, 100), "scaling_queues": (200, 1000)}


clock = time.perf_counter_ns


# --- workload ---------------------------------------------------------------------------------


def make_policy(nodes: int) -> AdmissionPolicy:
    """Three priority classes and five teams whose nominal quotas sum to the cluster's slots."""
    total = nodes * SLOTS_PER_NODE
    teams = {}
    for name, (share, borrow, _) in TEAMS.items():
        teams[name] = TeamQuota(round(share * total),
                                None if borrow is None else round(borrow * total))
    return AdmissionPolicy(priority_classes=dict(PRIORITY_CLASSES), teams=teams)


def node_events(nodes: int) -> list[NodeUpdated]:
    return [NodeUpdated(f"node-{i:05d}", SLOTS_PER_NODE, f"fd-{i % FAILURE_DOMAINS}",
                        dict([LABEL]) if i % LABEL_EVERY == 0 else {})
            for i in range(nodes)]


class Workload:
    """Draws valid gang specs from a seeded generator; numbers jobs in submission order."""

    def __init__(self, rng: random.Random, core: AdmissionCore) -> None:
        self.rng = rng
        self.core = core
        self.count = 0
        self.rejected = 0
        self._teams = list(TEAMS)
        self._team_w = [w for _, _, w in TEAMS.values()]
        self._classes = list(PRIORITY_MIX)
        self._class_w = list(PRIORITY_MIX.values())
        self._mins = list(REPLICAS_MIN)
        self._min_w = list(REPLICAS_MIN.values())
        self._spr = list(SLOTS_PER_REPLICA)
        self._spr_w = list(SLOTS_PER_REPLICA.values())
        # validate() depends only on these fields and the (fixed) nodes: ask once per shape.
        self._valid: dict[tuple[str, str, int, int], bool] = {}

    def valid(self, spec: JobSpec) -> bool:
        shape = (spec.priority_class, spec.team, spec.replicas.min, spec.slots_per_replica)
        ok = self._valid.get(shape)
        if ok is None:
            try:
                self.core.validate(spec)
            except SpecRejected:
                ok = False
            else:
                ok = True
            self._valid[shape] = ok
        return ok

    def spec(self, name: str) -> JobSpec:
        rng = self.rng
        while True:
            lo = rng.choices(self._mins, self._min_w)[0]
            hi = lo * 2 if rng.random() < ELASTIC_SHARE else lo
            labels = dict([LABEL]) if rng.random() < LABELLED_SHARE else {}
            spread = rng.random() < SPREAD_SHARE
            timeout = rng.uniform(*TIMEOUT_RANGE_S) if rng.random() < TIMEOUT_SHARE else None
            spec = JobSpec(
                name=name,
                team=rng.choices(self._teams, self._team_w)[0],
                priority_class=rng.choices(self._classes, self._class_w)[0],
                replicas=ReplicaRange(min=lo, max=hi),
                command=["python", "train.py"],
                slots_per_replica=rng.choices(self._spr, self._spr_w)[0],
                placement=Placement(node_labels=labels, spread_failure_domains=spread),
                schedule_timeout_s=timeout,
            )
            if self.valid(spec):
                return spec
            self.rejected += 1

    def submission(self, now: float) -> JobSubmitted:
        self.count += 1
        job_id = f"job-{self.count:06d}"
        return JobSubmitted(job_id, self.spec(job_id), now, event_id=f"submit-{job_id}")


def build(nodes: int, seed: int) -> tuple[AdmissionCore, Workload, random.Random]:
    """A core that knows every node, and a workload drawing from ``seed``."""
    core = AdmissionCore(make_policy(nodes))
    for event in node_events(nodes):
        core.handle(event, 0.0)
    rng = random.Random(seed)
    return core, Workload(rng, core), rng


# --- phases -----------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[int], pct: float) -> int:
    """Nearest-rank percentile of an ascending sequence."""
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def kinds(decisions: Sequence[Decision], into: collections.Counter[str]) -> None:
    for d in decisions:
        into[type(d).__name__] += 1


def check(core: AdmissionCore) -> tuple[str, float]:
    """Run the core's invariant checks (untimed); "ok" or the failed assertion, and seconds.

    A failure is recorded (and fails the run) rather than raised, so the figures of a
    run that broke an invariant are still reported next to the message.
    """
    t0 = clock()
    try:
        core.check_invariants()
    except AssertionError as exc:
        verdict = f"FAILED: {exc}"
    else:
        verdict = "ok"
    return verdict, round((clock() - t0) / 1e9, 3)


def snapshot(core: AdmissionCore) -> dict[str, int]:
    free = sum(n.free for n in core.nodes.values())
    return {"pending": len(core.queue), "running": len(core.running),
            "slots_used": sum(core.usage.values()), "slots_free": free}


@dataclasses.dataclass
class Fill:
    gangs: int
    submit_s: float
    schedule_s: float
    decisions: int
    admissions: int
    by_kind: dict[str, int]
    rejected_specs: int
    after: dict[str, int]
    invariants: str
    invariants_s: float


def fill(core: AdmissionCore, workload: Workload, queue: int, *, invariants: bool = True) -> Fill:
    """Submit ``queue`` gangs at ``now`` = 0, then one timed admission pass."""
    submissions = [workload.submission(0.0) for _ in range(queue)]
    t0 = clock()
    for event in submissions:
        core.handle(event, 0.0)
    t1 = clock()
    decisions = core.schedule(0.0)
    t2 = clock()
    by_kind: collections.Counter[str] = collections.Counter()
    kinds(decisions, by_kind)
    verdict, invariants_s = check(core) if invariants else (NOT_CHECKED, 0.0)
    return Fill(gangs=queue, submit_s=round((t1 - t0) / 1e9, 4),
                schedule_s=round((t2 - t1) / 1e9, 4),
                decisions=len(decisions), admissions=by_kind["Admit"], by_kind=dict(by_kind),
                rejected_specs=workload.rejected, after=snapshot(core),
                invariants=verdict, invariants_s=invariants_s)


@dataclasses.dataclass
class Steady:
    churn: bool
    passes: int
    stopped: str
    core_s: float
    decisions: int
    admissions: int
    by_kind: dict[str, int]
    decisions_per_s: float
    admissions_per_s: float
    passes_per_s: float
    pass_p50_ms: float
    pass_p99_ms: float
    pass_max_ms: float
    pass_mean_ms: float
    after: dict[str, int]
    invariants: str
    invariants_s: float


def steady(core: AdmissionCore, workload: Workload, rng: random.Random, steps: int,
           budget_s: float, *, churn: bool, now: float = PASS_INTERVAL_S) -> Steady:
    """Up to ``steps`` passes, each carrying the end of one random running gang (and, with
    ``churn``, one new submission); no new pass starts after ``budget_s`` of wall time."""
    samples: list[int] = []
    by_kind: collections.Counter[str] = collections.Counter()
    decisions = 0
    stopped = "steps done"
    deadline = clock() + int(budget_s * 1e9)
    for _ in range(steps):
        if clock() > deadline:
            stopped = f"{budget_s:g} s budget"
            break
        if not core.running:
            stopped = "nothing running"
            break
        if not churn and not core.queue:
            stopped = "queue empty"
            break
        job_id = rng.choice(list(core.running))
        events: list[Event] = [JobFinished(job_id, event_id=f"finish-{job_id}")]
        if churn:
            events.append(workload.submission(now))
        t0 = clock()
        out = core.step(events, now)
        samples.append(clock() - t0)
        decisions += len(out)
        kinds(out, by_kind)
        now += PASS_INTERVAL_S
    after = snapshot(core)
    invariants, invariants_s = check(core)
    total_ns = sum(samples)
    ordered = sorted(samples) or [0]
    core_s = total_ns / 1e9
    return Steady(
        churn=churn, passes=len(samples), stopped=stopped, core_s=round(core_s, 4),
        decisions=decisions, admissions=by_kind["Admit"], by_kind=dict(by_kind),
        decisions_per_s=round(decisions / core_s) if core_s else 0,
        admissions_per_s=round(by_kind["Admit"] / core_s) if core_s else 0,
        passes_per_s=round(len(samples) / core_s) if core_s else 0,
        pass_p50_ms=round(percentile(ordered, 50) / 1e6, 3),
        pass_p99_ms=round(percentile(ordered, 99) / 1e6, 3),
        pass_max_ms=round(ordered[-1] / 1e6, 3),
        pass_mean_ms=round(statistics.fmean(ordered) / 1e6, 3),
        after=after, invariants=invariants, invariants_s=invariants_s,
    )


def print_fill(result: Fill) -> None:
    a = result.after
    print(f"  fill: {result.gangs:,} submissions in {result.submit_s * 1e3:,.1f} ms, one pass "
          f"{result.schedule_s * 1e3:,.1f} ms -> {result.decisions:,} decisions "
          f"({result.admissions:,} admitted); {a['running']:,} running, {a['pending']:,} "
          f"pending, {a['slots_free']:,} slots free; invariants {result.invariants} "
          f"({result.invariants_s:.2f} s)", flush=True)


def print_steady(label: str, result: Steady) -> None:
    a = result.after
    print(f"  {label}: {result.passes:,} passes ({result.stopped}) in {result.core_s:.2f} s: "
          f"{result.decisions_per_s:,.0f} decisions/s, {result.admissions_per_s:,.0f} "
          f"admissions/s; pass p50 {result.pass_p50_ms:.2f} ms, p99 {result.pass_p99_ms:.2f} ms, "
          f"max {result.pass_max_ms:.2f} ms", flush=True)
    print(f"    decisions {dict(sorted(result.by_kind.items()))}; after: {a['running']:,} "
          f"running, {a['pending']:,} pending, {a['slots_free']:,} slots free; "
          f"invariants {result.invariants} ({result.invariants_s:.2f} s)", flush=True)


def first_failure(*verdicts: str) -> str:
    return next((v for v in verdicts if v.startswith("FAILED")), "ok")


def scaling(nodes_grid: Sequence[int], queue_grid: Sequence[int], steps: int, budget_s: float,
            seed: int) -> list[dict[str, Any]]:
    """Fill then churn for every combination of cluster size and queue depth.

    The invariants are checked once per combination, after the churn (the check is
    quadratic in the queue depth: seconds at 30,000).
    """
    rows = []
    for nodes in nodes_grid:
        for queue in queue_grid:
            started = time.perf_counter()
            core, workload, rng = build(nodes, seed)
            filled = fill(core, workload, queue, invariants=False)
            churn = steady(core, workload, rng, steps, budget_s, churn=True)
            rows.append({
                "nodes": nodes, "queue": queue, "fill_pass_ms": round(filled.schedule_s * 1e3, 1),
                "admitted_at_fill": filled.admissions, "pending_after_fill":
                    filled.after["pending"], "passes": churn.passes, "stopped": churn.stopped,
                "decisions_per_s": churn.decisions_per_s,
                "admissions_per_s": churn.admissions_per_s,
                "pass_p50_ms": churn.pass_p50_ms, "pass_p99_ms": churn.pass_p99_ms,
                "invariants": first_failure(filled.invariants, churn.invariants),
                "wall_s": round(time.perf_counter() - started, 1),
            })
            r = rows[-1]
            print(f"  {nodes:>5} nodes x {queue:>6,} queued: fill pass {r['fill_pass_ms']:8,.1f} "
                  f"ms; {r['passes']:>4} passes, {r['decisions_per_s']:>6,} decisions/s, "
                  f"{r['admissions_per_s']:>6,} admissions/s, p50 {r['pass_p50_ms']:7.2f} ms, "
                  f"p99 {r['pass_p99_ms']:7.2f} ms ({r['wall_s']:.0f} s wall); invariants "
                  f"{r['invariants']}", flush=True)
    return rows


# --- report -----------------------------------------------------------------------------------


def target(measured: float) -> dict[str, Any]:
    return {"target": f">= {TARGET_DECISIONS_PER_S:g}", "measured": measured,
            "pass": measured >= TARGET_DECISIONS_PER_S}


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def build_report(args: argparse.Namespace, argv: Sequence[str], fills: dict[str, list[Fill]],
                 runs: dict[str, list[Steady]], rows: list[dict[str, Any]],
                 e2e: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The report; the tables show each variant's first run (and its fill)."""
    invariants = first_failure(*(f.invariants for variant in fills.values() for f in variant),
                               *(r.invariants for variant in runs.values() for r in variant),
                               *(r["invariants"] for r in rows))
    deep = [r["decisions_per_s"] for r in rows if r["queue"] >= 10_000]
    targets = {"steady_decisions_per_s": target(min(r.decisions_per_s
                                                    for r in runs["steady"])),
               "churn_decisions_per_s": target(min(r.decisions_per_s for r in runs["churn"])),
               "invariants_hold": {"target": "check_invariants() passes after every phase",
                                   "measured": invariants, "pass": invariants == "ok"}}
    if deep:
        targets["scaling_decisions_per_s"] = target(min(deep))
        targets["scaling_decisions_per_s"]["target"] += " (every row of >= 10,000 gangs)"
    if e2e:
        rate = e2e[0]["jobs_per_s"]
        targets["e2e_jobs_per_s"] = {"target": f">= {TARGET_E2E_JOBS_PER_S}",
                                     "measured": rate, "pass": rate >= TARGET_E2E_JOBS_PER_S}
    return {
        "benchmark": "admission-core",
        "date": utc_date(),
        "command": command_line("admission.py", argv),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "nodes": args.nodes,
        "slots": args.nodes * SLOTS_PER_NODE,
        "queue": args.queue,
        "steps": args.steps,
        "seed": args.seed,
        "fill": dataclasses.asdict(fills["steady"][0]),
        "steady": dataclasses.asdict(runs["steady"][0]),
        "churn_fill": dataclasses.asdict(fills["churn"][0]),
        "churn": dataclasses.asdict(runs["churn"][0]),
        "runs": len(runs["steady"]),
        "decisions_per_s_over_runs": {name: spread([r.decisions_per_s for r in variant])
                                      for name, variant in runs.items()},
        "budget_s": args.budget_s,
        "scaling": {"steps": args.scaling_steps, "budget_s": args.scaling_budget_s,
                    "variant": "churn", "rows": rows},
        "e2e": e2e,
        "wall_s": round(wall_s, 1),
        "targets": targets,
        "pass": all(t["pass"] for t in targets.values()),
    }


def markdown_section(report: dict[str, Any]) -> str:
    filled, main, churn, targets = (report["fill"], report["steady"], report["churn"],
                                    report["targets"])

    def verdict(name: str) -> str:
        return "pass" if targets[name]["pass"] else "**FAIL**"

    def row(label: str, key: str, fmt: str, tgt: str = "", result: str = "") -> str:
        return f"| {label} | {main[key]:{fmt}} | {churn[key]:{fmt}} | {tgt} | {result} |"

    lines = [
        f"\n## admission.py (core) — {report['date']}\n",
        f"Command: `{report['command']}`\n",
        f"Python {report['python']}, {report['cpus']} CPUs; {report['nodes']:,} nodes x "
        f"{SLOTS_PER_NODE} slots ({report['slots']:,}), {report['queue']:,} gangs queued, "
        f"seed {report['seed']}; up to {report['steps']:,} passes or {report['budget_s']:g} s "
        "per variant. A decision is any Admit/Shrink/Evict/Fail the core returns (including "
        "the Evict acknowledging each finished job); times are inside the core only.\n",
        f"Fill: {filled['gangs']:,} submissions {filled['submit_s'] * 1e3:,.1f} ms, one pass "
        f"{filled['schedule_s'] * 1e3:,.1f} ms -> {filled['decisions']:,} decisions "
        f"({filled['admissions']:,} admitted); then {filled['after']['running']:,} running, "
        f"{filled['after']['pending']:,} pending, {filled['after']['slots_free']:,} slots free."
        "\n",
        "| figure | steady (finish only) | churn (finish + submit) | target | result |",
        "|---|---:|---:|---|---|",
        f"| passes | {main['passes']:,} ({main['stopped']}) | {churn['passes']:,} "
        f"({churn['stopped']}) | | |",
        row("decisions/s (first run)", "decisions_per_s", ","),
        "| decisions/s over {} runs: min / median / max | {} | {} | >= 2,000 (each run) | "
        "steady {}, churn {} |".format(
            report["runs"], *(" / ".join(f"{v:,.0f}" for v in
                                         report["decisions_per_s_over_runs"][name].values())
                              for name in ("steady", "churn")),
            verdict("steady_decisions_per_s"), verdict("churn_decisions_per_s")),
        row("admissions/s", "admissions_per_s", ","),
        row("passes/s", "passes_per_s", ","),
        row("pass p50 (ms)", "pass_p50_ms", ",.2f"),
        row("pass p99 (ms)", "pass_p99_ms", ",.2f"),
        row("pass max (ms)", "pass_max_ms", ",.2f"),
        f"| decisions by kind | {fmt_kinds(main['by_kind'])} | {fmt_kinds(churn['by_kind'])} "
        "| | |",
        f"| pending at the end | {main['after']['pending']:,} | {churn['after']['pending']:,} "
        "| | |",
        f"| `check_invariants()` at the end | {main['invariants']} | {churn['invariants']} "
        f"| ok after every phase | {verdict('invariants_hold')} |",
        "",
    ]
    scale = report["scaling"]
    if scale["rows"]:
        lines += [
            f"Scaling: fill, then up to {scale['steps']} churn passes or {scale['budget_s']:g} s "
            "(queue depth kept); decisions/s by nodes x queued gangs:\n",
            "| nodes | queued | fill pass (ms) | pending after fill | passes | decisions/s | "
            "admissions/s | pass p50 (ms) | pass p99 (ms) | invariants |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            *(f"| {r['nodes']:,} | {r['queue']:,} | {r['fill_pass_ms']:,.1f} | "
              f"{r['pending_after_fill']:,} | {r['passes']:,} | {r['decisions_per_s']:,} | "
              f"{r['admissions_per_s']:,} | {r['pass_p50_ms']:,.2f} | {r['pass_p99_ms']:,.2f} | "
              f"{r['invariants']} |"
              for r in scale["rows"]),
            "",
            *([f"Every row of 10,000 gangs or more at >= 2,000 decisions/s: "
               f"{verdict('scaling_decisions_per_s')}.", ""]
              if "scaling_decisions_per_s" in targets else []),
        ]
    if report["e2e"]:
        e2e_target = targets["e2e_jobs_per_s"]
        lines += [
            "End to end over the real bus (nats-server, agents, admission service process; "
            "one-replica gangs, 64 submits in flight; first row is the target figure):\n",
            "| agents | jobs | submit replies/s | submit->admitted jobs/s | latency p50 (ms) | "
            "latency p99 (ms) |",
            "|---:|---:|---:|---:|---:|---:|",
            *(f"| {r['nodes']} | {r['jobs']:,} | {r['submit_replies_per_s']:,} | "
              f"{r['jobs_per_s']:,} | {r['latency_p50_ms']:,} | {r['latency_p99_ms']:,} |"
              for r in report["e2e"]),
            "",
            f"Target >= {TARGET_E2E_JOBS_PER_S} jobs/s: measured {e2e_target['measured']:,} -> "
            f"{'pass' if e2e_target['pass'] else '**FAIL**'}",
            "",
        ]
    return "\n".join(lines)


def fmt_kinds(by_kind: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(by_kind.items())) or "none"


def record(report: dict[str, Any]) -> None:
    """Append the run's section to bench/RESULTS.md."""
    append(markdown_section(report))


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, help=f"nodes in the cluster (default {FULL['nodes']})")
    parser.add_argument("--queue", type=int,
                        help=f"gangs submitted before the fill (default {FULL['queue']})")
    parser.add_argument("--steps", type=int,
                        help=f"passes per steady-state variant (default {FULL['steps']})")
    parser.add_argument("--budget-s", type=float,
                        help="wall seconds after which a variant starts no new pass "
                             f"(default {FULL['budget_s']:g})")
    parser.add_argument("--scaling-steps", type=int,
                        help=f"churn passes per scaling combination (default "
                             f"{FULL['scaling_steps']})")
    parser.add_argument("--scaling-budget-s", type=float,
                        help=f"wall seconds per scaling combination's passes (default "
                             f"{FULL['scaling_budget_s']:g})")
    parser.add_argument("--no-scaling", action="store_true", help="skip the scaling table")
    parser.add_argument("--no-e2e", action="store_true",
                        help="skip the end-to-end measurement over the real bus")
    parser.add_argument("--runs", type=int, default=5,
                        help="runs of each steady-state variant, each on a fresh fill "
                             "(default 5; the target holds only if every run meets it)")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes for a smoke run ({QUICK['nodes']} nodes, "
                             f"{QUICK['queue']} gangs, {QUICK['steps']} steps, small grid)")
    parser.add_argument("--no-record", action="store_true",
                        help=f"do not append the results to {RESULTS_PATH.name}")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name in ("nodes", "queue", "steps", "budget_s", "scaling_steps", "scaling_budget_s",
                 "runs"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    args.scaling_nodes = defaults["scaling_nodes"]
    args.scaling_queues = defaults["scaling_queues"]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = time.perf_counter()
    print(f"admission core benchmark: {args.nodes:,} nodes x {SLOTS_PER_NODE} slots, "
          f"{args.queue:,} gangs, seed {args.seed}", flush=True)

    print(f"{args.runs} runs of steady state and churn, each a fresh fill, then up to "
          f"{args.steps:,} passes (or {args.budget_s:g} s), each finishing one gang (churn: "
          "and submitting one)", flush=True)
    runs: dict[str, list[Steady]] = {"steady": [], "churn": []}
    fills: dict[str, list[Fill]] = {"steady": [], "churn": []}
    for run in range(args.runs):
        for name in ("steady", "churn"):
            core, workload, rng = build(args.nodes, args.seed)
            fills[name].append(fill(core, workload, args.queue))
            print_fill(fills[name][-1])
            runs[name].append(steady(core, workload, rng, args.steps, args.budget_s,
                                     churn=name == "churn"))
            print_steady(f"{name} (run {run + 1} of {args.runs})", runs[name][-1])

    rows: list[dict[str, Any]] = []
    if not args.no_scaling:
        print(f"scaling: fill, then up to {args.scaling_steps} churn passes (or "
              f"{args.scaling_budget_s:g} s) per combination", flush=True)
        rows = scaling(args.scaling_nodes, args.scaling_queues, args.scaling_steps,
                       args.scaling_budget_s, args.seed)

    e2e: list[dict[str, Any]] = []
    if not args.no_e2e:
        from phalanx.bench.admission_bus import measure

        for nodes, jobs in E2E_GRID[:1] if args.quick else E2E_GRID:
            print(f"end to end: {nodes} agents, {jobs:,} jobs submitted over the bus",
                  flush=True)
            e2e.append(measure(nodes, jobs))
            print(f"  {e2e[-1]['jobs_per_s']:,} jobs/s submit->admitted; latency p50 "
                  f"{e2e[-1]['latency_p50_ms']} ms, p99 {e2e[-1]['latency_p99_ms']} ms",
                  flush=True)

    report = build_report(args, argv, fills, runs, rows, e2e, time.perf_counter() - started)
    for name, tgt in report["targets"].items():
        measured = tgt["measured"]
        shown = measured if isinstance(measured, str) else f"{measured:,.0f}"
        print(f"target {name} {tgt['target']}: measured {shown} -> "
              f"{'pass' if tgt['pass'] else 'FAIL'}", flush=True)
    print(f"wall time {report['wall_s']:.0f} s", flush=True)
    if not args.no_record:
        record(report)
        print(f"appended to {RESULTS_PATH}", flush=True)
    print(json.dumps(report), flush=True)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
