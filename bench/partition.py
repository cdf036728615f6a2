"""Network partitions timed: how long each kind of cut takes to be dealt with (issue 53).

Runs on the partition tests' harness (:mod:`phalanx.bench.partition_harness`, root
needed): a local cluster whose two nodes (two slots each) and a host with no agent each
live in a network namespace of their own, nats-server and the services on a bridge of
this machine, cuts made with nftables. The elasticity leader runs on that host, its
standby on this machine. Each fault is one job, ``examples/train_mlp.py`` as a 4-replica
elastic job (2 to 4) in deterministic mode, paced until the fault is dealt with, cut at
step 40, then released to finish; the kinds, in a seeded order (every kind as often as
the others, within one):

* ``bus_cut``: a node cut from the bus both ways (its ranks still reach their peers);
  ``bus_cut_one_way``: what the bus sends it is dropped, what it sends arrives. Timed:
  the cut to its ranks' exit (the fence: every one gone, by its pidfd) and to the first
  step the survivors commit in a generation without them (from the ranks' records).
* ``leader_cut``: the elasticity leader's host cut from the bus both ways, and a rank
  killed 0.3 s later so that a decision is due during the cut. Timed: the cut to the
  old leader stopping (its log's ``deposed``), to the standby leading (its ``leading``),
  and to the generation without the killed rank (the successor's decision).
* ``node_cut``: the two nodes cut from each other, the bus reaching both. Timed: the cut
  to the generation without one side (published) and to the survivors' first commit.

An agent kill is mixed into every cut (``--no-agent-kills``: none): the agent of the
node that is not cut off (``local-0``) is SIGKILLed :data:`AGENT_KILL_AT_S` after the cut
and started again :data:`AGENT_DOWN_S` later, as a supervisor would; its ranks run on
and the new agent adopts them. Timed: the cut to that agent's first heartbeat again
(``agent_back_s``). (Its first run, 2026-12-07, never ended a job: the adopted ranks
finished it and the new agent, not their parent, reported each exit ``lost``, so
elasticity replaced them and the replacements waited in rendezvous for members long
gone. Each rank now writes its exit status for an agent that did not see it end.)

Each cut lasts ``--cut-s`` (6 s) at least, then heals; a node cut from the bus comes
back as new capacity before the next job. Every job is checked: it ended ``finished``,
admitted once; final parameters bitwise equal to the script alone; from every rank's
record, the cut-off ranks' included: no step committed twice (a step's commit by a
generation the job had left counts, but for the step in flight when it moved on, which
its members trained again and the job keeps as theirs), no commit by a cut-off rank in a
generation without it, every sample once an epoch (``record.verify``); and no deposed
leader acting after it stopped. Counts are reported; each must be 0.

Targets (``../shared/DESIGN.md``, "network partitions"; the bounds of
docs/architecture.md, "Fencing"): the fence within ``fence_after_s + 2 x heartbeat``
(3.4 s here), a cut leader stopped within ``lease_s x 2/3`` of the cut (2 s) and before
its standby leads, the side without rank 0 dropped within ``unreachable_after_s + 0.5 s +
PROBE_S`` (4.5 s) plus the bus's way; p99 against each. Prints progress, then one JSON
object as the last line, and appends a section to ``bench/RESULTS.md`` unless
``--no-record``::

    sudo .venv/bin/python bench/partition.py                 # 8 faults, every kind twice
    sudo .venv/bin/python bench/partition.py --faults 50 --seed 1
    sudo .venv/bin/python bench/partition.py --kinds node_cut --faults 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.bench.chaos import ARGS, SAMPLES, SCRIPT, fault_free, prepare
from phalanx.bench.partition_harness import (
    BUS,
    NamespacedCluster,
    answering,
    exited,
    lead_from,
    log_lines,
    partitioned_cluster,
    ranks_on,
    unavailable,
)
from phalanx.bench.results import append, command_line, utc_date
from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.runtime.reach import PROBE_S, UNREACHABLE_AFTER_S
from phalanx.schemas import environment, settings, subjects
from phalanx.schemas.messages import (
    Generation,
    GenerationReason,
    JobRecord,
    JobSpec,
    JobState,
    Lease,
    NodeHeartbeat,
    Placement,
    RankProgress,
    ReplicaRange,
)
from phalanx.services.agent import fence
from phalanx.services.client import AdmissionClient
from phalanx.services.lease import ACTS_FOR

ORDER = ElasticOrder(SAMPLES, 64, seed=0)
STEPS = 400
PACE_S = 0.05  # the job's pace until its fault is dealt with (runtime/chaos.py)
CUT_AT_STEP = 40
KINDS = ("bus_cut", "bus_cut_one_way", "leader_cut", "node_cut")
NODES = ("local-0", "local-1")
CUT = "local-1"  # the node a bus cut cuts, and whose rank a leader cut kills
HOST = "ctl"  # the elasticity leader's host
LEADER, STANDBY = "elasticity-ctl", "elasticity"
LEASE_S = 3.0  # elasticity's lease (its default)
HEARTBEAT_S = 0.2
LOST_AFTER_S = 3.0
#: Steps the survivors train while the cut holds, before it heals.
TRAINED_CUT = 20
#: The node whose agent is killed during every cut (never the one a cut cuts off: a
#: node's own agent fences its ranks, and one started while cut off could not connect).
KILLED_AGENT = "local-0"
#: When, from the cut, that agent is SIGKILLed, and how long it stays down.
AGENT_KILL_AT_S, AGENT_DOWN_S = 0.5, 0.5


def stats(values: list[float]) -> dict[str, float | int | None]:
    """p50/p99/max of ``values`` in seconds (rounded to ms), and how many."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50_s": None, "p99_s": None, "max_s": None}

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"n": len(ordered), "p50_s": pick(0.50), "p99_s": pick(0.99),
            "max_s": round(ordered[-1], 3)}


