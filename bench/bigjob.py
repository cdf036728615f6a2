"""One job of thousands of replicas through the real control plane (``scale.py --big-job``).

``python bench/scale.py --big-job 16384`` starts a real ``nats-server``, the admission,
health and elasticity services as their own processes, and ``bench/loadgen.py``
processes simulating ``ceil(N / 8)`` node agents of 8 slots and their ranks on the real
wire; then submits one elastic job of ``N`` one-slot replicas (``min = N - 8``: it
survives a node's worth of losses) and measures:

* **admission**: submit -> the admitted record received;
* **generation formation**: admitted -> generation 0 received, and -> received by its
  last member (every simulated rank ready first: one ``ready`` event per replica);
* **applied**: generation 0 -> every member's ``applied`` report;
* **a fault**: one member rank SIGKILLed (its exit reported, as ``phalanx chaos
  kill-rank`` does) -> health's fault -> the fault generation without it, received
  here and by its last member; then the replacement's join generation (back to N);
* **bytes**: each generation's encoding, its stored pointer and chunks, and the
  elasticity and health leaders' stored state of the job.

Heartbeats every ``--big-heartbeat-s`` (2 s) and progress every ``--big-step-s`` (10 s)
rather than the agent's 0.5 s: 2,048 nodes and 16,384 ranks at the defaults would be
36,000 messages a second from one 2-core machine, which measures the generator. Health's
node timeout and admission's ``lost_after_s`` are raised to five heartbeats to match. CPU
per process is reported: where the generators take more than the services, the figures
are the machine's.
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
from collections import defaultdict
from typing import Any

from phalanx.bench.run_processes import simulated_run
from phalanx.bus import spill
from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import settings, subjects
from phalanx.schemas.codec import encode
from phalanx.schemas.messages import (
    MAX_SPILLED_BYTES,
    Fault,
    Generation,
    GenerationApplied,
    GenerationReason,
    JobRecord,
    JobSnapshot,
    JobSpec,
    JobState,
    NodeRecord,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient
from phalanx.services.natsd import NatsServer

SLOTS = 8
JOB = "big-job"


def measure(args: argparse.Namespace, replicas: int) -> dict[str, Any]:
    """Run the phase at ``replicas``; its figures."""
    from phalanx.bench.scale import LOADGEN, SERVICES, Meter, _wait_ready

    nodes = -(-replicas // SLOTS)
    load_before = os.getloadavg()
    env = {settings.HEALTH("node_timeout_s"): str(5 * args.big_heartbeat_s),
           settings.ADMISSION("lost_after_s"): str(5 * args.big_heartbeat_s)}
    with simulated_run(SERVICES, env, args.show_logs) as run:
        server, procs = run.server, run.procs
        outs = []
        starts = list(range(0, nodes, args.big_per_process))
        for i, first in enumerate(starts):
            count = min(args.big_per_process, nodes - first)
            out = run.folder / f"gen-{first}.json"
            outs.append(out)
            log = run.log(f"gen-{first}")
            procs["loadgen"].append(subprocess.Popen(
                [sys.executable, str(LOADGEN), "--url", server.url, "--first", str(first),
                 "--nodes", str(count), "--out", str(out),
                 "--heartbeat-s", str(args.big_heartbeat_s),
                 "--step-s", str(args.big_step_s),
                 "--crashes", "1" if i == len(starts) - 1 else "0"], stderr=log))
        meter = Meter(procs, server, run.http_port)
        began = meter.sample()
        _wait_ready(outs, 300.0)
        result = asyncio.run(_drive(args, replicas, nodes, server, procs))
        result["usage"] = meter.between(began, meter.sample())
        for p in procs["loadgen"]:
            p.send_signal(signal.SIGTERM)
        for p in procs["loadgen"]:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
        gens = [json.loads(o.read_text()) for o in outs if o.exists()]
        result.update(_members(result.pop("times"), gens))
        result["generators_lost"] = len(outs) - len(gens)
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


async def _drive(args: argparse.Namespace, replicas: int, nodes: int, server: NatsServer,
                 procs: dict[str, list[subprocess.Popen[bytes]]]) -> dict[str, Any]:
    from phalanx.bench.scale import leader_answers

    config = BusConfig.load(env={}, servers=[server.url])
    got: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
    at: dict[str, float] = {}
    generations: dict[int, tuple[Generation, float]] = {}
    applied: dict[int, set[str]] = defaultdict(set)
    faults: list[tuple[Fault, float]] = []

    def seen(what: str) -> None:
        at.setdefault(what, time.time())
        got[what].set()

    async def wait(what: str, timeout_s: float) -> float | None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(got[what].wait(), timeout_s)
        return at.get(what)

    async with await Bus.connect(config, name="big-job-bench") as bus:
        async def on_state(record: JobRecord, _: Delivery) -> None:
            if record.state is JobState.ADMITTED:
                seen("admitted")

        async def on_generation(g: Generation, _: Delivery) -> None:
            generations.setdefault(g.generation, (g, time.time()))
            seen(f"g{g.generation}")
            if g.reason is GenerationReason.FAULT:
                seen("fault generation")
            if g.reason is GenerationReason.JOIN and g.world_size == replicas:
                seen("full again")

        async def on_applied(a: GenerationApplied, _: Delivery) -> None:
            applied[a.generation].add(a.replica_id)
            if a.generation == 0 and len(applied[0]) >= replicas:
                seen("applied")

        async def on_fault(fault: Fault, _: Delivery) -> None:
            faults.append((fault, time.time()))
            seen("fault")

        await bus.subscribe(subjects.job_state(JOB), JobRecord, on_state)
        await bus.subscribe(subjects.job_generation(JOB), Generation, on_generation)
        await bus.subscribe(subjects.generation_applied(JOB), GenerationApplied, on_applied)
        await bus.subscribe(subjects.job_fault(JOB), Fault, on_fault)
        client = AdmissionClient(bus, timeout_s=60.0)
        await leader_answers(client)
        registry = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
        deadline = time.monotonic() + args.start_timeout_s
        while len(await registry._keys()) < nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{nodes} simulated nodes did not all register")
            await asyncio.sleep(0.5)
        await asyncio.sleep(2 * args.big_heartbeat_s)  # their first heartbeats seen
        spec = JobSpec(name="big", team="scale", priority_class="normal",
                       replicas=ReplicaRange(min=max(1, replicas - SLOTS), max=replicas),
                       command=["true"], hang_timeout_s=max(60.0, 6 * args.big_step_s))
        submitted = time.time()
        await client.submit(spec, JOB, retry_s=60)
        timeout = args.big_timeout_s
        admitted = await wait("admitted", timeout)
        formed = await wait("g0", timeout)
        all_applied = await wait("applied", timeout + 2 * args.big_step_s)
        crash_sent = time.time()
        procs["loadgen"][-1].send_signal(signal.SIGUSR1)
        fault = await wait("fault", timeout)
        fault_generation = await wait("fault generation", timeout)
        full = await wait("full again", timeout + 2 * args.big_step_s)
        sizes = await _sizes(bus, generations)

    def since(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    g0 = generations.get(0, (None, 0.0))[0]
    return {
        "replicas": replicas, "nodes": nodes, "admitted": admitted is not None,
        "world_size_0": None if g0 is None else g0.world_size,
        "submit_to_admitted_s": since(submitted, admitted),
        "admitted_to_generation_0_s": since(admitted, formed),
        "generation_0_to_all_applied_s": since(formed, all_applied),
        "applied_0": len(applied[0]),
        "crash_sent_to_fault_s": since(crash_sent, fault),
        "fault_to_fault_generation_s": since(fault, fault_generation),
        "fault_to_full_strength_s": since(fault, full),
        "faults": [f"{f.kind.value} {f.replica_id}" for f, _ in faults],
        "generations": {n: {"reason": g.reason.value, "world_size": g.world_size}
                        for n, (g, _) in sorted(generations.items())},
        "bytes": sizes,
        "times": {"fault": fault, "fault_number": next(
            (n for n, (g, _) in generations.items() if g.reason is GenerationReason.FAULT),
            None), "numbers": {n: t for n, (_, t) in generations.items()}},
    }


async def _sizes(bus: Bus, generations: dict[int, tuple[Generation, float]]) -> dict[str, Any]:
    """Each generation's encoding, and what the buckets hold for the job."""
    out: dict[str, Any] = {
        "generation": {n: len(encode(g, limit=MAX_SPILLED_BYTES))
                       for n, (g, _) in sorted(generations.items())}}
    if generations:
        g = max(generations.values(), key=lambda gt: gt[0].generation)[0]
        out["per_member"] = round(out["generation"][g.generation] / g.world_size, 1)
    for name, bucket, kind in (("generation_stored", subjects.GENERATIONS_BUCKET, Generation),
                               ("record", subjects.JOBS_BUCKET, JobRecord),
                               ("elasticity_state", subjects.ELASTICITY_BUCKET, JobSnapshot),
                               ("health_state", subjects.HEALTH_BUCKET, JobSnapshot)):
        kv = await TypedKV.open(bus.js, bucket, kind)
        raw = await kv._raw(JOB)
        if raw is None:
            out[name] = None
            continue
        pointer = spill.pointer(raw.data)
        out[name] = {"stored_bytes": len(raw.data),
                     "value_bytes": len(raw.data) if pointer is None else pointer.size,
                     "chunks": 0 if pointer is None else pointer.chunks}
    return out


