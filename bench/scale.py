"""The control plane at cluster scale: steady training and a crash storm, measured.

Usage::

    python bench/scale.py --nodes 100                 # one size
    python bench/scale.py --nodes 100 200 400         # the growth table
    python bench/scale.py --nodes 100 --no-record     # do not append to RESULTS.md

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
   member's receipt), fault → generation at every member p99, and misses: every
   crash must produce exactly one crash fault, every fault exactly one fault
   generation of its job, every generation must reach every member; any other
   fault (a hang or node loss the generator's own lag caused) is counted.

Submit → admitted p99 covers the initial submissions. Every process's CPU is reported
apart: when the generator's processes use more CPU than the services, or the machine's
cores are saturated, the figures measure the machine, not phalanx, and the result
says so (``saturated``). The machine's load average is printed next to the figures.
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
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import append, utc_date

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RemoteError
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Fault,
    FaultKind,
    Generation,
    GenerationReason,
    JobRecord,
    JobSpec,
    JobState,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient
from phalanx.services.natsd import NatsServer, free_port

SERVICES = ("admission", "health", "elasticity")
LOADGEN = Path(__file__).resolve().parent / "loadgen.py"
TICK = os.sysconf("SC_CLK_TCK")


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
        return json.load(reply)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 1)


class Meter:
    """CPU and RSS of named processes and the bus's message counts over a window."""

    def __init__(self, pids: dict[str, list[int]], http_port: int) -> None:
        self.pids, self.http_port = pids, http_port

    def sample(self) -> dict[str, Any]:
        v = varz(self.http_port)
        return {"at": time.monotonic(), "msgs": v["in_msgs"] + v["out_msgs"],
                "cpu": {name: sum(cpu_s(p) for p in pids) for name, pids in self.pids.items()}}

    def between(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        wall = b["at"] - a["at"]
        return {"seconds": round(wall, 1),
                "bus_msgs_per_s": round((b["msgs"] - a["msgs"]) / wall),
                "cpu_cores": {n: round((b["cpu"][n] - a["cpu"][n]) / wall, 2) for n in a["cpu"]},
                "rss_mb": {n: round(sum(rss_mb(p) for p in pids))
                           for n, pids in self.pids.items()}}


def spec() -> JobSpec:
    return JobSpec(name="sim", team="scale", priority_class="normal",
                   replicas=ReplicaRange(min=4, max=8), command=["true"], hang_timeout_s=10.0)


def _measure(args: argparse.Namespace, nodes: int) -> dict[str, Any]:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as files:
        http_port = free_port()
        conf = Path(tmp, "nats.conf")
        conf.write_text(f"http: 127.0.0.1:{http_port}\n")
        server = NatsServer(Path(tmp, "js"), port=free_port(), config_file=conf).start()
        procs: dict[str, list[subprocess.Popen[bytes]]] = defaultdict(list)
        env = {**os.environ, "PHALANX_NATS_URL": server.url}
        try:
            for name in SERVICES:
                log = files.enter_context(Path(tmp, f"{name}.log").open("wb"))
                procs[name].append(subprocess.Popen(
                    [sys.executable, "-m", f"phalanx.services.{name}", "--log-level", "WARNING"],
                    env=env, stdout=log, stderr=log))
            outs = []
            for first in range(0, nodes, args.per_process):
                count = min(args.per_process, nodes - first)
                out = Path(tmp, f"gen-{first}.json")
                outs.append(out)
                share = args.crashes * count // nodes
                log = files.enter_context(Path(tmp, f"gen-{first}.log").open("wb"))
                procs["loadgen"].append(subprocess.Popen(
                    [sys.executable, str(LOADGEN), "--url", server.url, "--first", str(first),
                     "--nodes", str(count), "--out", str(out), "--crashes", str(share)],
                    stderr=log))
            result = asyncio.run(_drive(args, nodes, server, procs, outs, http_port))
            for p in procs["loadgen"]:
                p.wait(60)
            gens = [json.loads(o.read_text()) for o in outs]
            result = _judge(nodes, gens, **result)
        finally:
            for group in procs.values():
                for p in group:
                    if p.poll() is None:
                        p.terminate()
            for group in procs.values():
                for p in group:
                    try:
                        p.wait(20)
                    except subprocess.TimeoutExpired:
                        p.kill()
            server.stop()
            if args.show_logs:
                for log_path in sorted(Path(tmp).glob("*.log")):
                    print(f"--- {log_path.name}", log_path.read_text()[-3000:], file=sys.stderr)
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


async def _drive(args: argparse.Namespace, nodes: int, server: NatsServer,
                 procs: dict[str, list[subprocess.Popen[bytes]]], outs: list[Path],
                 http_port: int) -> dict[str, Any]:
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
        try:  # a leader answers: the probe job is unknown to it
            await client.explain("probe", retry_s=60)
        except RemoteError as exc:
            if exc.code != "404":
                raise
        await asyncio.sleep(2.0)  # every node's first heartbeats seen
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
        pids = {n: [p.pid for p in group] for n, group in procs.items()}
        pids["nats-server"] = [server.process.pid] if server.process else []
        meter = Meter(pids, http_port)
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
    for p in procs["loadgen"]:
        p.send_signal(signal.SIGTERM)
    return {"jobs": jobs, "submitted": submitted, "admitted": admitted, "faults": faults,
            "faults_before": faults_before, "generations": generations, "storm_at": storm_at,
            "steady": steady, "storm": storm, "ready_s": ready_s,
            "first_generations": first_generations}


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
           first_generations: int) -> dict[str, Any]:
    crashes = [c for g in gens for c in g["crashes"]]
    received: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for job_id, number, replica, at in (r for g in gens for r in g["received"]):
        received[(job_id, number)][replica] = at
    crash_faults: dict[tuple[str, str | None], list[float]] = defaultdict(list)
    other_faults: dict[str, int] = defaultdict(int)
    for fault, at in faults:
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
        if generation.reason is GenerationReason.FAULT and at >= storm_at:
            fault_generations[generation.job_id].append((generation, at))
    per_job_faults: dict[str, int] = defaultdict(int)
    for job_id, _ in crash_faults:
        per_job_faults[job_id] += 1
    gen_mismatch = sum(len(fault_generations.get(j, [])) != n for j, n in per_job_faults.items())
    fanout, fault_to_all, fanout_missed = [], [], 0
    for (job_id, number), (generation, at) in generations.items():
        got = received.get((job_id, number), {})
        members = [m.replica_id for m in generation.members]
        if any(m not in got for m in members):
            fanout_missed += 1
            continue
        last = max(got[m] for m in members)
        fanout.append(last - min([at, *got.values()]))
        if generation.reason is GenerationReason.FAULT:
            detected = [f.detected_at for f, _ in faults if f.job_id == job_id]
            if detected:
                fault_to_all.append(last - max(d for d in detected if d <= last)
                                    if any(d <= last for d in detected) else 0.0)
    lag = max(g["step_lag_max_s"] for g in gens)
    generator_cores = steady["cpu_cores"]["loadgen"]
    service_cores = sum(v for k, v in steady["cpu_cores"].items() if k != "loadgen")
    busy = generator_cores + service_cores
    return {
        "nodes": nodes, "slots": nodes * 8, "jobs": jobs, "ranks": sum(g["ranks"] for g in gens),
        "admitted": len(admitted), "first_generations": first_generations,
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
        "generations": len(generations), "fanout_missed": fanout_missed,
        "generator_step_lag_max_s": lag,
        "generator_cores": generator_cores, "services_and_bus_cores": round(service_cores, 2),
        "saturated": bool(generator_cores > service_cores or busy > 1.8 or lag > 0.5),
    }