class Observer:
    """What the bench sees over its own bus connection: each job's generations (with
    their arrival), its highest step and generation reported, its states; each node's
    last heartbeat. ``changed`` is set at each."""

    def __init__(self) -> None:
        self.generations: dict[str, list[tuple[float, Generation]]] = {}
        self.progress: dict[str, tuple[int, int]] = {}  # job -> (generation, step)
        self.states: dict[str, list[JobState]] = {}
        self.heartbeats: dict[str, float] = {}
        self.changed = asyncio.Event()

    async def attach(self, bus: Bus) -> None:
        async def on_generation(g: Generation, _: Delivery) -> None:
            seen = self.generations.setdefault(g.job_id, [])
            if not seen or g.generation > seen[-1][1].generation:  # each once (re-published)
                seen.append((time.time(), g))
            self.changed.set()

        async def on_progress(p: RankProgress, _: Delivery) -> None:
            self.progress[p.job_id] = max(self.progress.get(p.job_id, (0, 0)),
                                          (p.generation, p.step))
            self.changed.set()

        async def on_state(r: JobRecord, _: Delivery) -> None:
            states = self.states.setdefault(r.job_id, [])
            if not states or states[-1] is not r.state:
                states.append(r.state)
            self.changed.set()

        async def on_heartbeat(h: NodeHeartbeat, _: Delivery) -> None:
            self.heartbeats[h.node_id] = time.time()
            self.changed.set()

        await bus.subscribe(subjects.job_events("generation"), Generation, on_generation)
        await bus.subscribe(subjects.health_ranks(), RankProgress, on_progress)
        await bus.subscribe(subjects.job_states(), JobRecord, on_state)
        await bus.subscribe(subjects.node_heartbeats(), NodeHeartbeat, on_heartbeat)

    async def until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Wait until ``condition()`` holds, checked at each event (and each 0.2 s).

        Raises:
            TimeoutError: it did not within ``timeout_s`` (``what`` names it).
        """
        deadline = time.monotonic() + timeout_s
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: not within {timeout_s:g} s")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 0.2))

    def latest(self, job_id: str) -> Generation | None:
        seen = self.generations.get(job_id, [])
        return seen[-1][1] if seen else None

    def without(self, job_id: str, replicas: set[str]) -> tuple[float, Generation] | None:
        """The first generation of ``job_id`` without any of ``replicas`` (its arrival)."""
        return next(((t, g) for t, g in self.generations.get(job_id, [])
                     if not replicas & {m.replica_id for m in g.members}), None)


def judge(records: dict[str, list[dict[str, Any]]], generations: list[Generation],
          cut_off: set[str]) -> dict[str, int]:
    """The run's faults of the fencing rule and the data order, as counts (each 0 when
    none): ``committed_twice``, steps with commits of two generations other than the step
    in flight at a change (its older commits only by ``cut_off`` ranks, the newest kept),
    or beyond one such step a change; ``stale_commits``, commits by a ``cut_off`` rank in
    a generation without it; ``steps_wrong``, steps repeated, skipped, redone or never
    committed; ``samples_wrong``, steps or epochs whose samples are not each exactly once
    (:func:`record.verify`). ``in_flight``: the steps in flight committed also by their
    old generation (allowed; reported)."""
    problems = record.verify(records, ORDER, STEPS)
    samples = [p for p in problems if "sample" in p]
    by_step: dict[int, set[int]] = {}
    for lines in records.values():
        for line in lines:
            if line["kind"] == "commit":
                by_step.setdefault(line["step"], set()).add(line["generation"])
    kept = {s.step: s.generation for s in record.timeline(records)}
    twice = {step: gens for step, gens in by_step.items() if len(gens) > 1}
    allowed = 0
    for step, gens in twice.items():
        stale_by = {replica for replica, lines in records.items() for line in lines
                    if line["kind"] == "commit" and line["step"] == step
                    and line["generation"] < max(gens)}
        allowed += kept.get(step) == max(gens) and stale_by <= cut_off
    in_flight = min(allowed, len(generations) - 1)  # one step in flight a change at most
    stale = 0
    for replica in cut_off & set(records):
        left_at = min((g.generation for g in generations
                       if replica not in {m.replica_id for m in g.members}), default=None)
        if left_at is not None:
            stale += sum(1 for line in records[replica]
                         if line["kind"] == "commit" and line["generation"] >= left_at)
    return {"committed_twice": len(twice) - in_flight, "stale_commits": stale,
            "steps_wrong": len(problems) - len(samples), "samples_wrong": len(samples),
            "in_flight": in_flight}


class Bench:
    """The cluster, the bus and the faults of one run."""

    def __init__(self, work: Path, cluster: NamespacedCluster, bus: Bus, cut_s: float,
                 reference: dict[str, Any], *, agent_kills: bool = False) -> None:
        self.work = work
        self.reference = reference
        self.cluster = cluster
        self.bus = bus
        self.cut_s = cut_s
        self.agent_kills = agent_kills
        self.observer = Observer()
        self.client = AdmissionClient(bus)

    async def leases(self) -> TypedKV[Lease]:
        return await TypedKV.open(self.bus.js, subjects.LEASES_BUCKET, Lease)

    def spec(self, name: str, job_dir: Path) -> JobSpec:
        return JobSpec(name=name, team="bench", placement=Placement(),
                       priority_class="normal", replicas=ReplicaRange(min=2, max=4),
                       command=[sys.executable, str(SCRIPT), "--data-dir",
                                str(self.work / "data"), *ARGS, "--steps", str(STEPS),
                                "--save", str(job_dir / "final.pt")],
                       env={environment.RECORD_DIR: str(job_dir / "rec"),
                            environment.DETERMINISTIC: "1",
                            environment.CHAOS_PACE: f"{PACE_S}:{job_dir / 'release'}"},
                       hang_timeout_s=2.0, grace_period_s=3.0)

    async def nodes_back(self) -> None:
        """Both nodes heard again since now (after a heal, their agents reconnected)."""
        since = time.time()
        await self.observer.until(lambda: all(self.observer.heartbeats.get(n, 0) > since
                                              for n in NODES), 120, "both nodes beating")

    async def agent_killed(self, cut_at: float) -> float:
        """:data:`KILLED_AGENT`'s agent SIGKILLed :data:`AGENT_KILL_AT_S` after the cut
        and started again :data:`AGENT_DOWN_S` later; when it beats again, from the cut."""
        await asyncio.sleep(max(0.0, cut_at + AGENT_KILL_AT_S - time.time()))
        agent = self.cluster.agents[KILLED_AGENT]
        agent.send_signal(signal.SIGKILL)
        await agent.wait()
        await asyncio.sleep(AGENT_DOWN_S)
        restarted = time.time()
        await self.cluster.restart(KILLED_AGENT)
        await self.observer.until(
            lambda: self.observer.heartbeats.get(KILLED_AGENT, 0) > restarted, 60,
            f"{KILLED_AGENT}'s agent beating again")
        return self.observer.heartbeats[KILLED_AGENT] - cut_at

    async def one(self, n: int, kind: str) -> dict[str, Any]:
        """Fault ``n``, of ``kind``: a job, its cut, its figures and its checks."""
        obs = self.observer
        name = f"p{n}-{kind.replace('_', '-')}"
        job_id = f"{name}-1"
        job_dir = self.work / "jobs" / name
        job_dir.mkdir(parents=True)
        if kind == "leader_cut":
            await lead_from(self.cluster, self.bus, await self.leases(), HOST, "elasticity",
                            LEADER, STANDBY)
        await self.nodes_back()
        await self.client.submit(self.spec(name, job_dir), job_id)

        def trains_at_four() -> bool:
            g = obs.latest(job_id)
            return (g is not None and g.world_size == 4
                    and obs.progress.get(job_id, (-1, -1)) >= (g.generation, CUT_AT_STEP))

        await obs.until(trains_at_four, 180, f"{job_id} training on 4 past {CUT_AT_STEP}")
        ranks = {node: ranks_on(self.cluster, node, job_id) for node in NODES}
        figures: dict[str, float] = {}
        cut_off: set[str] = set()
        net = self.cluster.net
        cut_at = time.time()
        killing = (asyncio.create_task(self.agent_killed(cut_at)) if self.agent_kills
                   else None)
        try:
            match kind:
                case "bus_cut" | "bus_cut_one_way":
                    if kind == "bus_cut":
                        net.cut(CUT, BUS)
                    else:
                        net.cut(BUS, CUT, both=False)
                    cut_off = {r["replica_id"] for r in ranks[CUT]}
                    ends = await asyncio.gather(*(exited(r["pid"], 30) for r in ranks[CUT]))
                    figures["fence_s"] = max(ends) - cut_at
                    await self.survivors_train(job_id, cut_off)
                case "node_cut":
                    net.cut(*NODES)
                    await obs.until(lambda: (g := obs.latest(job_id)) is not None
                                    and g.world_size < 4, 60, f"{job_id} dropping a side")
                    arrived, dropped = obs.generations[job_id][-1]
                    figures["dropped_s"] = arrived - cut_at
                    kept = {m.replica_id for m in dropped.members}
                    gone = [r for on in ranks.values() for r in on if r["replica_id"] not in kept]
                    cut_off = {r["replica_id"] for r in gone}
                    ends = await asyncio.gather(*(exited(r["pid"], 30) for r in gone))
                    figures["dropped_exit_s"] = max(ends) - cut_at
                    await self.survivors_train(job_id, cut_off)
                case "leader_cut":
                    net.cut(HOST, BUS)
                    await asyncio.sleep(0.3)
                    victim = ranks[CUT][0]
                    os.kill(victim["pid"], signal.SIGKILL)  # a decision due during the cut
                    cut_off = {victim["replica_id"]}
                    await obs.until(lambda: obs.without(job_id, cut_off) is not None,
                                    60, f"{job_id}: a generation without the killed rank")
                    found = obs.without(job_id, cut_off)
                    assert found is not None
                    figures["decision_s"] = found[0] - cut_at
            if killing is not None:
                figures["agent_back_s"] = await killing
            await asyncio.sleep(max(0.0, cut_at + self.cut_s - time.time()))
        finally:
            if killing is not None and not killing.done():
                killing.cancel()
                await asyncio.wait([killing])
            net.heal()
        healed_at = time.time()
        deposed_acted = 0
        if kind == "leader_cut":
            for _ in range(60):  # its connection resumes at TCP's next retransmission
                if LEADER in await answering(self.bus, "elasticity", 0.5):
                    break
            figures["old_leader_back_after_heal_s"] = time.time() - healed_at
            cut_log, standby_log = log_lines(self.cluster, LEADER), \
                log_lines(self.cluster, STANDBY)
            deposed = min((line["ts"] for line in cut_log if line["ts"] >= cut_at
                           and line["msg"].startswith("deposed")), default=None)
            took = min((line["ts"] for line in standby_log if line["ts"] >= cut_at
                        and line["msg"] == "leading"), default=None)
            if deposed is not None:
                figures["old_leader_stopped_s"] = deposed - cut_at
                deposed_acted = sum(1 for line in cut_log if line["ts"] > deposed
                                    and line["msg"] in ("generation", "leading"))
            if took is not None:
                figures["standby_leads_s"] = took - cut_at
            if deposed is None or took is None or took <= deposed:
                deposed_acted += 1  # not stopped, or not before its successor led
        (job_dir / "release").touch()
        await obs.until(lambda: any(s.terminal for s in obs.states.get(job_id, [])), 300,
                        f"{job_id} ending")
        return self.checked(job_id, job_dir, kind, cut_at, cut_off, figures, deposed_acted)

    async def survivors_train(self, job_id: str, cut_off: set[str]) -> None:
        """Wait until the job trains ``TRAINED_CUT`` steps in a generation without
        ``cut_off``."""
        obs = self.observer

        def trained() -> bool:
            found = obs.without(job_id, cut_off)
            return found is not None and obs.progress.get(job_id, (-1, -1)) >= (
                found[1].generation, found[1].resume_step + TRAINED_CUT)

        await obs.until(trained, 60, f"{job_id} training without {sorted(cut_off)}")

    def checked(self, job_id: str, job_dir: Path, kind: str, cut_at: float,
                cut_off: set[str], figures: dict[str, float],
                deposed_acted: int) -> dict[str, Any]:
        import torch

        obs = self.observer
        generations = [g for _, g in obs.generations.get(job_id, [])]
        records = record.read(job_dir / "rec")
        found = obs.without(job_id, cut_off)
        if found is not None:
            after = [line["t"] for lines in records.values() for line in lines
                     if line["kind"] == "commit" and line["generation"] >= found[1].generation]
            if after:
                figures["survivors_commit_s"] = min(after) - cut_at
        states = obs.states.get(job_id, [])
        final = job_dir / "final.pt"
        params = torch.load(final) if final.exists() else {}
        equal = bool(params) and all(key in params and torch.equal(value, params[key])
                                     for key, value in self.reference.items())
        checks = judge(records, generations, cut_off)
        checks.update({
            "not_finished": int(not states or states[-1] is not JobState.FINISHED),
            "params_unequal": int(not equal),
            "admitted_twice": int(JobState.PENDING in states[1:] or any(
                g.reason is GenerationReason.START for g in generations[1:])),
            "deposed_acted": deposed_acted})
        return {"kind": kind, "job": job_id, "figures": {k: round(v, 3)
                                                         for k, v in figures.items()},
                "checks": checks, "generations": [g.world_size for g in generations]}


def schedule(kinds: list[str], faults: int, seed: int) -> list[str]:
    """``faults`` kinds: rounds of every kind once, each round in a seeded order."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < faults:
        order += rng.sample(kinds, len(kinds))
    return order[:faults]