def _members(times: dict[str, Any], gens: list[dict[str, Any]]) -> dict[str, Any]:
    """When the last member received generation 0 and the fault generation (from the
    generators' own receipts)."""
    last: dict[int, float] = {}
    counts: dict[int, int] = defaultdict(int)
    for g in gens:
        for job, number, _, received in g["received"]:
            if job == JOB:
                last[number] = max(last.get(number, 0.0), received)
                counts[number] += 1
    numbers: dict[int, float] = {int(n): t for n, t in times["numbers"].items()}
    fault_number = times["fault_number"]
    crashes = [c for g in gens for c in g["crashes"]]

    def spread(n: int | None) -> float | None:
        if n is None or n not in last or n not in numbers:
            return None
        return round(float(last[n]) - float(numbers[n]), 3)

    return {"generation_0_to_last_member_s": spread(0),
            "fault_generation_to_last_member_s": spread(fault_number),
            "members_received": {n: counts[n] for n in sorted(counts)},
            "crash_to_fault_s": round(times["fault"] - crashes[0]["at"], 3)
            if crashes and times["fault"] is not None else None,
            "crashes": crashes,
            "step_lag_max_s": max((g["step_lag_max_s"] for g in gens), default=None)}


def section(command: str, r: dict[str, Any]) -> str:
    """The run as a RESULTS.md section."""
    b = r.get("bytes", {})
    usage = r.get("usage", {}).get("cpu_cores", {})
    return "\n".join([
        f"\n## A {r['replicas']:,}-replica job (bench/scale.py --big-job)\n",
        f"`{command}` — {r['date']}\n",
        f"Real nats-server, admission, health and elasticity; {r['nodes']:,} simulated "
        "nodes of 8 slots and their ranks (bench/loadgen.py). CPU in cores over the run "
        f"(2 on this machine): {usage}. Load {r['loadavg_before'][0]} → "
        f"{r['loadavg_after'][0]}.\n",
        "| figure | value |", "|---|---|",
        f"| submit → admitted | {r['submit_to_admitted_s']} s |",
        f"| admitted → generation 0 (world {r['world_size_0']}) | "
        f"{r['admitted_to_generation_0_s']} s |",
        f"| generation 0 → its last member | {r['generation_0_to_last_member_s']} s |",
        f"| generation 0 → every member applied ({r['applied_0']}) | "
        f"{r['generation_0_to_all_applied_s']} s |",
        f"| rank SIGKILLed (its exit reported) → fault | {r['crash_to_fault_s']} s |",
        f"| fault → fault generation | {r['fault_to_fault_generation_s']} s |",
        f"| fault generation → its last member | "
        f"{r['fault_generation_to_last_member_s']} s |",
        f"| fault → back to {r['replicas']:,} (join generation) | "
        f"{r['fault_to_full_strength_s']} s |",
        f"| bytes per generation (per member) | {b.get('generation')} ({b.get('per_member')}) |",
        f"| stored: generation, record, elasticity state, health state | "
        f"{b.get('generation_stored')}, {b.get('record')}, {b.get('elasticity_state')}, "
        f"{b.get('health_state')} |",
        f"| generations | {r['generations']} |",
        f"| faults | {r['faults']} |", ""])