def section(command: str, results: list[dict[str, Any]]) -> str:
    lines = [f"\n## Control plane at scale (bench/scale.py)\n\n`{command}` — {utc_date()}\n",
             "Real nats-server, admission, health and elasticity processes; simulated agents "
             "and ranks (bench/loadgen.py), 8 slots a node, 8-rank jobs, progress and "
             "heartbeats every 0.5 s. CPU in cores (2 on this machine, shared with other "
             "engineers' test runs); load average before/after each size.\n",
             "| nodes | ranks | first generations / jobs | bus msg/s | admission cpu / MB | "
             "health cpu / MB | elasticity cpu / MB | nats cpu / MB | generator cpu | "
             "submit→admitted p99 | crashes | crash→fault p99 | fan-out p99 | "
             "fault→all members p99 | missed | other faults | saturated | load |",
             "|" + "---|" * 18]
    for r in results:
        s = r["steady"]
        cell = {n: f"{s['cpu_cores'][n]} / {s['rss_mb'][n]}" for n in s["cpu_cores"]}
        missed = (f"faults missed {r['crash_faults_missed']}, doubled "
                  f"{r['crash_faults_doubled']}, not one generation "
                  f"{r['faults_not_one_generation']}, fan-out {r['fanout_missed']}")
        lines.append(
            f"| {r['nodes']} | {r['ranks']} | {r['first_generations']} / {r['jobs']} | "
            f"{s['bus_msgs_per_s']} | {cell['admission']} | "
            f"{cell['health']} | {cell['elasticity']} | {cell['nats-server']} | "
            f"{s['cpu_cores']['loadgen']} | {r['submit_to_admitted_p99_ms']} ms | "
            f"{r['crashes']} | {r['crash_to_fault_p99_ms']} ms | {r['fanout_p99_ms']} ms | "
            f"{r['fault_to_all_members_p99_ms']} ms | {missed} | {r['other_faults']} | "
            f"{r['saturated']} | {r['loadavg_before'][0]} → {r['loadavg_after'][0]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100])
    parser.add_argument("--per-process", type=int, default=100,
                        help="simulated nodes per load-generator process")
    parser.add_argument("--crashes", type=int, default=None,
                        help="ranks crashed in the storm (default: a quarter of the jobs)")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=8.0)
    parser.add_argument("--start-timeout-s", type=float, default=60.0)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--show-logs", action="store_true",
                        help="print the tail of every process's log after each size")
    args = parser.parse_args(argv)
    results = []
    for nodes in args.nodes:
        run = argparse.Namespace(**vars(args))
        run.crashes = args.crashes if args.crashes is not None else max(1, nodes // 4)
        result = _measure(run, nodes)
        print(json.dumps(result), flush=True)
        results.append(result)
    if not args.no_record:
        append(section("python bench/scale.py " + " ".join(sys.argv[1:] if argv is None
                                                             else argv), results))
    print(json.dumps({"scale": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
