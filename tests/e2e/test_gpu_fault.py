"""A GPU fault end to end, on CPU slots: the flow from the agent's NVML boundary through
health and elasticity to a cordoned slot, and the operator's uncordon.

``phalanx up`` with two agents of 3 slots (no NVML here: CPU slots, exactly as
before); ``examples/train_mlp.py`` as an elastic job of 2 replicas, placed on one
node (best fit). ``phalanx chaos gpu-fault NODE --gpu 0`` injects an Xid 79 at that
agent's NVML boundary (slot 0 stands in for a GPU): the agent cordons slot 0 and
SIGKILLs the rank there (cause ``gpu_fault``, the detail naming the fault), health
faults it, elasticity recovers the job in process on the survivor and launches a
replacement, which must land on a usable slot (2, not 0); the job finishes. ``phalanx
nodes --json`` and ``phalanx job`` show the reason. Five usable slots then cannot
take a 6-replica job; ``phalanx node uncordon NODE --slot 0`` gives the sixth back,
and the job's ranks start on every slot, slot 0 included.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from e2e_cli import next_of, phalanx
from test_elastic import (  # the e2e helpers of the elastic tests: same cluster, same job
    ARGS,
    SCRIPT,
    progressed,
    watched_cluster,
)

from phalanx.bus.client import Delivery
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    ExitCause,
    GenerationReason,
    JobSpec,
    JobState,
    Placement,
    RankExited,
    RankStarted,
    ReasonCode,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient
from phalanx.services.manifest import running_in_manifest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REASON = "Xid 79 on slot 0 (a CPU slot: no GPU seen here), injected by phalanx chaos"


@pytest.mark.timeout(240)
async def test_a_gpu_fault_cordons_its_slot_and_the_job_recovers_on_the_others(
        data_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    where = ("--data-dir", str(data))
    async with watched_cluster(data, "--slots-per-agent", "3") as (_, bus, watch):
        exits: asyncio.Queue[RankExited] = asyncio.Queue()
        starts: asyncio.Queue[RankStarted] = asyncio.Queue()

        async def put(queue: asyncio.Queue, message: object, _: Delivery) -> None:
            await queue.put(message)

        await bus.subscribe(subjects.job_events("exited"), RankExited,
                            lambda m, d: put(exits, m, d))
        await bus.subscribe(subjects.job_events("started"), RankStarted,
                            lambda m, d: put(starts, m, d))
        release = tmp_path / "release"
        spec = JobSpec(name="gpu", team="t", priority_class="normal",
                       replicas=ReplicaRange(min=1, max=2), placement=Placement(),
                       command=[sys.executable, str(SCRIPT), "--data-dir", str(data_dir),
                                *ARGS, "--steps", "600"],
                       # Paced until released: the replacement joins while it trains.
                       env={"PHALANX_CHAOS_PACE": f"0.05:{release}"},
                       hang_timeout_s=5.0, grace_period_s=3.0)
        job = await AdmissionClient(bus).submit(spec, "gpu-1")
        first = await next_of(watch.generations, lambda g: g.job_id == job.job_id, 120)
        assert first.world_size == 2
        record = await AdmissionClient(bus).job(job.job_id)
        assert record is not None
        node = record.placement()[0]  # rank 0's node; its replica r0-0 holds slot 0 there
        await progressed(watch, job.job_id, 5)

        out = phalanx("chaos", "gpu-fault", node, "--gpu", "0", *where).stdout
        assert f"{REASON}: slot(s) 0 cordoned, killed rank 0 of {job.job_id}" in out, out
        exited = await next_of(exits, lambda e: e.job_id == job.job_id)
        assert (exited.replica_id, exited.cause, exited.signal) == (
            "r0-0", ExitCause.GPU_FAULT, "SIGKILL")
        assert exited.detail.splitlines()[0] == REASON
        assert exited.fault_seen_at is not None and exited.exited_at >= exited.fault_seen_at
        nodes = {n["node_id"]: n for n in json.loads(phalanx("nodes", "--json", *where).stdout)}
        assert nodes[node]["cordoned_slots"] == {"0": REASON} and not nodes[node]["cordoned"]
        assert [n["cordoned_slots"] for n in nodes.values() if n["node_id"] != node] == [{}]

        # Recovered in process on the survivor, then the replacement joins.
        fault = await next_of(watch.generations, lambda g: g.job_id == job.job_id
                              and g.reason is GenerationReason.FAULT, 60)
        assert [m.replica_id for m in fault.members] == ["r1-0"] and REASON in fault.cause
        joined = await next_of(watch.generations, lambda g: g.job_id == job.job_id
                               and g.reason is GenerationReason.JOIN, 120)
        assert {m.replica_id for m in joined.members} == {"r1-0", "r0-1"}
        ranks = {r["replica_id"]: r for r in running_in_manifest(
            data / "agents" / node / "ranks.json") if r["job_id"] == job.job_id}
        assert ranks["r0-1"]["node_slots"] == [2], ranks  # not the cordoned slot 0
        release.touch()
        end = await next_of(watch.states, lambda r: r.job_id == job.job_id
                            and r.state.terminal, 120)
        assert end.state is JobState.FINISHED, end.reason
        shown = phalanx("job", job.job_id, *where).stdout
        assert f"rank 0 was killed by its agent on {node}: GPU fault: {REASON}" in shown, shown

        # Five usable slots: a 6-replica job waits; the uncordon gives the sixth back.
        wide = JobSpec(name="wide", team="t", priority_class="normal",
                       replicas=ReplicaRange(min=6, max=6),
                       command=[sys.executable, str(EXAMPLES / "progress_loop.py"),
                                "--steps", "1000000"], grace_period_s=1.0)
        waiting = await AdmissionClient(bus).submit(wide, "wide-1")
        why = await next_of(watch.states, lambda r: r.job_id == waiting.job_id
                            and r.reason_code is not ReasonCode.QUEUED, 30)
        assert why.reason_code is ReasonCode.UNSCHEDULABLE, why
        assert "offer 5 slots in all" in why.reason, why.reason
        out = phalanx("node", "uncordon", node, "--slot", "0", *where).stdout
        assert out.strip() == f"{node} slot 0: uncordoned"
        started = {(s.node_id, s.rank) for s in [
            await next_of(starts, lambda s: s.job_id == waiting.job_id, 60) for _ in range(6)]}
        assert len(started) == 6
        used = [r["node_slots"] for r in running_in_manifest(data / "agents" / node
                                                              / "ranks.json")
                if r["job_id"] == waiting.job_id]
        assert sorted(used) == [[0], [1], [2]]
        nodes = {n["node_id"]: n for n in json.loads(phalanx("nodes", "--json", *where).stdout)}
        assert nodes[node]["cordoned_slots"] == {}
        await AdmissionClient(bus).cancel(waiting.job_id)
