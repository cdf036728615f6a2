"""GPU nodes: the agent's NVML discovery and health-poll cost, and how fast an injected GPU
fault becomes a rank fault.

* **Discovery.** :func:`phalanx.services.agent.nvml.discover` as the agent calls it at
  start (NVML's start and the description of every GPU), in ms, and what it found. Where
  NVML is absent, what finding that out costs.
* **Poll.** ``--polls`` health polls of every GPU (:meth:`~phalanx.services.agent.nvml.
  GpuWatch.poll`, the agent's code), ms each, and the CPU share the agent spends on them
  at the default interval (``agent.gpu_poll_interval_s``, 1 s). Absent NVML: the poll
  that only looks for injected faults.
* **Fault.** A real agent (a subprocess, NVML discovery on) on a real nats-server runs a
  one-rank job (``sleep``) in slot 0; ``--faults`` times, ``phalanx chaos gpu-fault
  NODE --gpu 0`` (Xid 79, injected at the agent's NVML boundary) and the rank's
  ``RankExited`` (cause ``gpu_fault``) as the bus delivers it here. The latency is from
  the agent's poll seeing the fault (``RankExited.fault_seen_at``, the agent's clock on
  this host) to that delivery; target p99 < 100 ms. After each, ``phalanx node uncordon
  NODE --slot 0`` and a new replica launched in the slot (as elasticity would).
* **Node record.** The agent's node as ``phalanx nodes --json`` shows it while slot 0 is
  cordoned (GPUs, the reason), and the rank's placement: its ``CUDA_VISIBLE_DEVICES``
  and the CPUs it is pinned to.

``--cpu`` says that no GPU is expected: where NVML is absent the run is the same, the
fault naming slot 0 (a CPU slot standing in for a GPU). Without it, a run where NVML is
absent fails rather than report a CPU's figures as a GPU's.

    python bench/gpu_node.py          # on a GPU machine, about a minute
    python bench/gpu_node.py --cpu    # here

Prints one JSON object as its last line and appends its figures to bench/RESULTS.md
naming the device (``--no-record``: not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.schemas import environment, settings

NODE = "gpu-node"
JOB = "gpu-node-bench"


async def cli(*args: str) -> str:
    """``phalanx ARGS`` as an operator runs it; its standard output. The event loop goes on
    meanwhile: what the bus delivers is stamped when it comes, not after the command."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.services.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"phalanx {' '.join(args)} failed: {err.decode().strip()}")
    return out.decode()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def discovery_and_poll(polls: int) -> dict[str, Any]:
    """NVML discovery as the agent does it, then ``polls`` health polls."""
    from phalanx.services.agent.config import AgentConfig
    from phalanx.services.agent.nvml import GpuWatch, discover

    started = time.perf_counter()
    nvml = discover()
    discovery_s = time.perf_counter() - started
    result: dict[str, Any] = {
        "nvml": nvml is not None, "discovery_ms": discovery_s * 1000,
        "gpus": [] if nvml is None else [
            {"index": g.index, "name": g.name, "uuid": g.uuid,
             "memory_gib": g.memory_bytes / 2**30, "pci_bus_id": g.pci_bus_id,
             "numa_node": g.numa_node, "cpus": len(g.cpus)}
            for g in nvml.gpus]}
    watch = GpuWatch(nvml)
    try:
        wall, cpu = [], []
        for _ in range(polls):
            w0, c0 = time.perf_counter(), time.process_time()
            faults = watch.poll()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            if any(f.fatal for f in faults):
                result.setdefault("faults_seen", []).extend(f.what for f in faults)
    finally:
        watch.close()
    interval = AgentConfig(node_id="bench").gpu_poll_interval_s
    result["poll"] = {"polls": polls, "ms_median": statistics.median(wall) * 1000,
                      "ms_p99": percentile(wall, 0.99) * 1000,
                      "cpu_ms_mean": statistics.fmean(cpu) * 1000,
                      "interval_s": interval,
                      "cpu_share_at_interval": statistics.fmean(cpu) / interval}
    return result