#: Targets: (kind, figure) -> (bound in s, what it is).
TARGETS: dict[tuple[str, str], tuple[float, str]] = {
    **{(kind, "fence_s"): (fence.bound_s(LOST_AFTER_S, HEARTBEAT_S),
                           "fence_after_s + 2 x heartbeat")
       for kind in ("bus_cut", "bus_cut_one_way")},
    ("leader_cut", "old_leader_stopped_s"): (LEASE_S * ACTS_FOR, "lease_s x 2/3"),
    ("node_cut", "dropped_s"): (UNREACHABLE_AFTER_S + 0.5 + PROBE_S,
                                "unreachable_after_s + 0.5 s + PROBE_S"),
}


async def run(work: Path, kinds: list[str], faults: int, seed: int,
              cut_s: float, agent_kills: bool = False) -> dict[str, Any]:
    started = time.monotonic()
    load_before = os.getloadavg()
    prepare(work)
    reference = fault_free(work, STEPS)
    # A node cut off, or whose rank is killed, is not a bad node: never cordoned here.
    os.environ[settings.HEALTH("cordon_faults")] = "1000000"
    os.environ[settings.ELASTICITY("max_replacements")] = "1000000"
    trials: list[dict[str, Any]] = []
    errors: list[str] = []
    async with partitioned_cluster(work / "cluster", nodes=2, slots_per_agent=2,
                                   heartbeat_interval_s=HEARTBEAT_S,
                                   lost_after_s=LOST_AFTER_S, hosts=(HOST,),
                                   elasticity_instances=0) as cluster:
        assert cluster.nats_url is not None
        config = BusConfig.load(env={}, servers=[cluster.nats_url])
        async with await Bus.connect(config, name="bench-partition") as bus:
            bench = Bench(work, cluster, bus, cut_s, reference, agent_kills=agent_kills)
            await bench.observer.attach(bus)
            await lead_from(cluster, bus, await bench.leases(), HOST, "elasticity",
                            LEADER, STANDBY)
            for n, kind in enumerate(schedule(kinds, faults, seed)):
                t0 = time.monotonic()
                try:
                    trial = await bench.one(n, kind)
                except Exception as exc:  # a run that did not end: counted, and the next
                    errors.append(f"{n} {kind}: {type(exc).__name__}: {exc}")
                    print(f"[{n}] {kind} FAILED: {exc}", flush=True)
                    cluster.net.heal()
                    continue
                trials.append(trial)
                print(f"[{n}] {kind} {trial['figures']} checks "
                      f"{ {k: v for k, v in trial['checks'].items() if v} } "
                      f"worlds {trial['generations']} ({time.monotonic() - t0:.0f} s)",
                      flush=True)
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        mine = [t for t in trials if t["kind"] == kind]
        names = sorted({f for t in mine for f in t["figures"]})
        by_kind[kind] = {"n": len(mine), **{
            f: stats([t["figures"][f] for t in mine if f in t["figures"]]) for f in names}}
    counts = {name: sum(t["checks"][name] for t in trials)
              for name in (trials[0]["checks"] if trials else {})}
    targets: dict[str, dict[str, Any]] = {}
    for (kind, figure), (bound, what) in TARGETS.items():
        measured = by_kind.get(kind, {}).get(figure)
        if isinstance(measured, dict) and measured["p99_s"] is not None:
            targets[f"{kind}.{figure}"] = {"target_s": round(bound, 3), "bound": what,
                                           "p99_s": measured["p99_s"],
                                           "pass": measured["p99_s"] <= bound}
    must_be_zero = {k: v for k, v in counts.items() if k != "in_flight"}
    return {"benchmark": "partition", "date": utc_date(),
            "command": command_line("partition.py", sys.argv[1:]),
            "seed": seed, "faults": faults, "completed": len(trials), "errors": errors,
            "cut_s": cut_s, "agent_kills": agent_kills, "lost_after_s": LOST_AFTER_S,
            "heartbeat_interval_s": HEARTBEAT_S,
            "lease_s": LEASE_S, "duration_s": round(time.monotonic() - started, 1),
            # The machine's load (1, 5, 15 min) at the start and the end: timers run late
            # on a loaded one, and the bounds' figures with them.
            "load": [list(load_before), list(os.getloadavg())],
            "by_kind": by_kind, "counts": counts, "targets": targets,
            "pass": not errors and not any(must_be_zero.values())
            and all(t["pass"] for t in targets.values()),
            "trials": trials}


