"""The control plane at cluster scale: steady training and a crash storm, measured.

Usage::

    python bench/scale.py --nodes 100                 # one size
    python bench/scale.py --nodes 100 200 400         # the growth table
    python bench/scale.py --nodes 100 --no-record     # do not append to RESULTS.md
    python bench/scale.py --big-job 16384             # one job of 16,384 replicas alone

``--big-job N`` runs :mod:`bench.bigjob` (one job of ``N`` replicas: admitted, its
generations formed, a rank's fault handled) instead of the sizes, unless ``--nodes`` is
given too; its figures are the ``big_job`` member of the JSON line.

For each size: a real ``nats-server`` (with its monitoring port, for the bus's message
counts), the real admission, health and elasticity services as their own processes
(``python -m phalanx.services.<name>``, as ``phalanx up`` runs them), and
``bench/loadgen.py`` processes simulating ``N`` node agents x 8 slots and their ranks
on the real wire (``--per-process`` nodes each). The benchmark submits ``N`` jobs of 8
one-slot replicas (elastic, 4..8; every slot filled) through the public submit
endpoint, waits for every job's first generation, then:

1. **Steady training** for ``--window-s``: every rank reports progress every 0.5 s,
   every node heartbeats every 0.5 s. Measured: bus messages/s (the server's
   ``in_msgs``/``out_msgs``), each process's CPU (cores, from ``/proc``) and RSS.
2. **Crash storm**: ``--crashes`` ranks of distinct jobs are SIGKILLed (their exits
   reported) within one second; the benchmark waits ``--settle-s``. Measured: crash →
   fault p99 (the rank's exit time to this process receiving health's fault),
   generation fan-out p99 (first receipt of a generation anywhere to its last
   member's receipt; the jobs' start generations apart, as they reach ranks the
   generator is still bringing up), fault → generation at every member p99, and misses: every
   crash must produce exactly one crash fault, every fault exactly one fault
   generation of its job, every generation must reach every member; any other
   fault (a hang or node loss the generator's own lag caused) is counted.
3. **A rack lost**: the generator process that simulates the first ``--rack`` nodes
   (64, at most a quarter of the cluster) is frozen (SIGSTOP: no heartbeat, no
   progress, no exit report, as behind a dead switch) and stays so. Measured: one
   node-lost fault for each of its ranks, how long beyond health's node timeout they
   took (p99, from the freeze), none doubled, and a new generation of every job that
   lost ranks.
4. **The bus restarted under load**: nats-server SIGKILLed and started again on the
   same port and store two seconds later. Measured: faults and generations after it
   (there must be none: an outage of the bus is not a node or rank dying), how soon
   the admission leader answers again, and the message rate afterwards against the
   steady window's.

5. **A burst of submissions**: ``--burst`` (5,000) one-slot jobs submitted at once
   (256 in flight) onto the full cluster, so they queue; then a quarter of the running
   jobs is cancelled and the queue takes their slots. Measured: the submit answer's
   p50/p99 and the burst's rate, every submission answered and queued, release →
   admitted p99 for the jobs the freed slots took, admission's CPU during the burst,
   and that no node is ever given more than its slots (from every admitted record).

Submit → admitted p99 covers the initial submissions. Every process's CPU is reported
apart: when the generator's processes use more CPU than the services, or the machine's
cores are saturated, the figures measure the machine, not phalanx, and the result
says so (``saturated``). The machine's load average is printed next to the figures.
At the end the benchmark judges every size against the targets (crash → fault p99 <
100 ms, fan-out p99 < 10 ms, nothing missed, no service above one core) and names the
sizes where all held; for every size where one missed, and every size that produced no
figures, it says what missed and whether the generator saturated the machine, from the
CPU it measured (for a failed size, from the processes' start to the failure).
The last line of output is one JSON object; figures are appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from phalanx.bench.results import append, utc_date
from phalanx.bench.run_processes import simulated_run
from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RemoteError
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Fault,
    FaultKind,
    Generation,
    GenerationReason,
    JobRecord,
    JobSpec,
    JobState,
    NodeRecord,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient
from phalanx.services.health.core import HealthPolicy
from phalanx.services.natsd import NatsServer

SERVICES = ("admission", "health", "elasticity")
NODE_TIMEOUT_S = HealthPolicy().node_timeout_s  # the services run with the defaults
SLOTS = 8  # a simulated node's (loadgen's default); every one is filled
LOADGEN = Path(__file__).resolve().parent / "loadgen.py"
TICK = os.sysconf("SC_CLK_TCK")
CRASH_TO_FAULT_P99_MS = 100.0  # the targets at every size (issue 16)
FANOUT_P99_MS = 10.0
SERVICE_CORES = 1.0  # no service above one core on average


class SizeFailed(RuntimeError):
    """A size that produced no figures, with the CPU each process used meanwhile (the
    evidence of whether the generator or the services ran the machine out)."""

    def __init__(self, error: str, usage: dict[str, Any]) -> None:
        super().__init__(error)
        self.usage = usage


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def varz(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as reply:
        stats: dict[str, Any] = json.load(reply)
    return stats


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 1)


class Meter:
    """CPU and RSS of named processes and the bus's message counts over a window.

    The processes are looked up at every sample (a nats-server restarted in a window is
    another process), and CPU is kept per process: one started in a window counts whole,
    one that ended in it counts nothing after the sample before (its time is gone with it).
    """

    def __init__(self, procs: dict[str, list[subprocess.Popen[bytes]]], server: NatsServer,
                 http_port: int) -> None:
        self.procs, self.server, self.http_port = procs, server, http_port

    def pids(self) -> dict[str, list[int]]:
        pids = {n: [p.pid for p in group] for n, group in self.procs.items()}
        pids["nats-server"] = [self.server.process.pid] if self.server.process else []
        return pids

    def sample(self) -> dict[str, Any]:
        v = varz(self.http_port)
        return {"at": time.monotonic(), "msgs": v["in_msgs"] + v["out_msgs"],
                "cpu": {name: {p: cpu_s(p) for p in pids}
                        for name, pids in self.pids().items()}}

    def between(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        wall = b["at"] - a["at"]
        cores = {n: sum(s - a["cpu"].get(n, {}).get(p, 0.0) for p, s in b["cpu"][n].items())
                 / wall for n in b["cpu"]}
        return {"seconds": round(wall, 1),
                "bus_msgs_per_s": round((b["msgs"] - a["msgs"]) / wall),
                "cpu_cores": {n: round(c, 2) for n, c in cores.items()},
                "rss_mb": {n: round(sum(rss_mb(p) for p in pids))
                           for n, pids in self.pids().items()}}


def spec(least: int = 4, most: int = 8) -> JobSpec:
    return JobSpec(name="sim", team="scale", priority_class="normal",
                   replicas=ReplicaRange(min=least, max=most), command=["true"],
                   hang_timeout_s=10.0)


def _measure(args: argparse.Namespace, nodes: int) -> dict[str, Any]:
    load_before = os.getloadavg()
    with simulated_run(SERVICES, show_logs=args.show_logs) as run:
        server, procs = run.server, run.procs
        outs = []
        # The first generator simulates the rack (frozen in its phase); no crash there.
        starts = [0, *range(args.rack, nodes, args.per_process)]
        for first, end in zip(starts, [*starts[1:], nodes], strict=True):
            count = end - first
            out = run.folder / f"gen-{first}.json"
            outs.append(out)
            share = 0 if first == 0 else args.crashes * count // (nodes - args.rack)
            log = run.log(f"gen-{first}")
            procs["loadgen"].append(subprocess.Popen(
                [sys.executable, str(LOADGEN), "--url", server.url, "--first", str(first),
                 "--nodes", str(count), "--out", str(out), "--crashes", str(share)],
                stderr=log))
        meter = Meter(procs, server, run.http_port)
        spawned = meter.sample()
        try:
            result = asyncio.run(_drive(args, nodes, server, procs, outs, meter))
        except Exception as exc:
            raise SizeFailed(f"{type(exc).__name__}: {exc}"[:300],
                             meter.between(spawned, meter.sample())) from exc
        lost = 0
        for p, out in zip(procs["loadgen"], outs, strict=True):
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:  # saturated past answering its SIGTERM
                p.kill()
            lost += not out.exists()
        gens = [json.loads(o.read_text()) for o in outs if o.exists()]
        if not any(g["first"] == 0 for g in gens):
            raise RuntimeError("the rack's generator wrote no result")
        result = _judge(nodes, gens, rack=args.rack, **result)
        # What a lost generator saw (its crashes, the generations its ranks received)
        # is missing from the figures: they are incomplete, and say so.
        result["generators_lost"] = lost
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


async def leader_answers(client: AdmissionClient) -> None:
    """Until an admission leader answers (a probe job it does not know: 404)."""
    try:
        await client.explain("probe", retry_s=60)
    except RemoteError as exc:
        if exc.code != "404":
            raise


async def _drive(args: argparse.Namespace, nodes: int, server: NatsServer,
                 procs: dict[str, list[subprocess.Popen[bytes]]], outs: list[Path],
                 meter: Meter) -> dict[str, Any]:
    await asyncio.to_thread(_wait_ready, outs, 120.0)
    jobs = nodes  # 8 one-slot replicas each: every slot of N x 8 filled
    submitted: dict[str, float] = {}
    admitted: dict[str, float] = {}
    faults: list[tuple[Fault, float]] = []
    generations: dict[tuple[str, int], tuple[Generation, float]] = {}
    config = BusConfig.load(env={}, servers=[server.url])
    all_started = asyncio.Event()

    def check_started() -> None:
        if len(admitted) >= jobs and sum(1 for (_, g) in generations if g == 0) >= jobs:
            all_started.set()

    async with await Bus.connect(config, name="scale-bench") as bus:
        async def on_state(record: JobRecord, _: Delivery) -> None:
            if record.state is JobState.ADMITTED:
                admitted.setdefault(record.job_id, time.time())
                check_started()

        async def on_fault(fault: Fault, _: Delivery) -> None:
            faults.append((fault, time.time()))

        async def on_generation(generation: Generation, _: Delivery) -> None:
            generations.setdefault((generation.job_id, generation.generation),
                                   (generation, time.time()))
            check_started()

        await bus.subscribe(subjects.job_states(), JobRecord, on_state)
        await bus.subscribe(subjects.job_fault("WILDCARD").replace(".WILDCARD.", ".*."), Fault,
                            on_fault)
        await bus.subscribe(subjects.job_generation("WILDCARD").replace(".WILDCARD.", ".*."),
                            Generation, on_generation)
        client = AdmissionClient(bus, timeout_s=30.0)
        await leader_answers(client)
        # Every simulated node registered (a submit before admission knows any node is
        # refused: the cluster is too small), then its first heartbeats seen.
        registry = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
        deadline = time.monotonic() + args.start_timeout_s
        while len((await registry.entries())[0]) < nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{nodes} simulated nodes did not all register within "
                                   f"{args.start_timeout_s:g} s")
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)
        gate = asyncio.Semaphore(32)

        async def submit(i: int) -> None:
            async with gate:
                submitted[f"sim-job-{i}"] = time.time()
                await client.submit(spec(), f"sim-job-{i}", retry_s=30)

        await asyncio.gather(*(submit(i) for i in range(jobs)))
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_started.wait(), args.start_timeout_s)
        ready_s = round(time.monotonic() - started, 1)
        first_generations = sum(1 for (_, g) in generations if g == 0)
        await asyncio.sleep(3.0)  # the start generations applied, training under way
        faults_before = len(faults)
        a = meter.sample()
        await asyncio.sleep(args.window_s)
        steady = meter.between(a, meter.sample())
        storm_at = time.time()
        b = meter.sample()
        for p in procs["loadgen"]:
            p.send_signal(signal.SIGUSR1)
        await asyncio.sleep(args.settle_s)
        storm = meter.between(b, meter.sample())

        # A rack lost: the first generator's nodes and ranks freeze (no heartbeat, no
        # progress, no exit report), as a rack behind a dead switch; they stay frozen.
        rack_at = time.time()
        procs["loadgen"][0].send_signal(signal.SIGSTOP)
        await asyncio.sleep(args.settle_s)

        # The bus restarted under that load: SIGKILL, the same port and store 2 s later.
        restart_at = time.time()
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(2.0)
        await asyncio.to_thread(server.start)
        back = time.monotonic()
        await leader_answers(client)
        answers_s = round(time.monotonic() - back, 2)
        c = meter.sample()  # the server's counters started again from zero
        await asyncio.sleep(args.settle_s)
        after_restart = meter.between(c, meter.sample())
        end_at = time.time()
        jobs_kv = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
        burst = await _burst(args, client, meter, jobs_kv, admitted, jobs)
    procs["loadgen"][0].send_signal(signal.SIGCONT)  # to write what it saw, then end
    for p in procs["loadgen"]:
        p.send_signal(signal.SIGTERM)
    return {"jobs": jobs, "submitted": submitted, "admitted": admitted, "faults": faults,
            "faults_before": faults_before, "generations": generations, "storm_at": storm_at,
            "steady": steady, "storm": storm, "ready_s": ready_s,
            "first_generations": first_generations, "rack_at": rack_at,
            "restart_at": restart_at, "end_at": end_at, "after_restart": after_restart,
            "answers_after_restart_s": answers_s, "burst": burst}


async def _burst(args: argparse.Namespace, client: AdmissionClient, meter: Meter,
                 jobs_kv: TypedKV[JobRecord], admitted: dict[str, float],
                 jobs: int) -> dict[str, Any]:
    """Phase 5: ``--burst`` one-slot jobs submitted at once onto the full cluster, then a
    quarter of the running jobs cancelled so the queue takes their slots.

    Which jobs run, and where, is read from the jobs' records in KV: the state events
    this process subscribes to are dropped when it falls behind (a slow consumer), so
    only the release → admitted times come from them."""

    async def admitted_records() -> dict[str, JobRecord]:
        entries, _ = await jobs_kv.entries()
        return {e.key: e.value for e in entries if e.value.state is JobState.ADMITTED}

    one = spec(1, 1)
    answered: list[float] = []
    refused: list[str] = []
    gate = asyncio.Semaphore(256)

    async def submit(i: int) -> None:
        async with gate:
            asked = time.monotonic()
            try:
                record = await client.submit(one, f"burst-{i}", retry_s=30)
            except RemoteError as exc:
                refused.append(exc.description)
                return
            answered.append(time.monotonic() - asked)
            if record.state is not JobState.PENDING:
                refused.append(f"burst-{i} answered {record.state.value}")

    a = meter.sample()
    started = time.monotonic()
    await asyncio.gather(*(submit(i) for i in range(args.burst)))
    submit_s = time.monotonic() - started
    during = meter.between(a, meter.sample())
    before = await admitted_records()
    running = [f"sim-job-{i}" for i in range(jobs) if f"sim-job-{i}" in before]
    released = running[len(running) - len(running) // 4:]
    freed = sum(len(before[j].nodes) for j in released)
    admitted_before = {j for j in before if j.startswith("burst-")}
    release_at = time.time()
    await asyncio.gather(*(client.cancel(j, retry_s=30) for j in released))
    await asyncio.sleep(args.settle_s)
    after = await admitted_records()
    took = [at - release_at for j, at in admitted.items()
            if j.startswith("burst-") and j not in admitted_before]
    per_node: dict[str, int] = defaultdict(int)
    for record in after.values():
        for node in record.nodes:
            per_node[node] += record.spec.slots_per_replica
    answered.sort()
    return {"submissions": args.burst, "answered": len(answered), "refused": len(refused),
            "refusals": refused[:3], "submit_s": round(submit_s, 2),
            "submits_per_s": round(len(answered) / submit_s) if submit_s else None,
            "answer_p50_ms": round(answered[len(answered) // 2] * 1000, 1)
            if answered else None, "answer_p99_ms": p99(answered),
            "admitted_while_full": len(admitted_before),
            "released_jobs": len(released), "freed_slots": freed,
            "admitted_after_release": sum(j.startswith("burst-") for j in after)
            - len(admitted_before), "release_to_admitted_p99_ms": p99(took),
            "nodes_over_their_slots": sum(n > SLOTS for n in per_node.values()),
            "admission_cpu_cores": during["cpu_cores"]["admission"],
            "bus_msgs_per_s": during["bus_msgs_per_s"]}


def _wait_ready(outs: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(o.with_suffix(".ready").exists() for o in outs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the load generators did not start within {timeout_s:g} s")
        time.sleep(0.2)


def _judge(nodes: int, gens: list[dict[str, Any]], *, jobs: int,
           submitted: dict[str, float], admitted: dict[str, float],
           faults: list[tuple[Fault, float]], faults_before: int,
           generations: dict[tuple[str, int], tuple[Generation, float]], storm_at: float,
           steady: dict[str, Any], storm: dict[str, Any], ready_s: float,
           first_generations: int, rack_at: float, restart_at: float, end_at: float,
           after_restart: dict[str, Any], answers_after_restart_s: float,
           rack: int, burst: dict[str, Any]) -> dict[str, Any]:
    crashes = [c for g in gens for c in g["crashes"]]
    received: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for job_id, number, replica, at in (r for g in gens for r in g["received"]):
        received[(job_id, number)][replica] = at
    crash_faults: dict[tuple[str, str | None], list[float]] = defaultdict(list)
    other_faults: dict[str, int] = defaultdict(int)
    for fault, at in faults:
        if at >= rack_at:
            continue  # the rack's and the restart's phases are judged apart
        if fault.kind is FaultKind.CRASH:
            crash_faults[(fault.job_id, fault.replica_id)].append(at)
        else:
            other_faults[fault.kind.value] += 1
    to_fault = []
    crash_missed = crash_doubled = 0
    for c in crashes:
        seen = crash_faults.get((c["job_id"], c["replica_id"]), [])
        crash_missed += not seen
        crash_doubled += len(seen) > 1
        if seen:
            to_fault.append(seen[0] - c["at"])
    crashed = {(c["job_id"], c["replica_id"]) for c in crashes}
    unexplained = sum(len(v) for k, v in crash_faults.items() if k not in crashed)
    fault_generations: dict[str, list[tuple[Generation, float]]] = defaultdict(list)
    for generation, at in generations.values():
        if generation.reason is GenerationReason.FAULT and storm_at <= at < rack_at:
            fault_generations[generation.job_id].append((generation, at))
    per_job_faults: dict[str, int] = defaultdict(int)
    for job_id, _ in crash_faults:
        per_job_faults[job_id] += 1
    gen_mismatch = sum(len(fault_generations.get(j, [])) != n for j, n in per_job_faults.items())
    fanout: list[float] = []
    fanout_start: list[float] = []
    fault_to_all: list[float] = []
    fanout_missed = 0
    spreads: list[tuple[float, str, int, int]] = []  # ms, reason, generation, members
    for (job_id, number), (generation, at) in generations.items():
        if at >= rack_at:
            continue  # members on the frozen rack never receive what follows
        got = received.get((job_id, number), {})
        members = [m.replica_id for m in generation.members]
        if any(m not in got for m in members):
            fanout_missed += 1
            continue
        last = max(got[m] for m in members)
        spread = last - min([at, *got.values()])
        # A start generation reaches ranks the generator is still bringing up (its own
        # start-up burst, not the bus's fan-out): reported apart from membership changes.
        (fanout_start if generation.reason is GenerationReason.START else fanout).append(spread)
        spreads.append((round(spread * 1000, 1), generation.reason.value, number,
                        len(members)))
        if generation.reason is GenerationReason.FAULT:
            detected = [f.detected_at for f, _ in faults if f.job_id == job_id]
            if detected:
                fault_to_all.append(last - max(d for d in detected if d <= last)
                                    if any(d <= last for d in detected) else 0.0)
    lag = max(g["step_lag_max_s"] for g in gens if g["first"] != 0)  # the rack was frozen
    generator_cores = steady["cpu_cores"]["loadgen"]
    service_cores = sum(v for k, v in steady["cpu_cores"].items() if k != "loadgen")
    return {
        "nodes": nodes, "slots": nodes * SLOTS, "jobs": jobs,
        "ranks": sum(g["ranks"] for g in gens),
        "admitted": sum(j in admitted for j in submitted),
        "first_generations": first_generations,
        "start_s": ready_s,
        "submit_to_admitted_p99_ms": p99([admitted[j] - submitted[j]
                                          for j in submitted if j in admitted]),
        "steady": steady, "storm": storm,
        "crashes": len(crashes), "crash_to_fault_p99_ms": p99(to_fault),
        "crash_faults_missed": crash_missed, "crash_faults_doubled": crash_doubled,
        "crash_faults_unexplained": unexplained,
        "faults_not_one_generation": gen_mismatch,
        "other_faults": dict(other_faults), "faults_before_storm": faults_before,
        "fanout_p99_ms": p99(fanout), "fault_to_all_members_p99_ms": p99(fault_to_all),
        "fanout_start_p99_ms": p99(fanout_start),
        "fanout_slowest": sorted(spreads, reverse=True)[:5],
        "generations": len(generations), "fanout_missed": fanout_missed,
        "generator_step_lag_max_s": lag,
        "generator_cores": generator_cores, "services_and_bus_cores": round(service_cores, 2),
        # Or the generator fell behind its own schedule (a rank's progress late).
        "saturated": generator_bound(steady) or lag > 0.5,
        "rack": _judge_rack(rack, faults, generations, rack_at, restart_at),
        "bus_restart": _judge_restart(faults, generations, restart_at, end_at,
                                      steady, after_restart, answers_after_restart_s),
        "burst": burst,
    }


def generator_bound(usage: dict[str, Any]) -> bool:
    """Whether the load generator, not phalanx, ran the machine out: it used more CPU than
    the services and the bus together, or the machine's cores were nearly all busy."""
    cores = usage["cpu_cores"]
    generator = cores.get("loadgen", 0.0)
    services = sum(v for k, v in cores.items() if k != "loadgen")
    return bool(generator > services or generator + services > 0.9 * (os.cpu_count() or 1))