async def fault_latency(work: Path, faults: int, cpu: bool) -> dict[str, Any]:
    """``faults`` injected GPU faults on a real agent's slot 0, each to its rank's exit."""
    from phalanx.bus.client import Bus, Delivery
    from phalanx.bus.config import BusConfig
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import (
        ExitCause,
        JobRecord,
        JobSpec,
        JobState,
        LaunchReplica,
        NodeRecord,
        NodeStatusRequest,
        RankExited,
        RankStarted,
        ReasonCode,
        ReplicaRange,
        ReplicaReply,
    )
    from phalanx.services.natsd import NatsServer

    with NatsServer(work / "jetstream", port=0, log_path=work / "nats.log") as server:
        url = server.url
        with (work / "agent.log").open("wb") as agent_log:
            agent = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "phalanx.services.agent", "--node-id", NODE,
                *(["--slots", "1"] if cpu else []), "--heartbeat-interval", "0.1",
                "--nats", url, "--work-dir", str(work / "agent"),
                stdout=agent_log, stderr=agent_log,
                env={**os.environ, settings.AGENT("discover_gpus"): "1"})
        try:
            async with await Bus.connect(BusConfig.load(env={}, servers=[url])) as bus:
                exits: asyncio.Queue[tuple[float, RankExited]] = asyncio.Queue()
                starts: asyncio.Queue[RankStarted] = asyncio.Queue()

                async def on_exit(message: RankExited, _: Delivery) -> None:
                    exits.put_nowait((time.time(), message))

                async def on_start(message: RankStarted, _: Delivery) -> None:
                    starts.put_nowait(message)

                await bus.subscribe(subjects.rank_exited(JOB), RankExited, on_exit)
                await bus.subscribe(subjects.rank_started(JOB), RankStarted, on_start)
                spec = JobSpec(name="gpu-node", team="bench", priority_class="normal",
                               replicas=ReplicaRange(min=1, max=1), command=["sleep", "600"],
                               grace_period_s=1.0)
                jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
                await jobs.put(JOB, JobRecord(
                    job_id=JOB, spec=spec, state=JobState.ADMITTED, submitted_at=time.time(),
                    updated_at=time.time(), reason_code=ReasonCode.ADMITTED, nodes=[NODE]))
                started = await asyncio.wait_for(starts.get(), 60)
                placement = rank_placement(started.pid)
                latencies, reaped, node_row = [], [], None
                where = ("--nats", url)
                for n in range(faults):
                    out = await cli("chaos", "gpu-fault", NODE, "--gpu", "0", *where)
                    received, exited = await asyncio.wait_for(exits.get(), 30)
                    if exited.cause is not ExitCause.GPU_FAULT or exited.fault_seen_at is None:
                        raise RuntimeError(f"the rank ended otherwise: {exited}")
                    latencies.append(received - exited.fault_seen_at)
                    reaped.append(exited.exited_at - exited.fault_seen_at)
                    if node_row is None:
                        chaos_reply = out.strip()
                        detail = exited.detail.splitlines()[0]
                        rows = json.loads(await cli("nodes", "--json", *where))
                        node_row = next(r for r in rows if r["node_id"] == NODE)
                    await cli("node", "uncordon", NODE, "--slot", "0", *where)
                    await until_uncordoned(bus, NodeStatusRequest, NodeRecord)
                    reply = await bus.request(subjects.agent_launch(NODE), LaunchReplica(
                        job_id=JOB, slot=0, replica_id=f"r0-{n + 1}"), ReplicaReply,
                        timeout_s=30)
                    if reply.pid is None:
                        raise RuntimeError(f"no new replica in slot 0: {reply.detail}")
                    await asyncio.wait_for(starts.get(), 60)
                await jobs.delete(JOB)
        finally:
            agent.terminate()  # stops its rank too
            async with asyncio.timeout(30):
                await agent.wait()
    return {"faults": faults, "fault_to_exit_delivered_ms": {
                "p50": percentile(latencies, 0.5) * 1000,
                "p99": percentile(latencies, 0.99) * 1000, "max": max(latencies) * 1000,
                "each": [round(x * 1000, 2) for x in latencies]},
            "fault_to_rank_reaped_ms": [round(x * 1000, 2) for x in reaped],
            "fault_to_rank_reaped_ms_p50": percentile(reaped, 0.5) * 1000,
            "target_p99_under_100_ms": percentile(latencies, 0.99) < 0.1,
            "chaos_reply": chaos_reply, "exit_detail": detail, "node": node_row,
            "rank": placement}