def write_record(report: dict[str, Any]) -> None:
    rows = []
    for kind, figures in report["by_kind"].items():
        for figure, s in figures.items():
            if isinstance(s, dict):
                bound = TARGETS.get((kind, figure))
                target = f"p99 <= {bound[0]:.2f} ({bound[1]})" if bound else "reported"
                rows.append(f"| {kind} | {figure} | {s['n']} | {s['p50_s']} | {s['p99_s']} "
                            f"| {s['max_s']} | {target} |")
    counts = ", ".join(f"{k} {v}" for k, v in report["counts"].items())
    verdicts = ", ".join(f"{k} {'pass' if v['pass'] else 'FAIL'}"
                         for k, v in report["targets"].items())
    errors = "".join(f"\n- {e}" for e in report["errors"]) or " none"
    killed = f", {KILLED_AGENT}'s agent killed in each" if report["agent_kills"] else ""
    append(f"\n## partition.py — {report['date']}\n\nCommand: `{report['command']}`\n\n"
           f"{report['completed']} of {report['faults']} faults completed in "
           f"{report['duration_s']} s (seed {report['seed']}); each a 4-replica job on two "
           f"namespaced nodes, cut at step {CUT_AT_STEP} for {report['cut_s']:g} s{killed}; node "
           f"timeout {report['lost_after_s']} s, heartbeat {report['heartbeat_interval_s']} "
           f"s, elasticity lease {report['lease_s']} s; load average (1, 5, 15 min) "
           f"{'/'.join(f'{x:.1f}' for x in report['load'][0])} at the start, "
           f"{'/'.join(f'{x:.1f}' for x in report['load'][1])} at the end. Seconds from "
           "the cut.\n\n"
           "| kind | from the cut to | n | p50 | p99 | max | target |\n"
           "|---|---|---:|---:|---:|---:|---|\n" + "\n".join(rows) +
           f"\n\nCounts over every run (each must be 0 but in_flight, the step in flight "
           f"at a change that the cut-off ranks also committed, allowed): {counts}.\n"
           f"Targets: {verdicts}. Runs that did not end:{errors}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=8, help="cuts in all, one a job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"a comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--cut-s", type=float, default=6.0, help="how long a cut lasts")
    parser.add_argument("--agent-kills", action=argparse.BooleanOptionalAction,
                        default=True,
                        help=f"kill {KILLED_AGENT}'s agent during every cut (default)")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}")
    if (why := unavailable()) is not None:
        print(f"partition.py: the harness cannot run here: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="phalanx-partition-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        report = asyncio.run(run(work, kinds, args.faults, args.seed, args.cut_s,
                                 args.agent_kills))
    if not args.no_record:
        write_record(report)
    print(json.dumps({k: v for k, v in report.items() if k != "trials"}))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