def targets(r: dict[str, Any]) -> dict[str, bool]:
    """Which of issue 16's targets one size's figures meet."""
    rack, bus, burst = r["rack"], r["bus_restart"], r["burst"]
    service_cores = [v for k, v in r["steady"]["cpu_cores"].items()
                     if k in SERVICES]
    return {
        "crash_to_fault_p99": r["crash_to_fault_p99_ms"] is not None
        and r["crash_to_fault_p99_ms"] < CRASH_TO_FAULT_P99_MS,
        "fanout_p99": r["fanout_p99_ms"] is not None and r["fanout_p99_ms"] < FANOUT_P99_MS,
        "nothing_missed": not any((r["crash_faults_missed"], r["crash_faults_doubled"],
                                   r["crash_faults_unexplained"],
                                   r["faults_not_one_generation"], r["fanout_missed"],
                                   rack["doubled"], rack["jobs_missing_a_generation"],
                                   bus["faults"], bus["generations"],
                                   burst["nodes_over_their_slots"]))
        and rack["node_lost_faults"] == rack["ranks"]
        and burst["answered"] == burst["submissions"],
        "no_service_above_one_core": max(service_cores) <= SERVICE_CORES,
    }


def summarize(results: list[dict[str, Any]], failed: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest size at which every target held, and for every size where one missed
    whether the generator saturated the machine (from the CPU the benchmark measured)."""
    missed_by_size = {r["nodes"]: [t for t, ok in targets(r).items() if not ok]
                      for r in results}
    held = [nodes for nodes, missed in missed_by_size.items() if not missed]
    misses = sorted([(r["nodes"], missed_by_size[r["nodes"]], r["saturated"], r["steady"])
                     for r in results if missed_by_size[r["nodes"]]]
                    + [(f["nodes"], ["no figures: " + f["error"]], f["saturated"], f["usage"])
                       for f in failed], key=lambda row: row[0])
    lines = [f"every target held at {', '.join(map(str, held))} simulated nodes" if held
             else "no size met every target"]
    for nodes, missed, saturated, usage in misses:
        cores = usage["cpu_cores"]
        services = sum(v for k, v in cores.items() if k != "loadgen")
        cause = ("the load generator saturated the machine" if saturated
                 else "NOT explained by the generator")
        lines.append(f"{nodes} nodes: {', '.join(missed)} — {cause} "
                     f"(generator {cores.get('loadgen', 0.0):.2f} cores, services and bus "
                     f"{services:.2f}, of {os.cpu_count()})")
    return {"largest_size_every_target_held": max(held, default=None),
            "misses": [{"nodes": n, "missed": m, "generator_saturated": s}
                       for n, m, s, _ in misses],
            "verdict": "; ".join(lines)}


def _judge_rack(rack: int, faults: list[tuple[Fault, float]],
                generations: dict[tuple[str, int], tuple[Generation, float]],
                rack_at: float, restart_at: float) -> dict[str, Any]:
    """The rack's phase: one node-lost fault for every rank on the rack's nodes (health
    knows them from their starts), received within health's node timeout after the
    freeze (the figure is what it took beyond the timeout: at most one heartbeat
    interval early, as a node's last beat came up to 0.5 s before the freeze), and a
    generation of every job that lost ranks without losing all of them."""
    nodes = {f"sim-{i}" for i in range(rack)}
    lost: dict[tuple[str, int | None], list[float]] = defaultdict(list)
    others: dict[str, int] = defaultdict(int)
    for fault, at in faults:
        if not rack_at <= at < restart_at:
            continue
        if fault.kind is FaultKind.NODE_LOST and fault.node_id in nodes:
            lost[(fault.job_id, fault.rank)].append(at)
        else:
            others[fault.kind.value] += 1
    jobs = {job for job, _ in lost}
    regenerated = {g.job_id for g, at in generations.values()
                   if rack_at <= at < restart_at and g.job_id in jobs}
    # A job whose every member was on the rack has no one left to form a generation with:
    # it waits for replacements (or is requeued), so it is not counted as missing one.
    latest: dict[str, Generation] = {}
    for generation, at in generations.values():
        known = latest.get(generation.job_id)
        if at < rack_at and (known is None or generation.generation > known.generation):
            latest[generation.job_id] = generation
    wholly = {job for job in jobs if job in latest
              and all(m.node_id in nodes for m in latest[job].members)}
    return {"nodes": rack, "ranks": rack * SLOTS, "node_lost_faults": len(lost),
            "nodes_reported": len({f.node_id for f, at in faults if rack_at <= at < restart_at
                                   and f.kind is FaultKind.NODE_LOST}),
            "doubled": sum(len(v) > 1 for v in lost.values()),
            "beyond_timeout_p99_ms": p99([min(v) - rack_at - NODE_TIMEOUT_S
                                          for v in lost.values()]),
            "jobs_hit": len(jobs), "jobs_wholly_on_the_rack": len(wholly),
            "jobs_with_a_new_generation": len(regenerated),
            "jobs_missing_a_generation": len(jobs - wholly - regenerated),
            "other_faults": dict(others)}


def _judge_restart(faults: list[tuple[Fault, float]],
                   generations: dict[tuple[str, int], tuple[Generation, float]],
                   restart_at: float, end_at: float, steady: dict[str, Any],
                   after: dict[str, Any], answers_s: float) -> dict[str, Any]:
    """The bus restart's phase: no fault and no generation at all (an outage of the bus
    is not a node or rank dying), the control plane answering again, and the message
    rate back to the steady window's."""
    kinds: dict[str, int] = defaultdict(int)
    for fault, at in faults:
        if restart_at <= at < end_at:
            kinds[fault.kind.value] += 1
    return {"faults": dict(kinds),
            "generations": sum(1 for _, at in generations.values() if restart_at <= at < end_at),
            "admission_answers_s": answers_s,
            "bus_msgs_per_s_after": after["bus_msgs_per_s"],
            "bus_msgs_per_s_steady": steady["bus_msgs_per_s"]}


def section(command: str, results: list[dict[str, Any]], failed: list[dict[str, Any]],
            summary: dict[str, Any]) -> str:
    lines = [f"\n## Control plane at scale (bench/scale.py)\n\n`{command}` — {utc_date()}\n",
             "Real nats-server, admission, health and elasticity processes; simulated agents "
             "and ranks (bench/loadgen.py), 8 slots a node, 8-rank jobs, progress and "
             "heartbeats every 0.5 s. CPU in cores (2 on this machine, shared with other "
             "engineers' test runs); load average before/after each size.\n",
             "| nodes | ranks | first generations / jobs | bus msg/s | admission cpu / MB | "
             "health cpu / MB | elasticity cpu / MB | nats cpu / MB | generator cpu | "
             "submit→admitted p99 | crashes | crash→fault p99 | fan-out p99 (start generations) | "
             "fault→all members p99 | missed | other faults | rack lost: nodes, node-lost "
             "faults / its slots (all filled), beyond the timeout p99, jobs hit: with a "
             "new generation / wholly on the rack / missing one | "
             "bus restart: faults, generations, admission answers after, msg/s after / steady "
             "| burst: answered / submitted, answer p50 / p99, submits/s, admission cpu | "
             "burst: freed slots, admitted after, release→admitted p99, nodes over their "
             "slots | saturated | load |",
             "|" + "---|" * 22]
    for r in results:
        s, rack, bus, burst = r["steady"], r["rack"], r["bus_restart"], r["burst"]
        lost = f" ({r['generators_lost']} generator(s) lost)" if r["generators_lost"] else ""
        cell = {n: f"{s['cpu_cores'][n]} / {s['rss_mb'][n]}" for n in s["cpu_cores"]}
        missed = (f"faults missed {r['crash_faults_missed']}, doubled "
                  f"{r['crash_faults_doubled']}, not one generation "
                  f"{r['faults_not_one_generation']}, fan-out {r['fanout_missed']}")
        lines.append(
            f"| {r['nodes']} | {r['ranks']} | {r['first_generations']} / {r['jobs']} | "
            f"{s['bus_msgs_per_s']} | {cell['admission']} | "
            f"{cell['health']} | {cell['elasticity']} | {cell['nats-server']} | "
            f"{s['cpu_cores']['loadgen']} | {r['submit_to_admitted_p99_ms']} ms | "
            f"{r['crashes']} | {r['crash_to_fault_p99_ms']} ms | {r['fanout_p99_ms']} ms "
            f"({r['fanout_start_p99_ms']} ms) | "
            f"{r['fault_to_all_members_p99_ms']} ms | {missed} | {r['other_faults']} | "
            f"{rack['nodes']}, {rack['node_lost_faults']} / {rack['ranks']}, "
            f"{rack['beyond_timeout_p99_ms']} ms, {rack['jobs_hit']}: "
            f"{rack['jobs_with_a_new_generation']} / {rack['jobs_wholly_on_the_rack']} / "
            f"{rack['jobs_missing_a_generation']} | {bus['faults'] or 0}, {bus['generations']}, "
            f"{bus['admission_answers_s']} s, {bus['bus_msgs_per_s_after']} / "
            f"{bus['bus_msgs_per_s_steady']} | "
            f"{burst['answered']} / {burst['submissions']}, {burst['answer_p50_ms']} / "
            f"{burst['answer_p99_ms']} ms, {burst['submits_per_s']}, "
            f"{burst['admission_cpu_cores']} | {burst['freed_slots']}, "
            f"{burst['admitted_after_release']}, {burst['release_to_admitted_p99_ms']} ms, "
            f"{burst['nodes_over_their_slots']} | "
            f"{r['saturated']}{lost} | "
            f"{r['loadavg_before'][0]} → {r['loadavg_after'][0]} |")
    lines += [f"\n{f['nodes']} nodes: no figures, the run failed: {f['error']}" for f in failed]
    lines.append(f"\nTargets (crash → fault p99 < {CRASH_TO_FAULT_P99_MS:g} ms, fan-out p99 < "
                 f"{FANOUT_P99_MS:g} ms, nothing missed, no service above "
                 f"{SERVICE_CORES:g} core): {summary['verdict']}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=None,
                        help="simulated nodes of each size (default 100; none with "
                             "--big-job alone)")
    parser.add_argument("--per-process", type=int, default=100,
                        help="simulated nodes per load-generator process")
    parser.add_argument("--crashes", type=int, default=None,
                        help="ranks crashed in the storm (default: a quarter of the jobs)")
    parser.add_argument("--rack", type=int, default=64,
                        help="nodes of the rack lost at once (at most a quarter of the nodes)")
    parser.add_argument("--burst", type=int, default=5000,
                        help="one-slot jobs submitted at once in phase 5 (default 5,000)")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=8.0)
    parser.add_argument("--start-timeout-s", type=float, default=60.0)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--show-logs", action="store_true",
                        help="print the tail of every process's log after each size")
    parser.add_argument("--big-job", type=int, default=None, metavar="N",
                        help="one job of N replicas (bench/bigjob.py)")
    parser.add_argument("--big-per-process", type=int, default=512,
                        help="simulated nodes per load-generator process in --big-job")
    parser.add_argument("--big-heartbeat-s", type=float, default=2.0)
    parser.add_argument("--big-step-s", type=float, default=10.0)
    parser.add_argument("--big-timeout-s", type=float, default=300.0,
                        help="how long each stage of --big-job may take")
    args = parser.parse_args(argv)
    command = "python bench/scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.nodes is None:
        args.nodes = [] if args.big_job else [100]
    big: dict[str, Any] | None = None
    if args.big_job:
        from phalanx.bench import bigjob

        try:
            big = bigjob.measure(args, args.big_job)
        except Exception as exc:  # a finding too: recorded as such
            big = {"replicas": args.big_job, "error": f"{type(exc).__name__}: {exc}"[:500]}
        big["date"] = utc_date()
        print(json.dumps(big), flush=True)
        if not args.no_record:
            append(bigjob.section(command, big) if "error" not in big else
                   f"\n## A {args.big_job:,}-replica job (bench/scale.py --big-job)\n\n"
                   f"`{command}` — {big['date']}: no figures, the run failed: "
                   f"{big['error']}\n")
    results = []
    failed = []
    for nodes in args.nodes:
        run = argparse.Namespace(**vars(args))
        run.crashes = args.crashes if args.crashes is not None else max(1, nodes // 4)
        run.rack = max(1, min(args.rack, nodes // 4))
        try:
            result = _measure(run, nodes)
        except SizeFailed as exc:  # one size's failure is a finding: recorded, and on
            failed.append({"nodes": nodes, "error": str(exc), "usage": exc.usage,
                           "saturated": generator_bound(exc.usage)})
            print(json.dumps(failed[-1]), flush=True)
            continue
        print(json.dumps(result), flush=True)
        results.append(result)
    summary = summarize(results, failed)
    if args.nodes:
        print(summary["verdict"], flush=True)
        if not args.no_record:
            append(section(command, results, failed, summary))
    print(json.dumps({"scale": results, "failed": failed, "summary": summary,
                      **({"big_job": big} if big is not None else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