async def until_uncordoned(bus: Any, request: type, record: type) -> None:
    """Until the agent's own record (its answer to a status request) has slot 0 back."""
    from phalanx.schemas import subjects

    while True:
        now = await bus.request(subjects.agent_status(NODE), request(), record, timeout_s=10)
        if 0 not in now.cordoned_slots:
            return
        await asyncio.sleep(0.05)


def rank_placement(pid: int) -> dict[str, Any]:
    """What the agent gave a rank: its GPU(s) and the CPUs it may run on."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode(errors="replace").partition("=")[::2] for item in environ if item)
    return {"cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
            "phalanx_device": env.get(environment.DEVICE),
            "cpus_allowed": len(os.sched_getaffinity(pid)), "cpus_of_agent": os.cpu_count()}


def device_name(cpu: bool) -> str:
    if cpu:
        return f"CPU ({os.cpu_count()} cores), no GPU"
    try:
        names = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except OSError:
        names = "nvidia-smi not found"
    return names.replace("\n", "; ")


def results_section(report: dict[str, Any]) -> str:
    poll, fault = report["poll"], report["fault"]
    latency = fault["fault_to_exit_delivered_ms"]
    rows = [
        ("NVML", "present" if report["nvml"] else "absent (CPU slots, exactly as before)"),
        ("discovery", f"{report['discovery_ms']:.1f} ms, {len(report['gpus'])} GPU(s)"),
        ("health poll" if report["nvml"] else
         "poll without NVML (no poll loop runs; an injection's poll)",
         f"{poll['ms_median']:.3f} ms median ({poll['ms_p99']:.3f} ms p99), "
         f"{poll['cpu_share_at_interval'] * 100:.4f} % of a core at {poll['interval_s']:g} s"),
        ("injected fault → RankExited delivered",
         f"p50 {latency['p50']:.1f} ms, p99 {latency['p99']:.1f} ms, max "
         f"{latency['max']:.1f} ms over {fault['faults']} (target p99 < 100 ms: "
         f"{'met' if fault['target_p99_under_100_ms'] else 'missed'})"),
        ("of which fault → rank reaped", f"p50 {fault['fault_to_rank_reaped_ms_p50']:.1f} ms"),
        ("rank's placement", json.dumps(fault["rank"])),
    ]
    lines = [f"\n## gpu_node.py — {report['date']}\n", f"Command: `{report['command']}`\n",
             f"Device: {report['device']}.\n"]
    if not report["nvml"]:
        lines.append("No GPU and no NVML here: discovery and the poll are the absent path's, "
                     "and the faults were injected at the agent's NVML boundary on slot 0 (a "
                     "CPU slot standing in for a GPU). Not yet run on a GPU.\n")
    lines.append("| figure | value |\n|---|---|\n" + "\n".join(
        f"| {name} | {value} |" for name, value in rows) + "\n")
    lines.append(f"The node as `phalanx nodes --json` shows it: `{json.dumps(fault['node'])}`\n")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="no GPU here: NVML's absence is expected, slot 0 stands in")
    parser.add_argument("--polls", type=int, default=200, help="health polls timed")
    parser.add_argument("--faults", type=int, default=20, help="GPU faults injected")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    from phalanx.bench.results import append, utc_date

    report: dict[str, Any] = {"date": utc_date(), "command": " ".join(
        ["python", "bench/gpu_node.py", *sys.argv[1:]]), "device": device_name(args.cpu)}
    report |= discovery_and_poll(args.polls)
    if not report["nvml"] and not args.cpu:
        print(json.dumps({**report, "error": "NVML is absent here: run with --cpu"}))
        return 1
    print(json.dumps({k: report[k] for k in ("nvml", "discovery_ms", "gpus", "poll")}),
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report["fault"] = asyncio.run(fault_latency(Path(tmp), args.faults, args.cpu))
    if not args.no_record:
        append(results_section(report))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
