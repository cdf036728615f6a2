"""``phalanx chaos kill-rank JOB R`` reaches the node that runs slot R.

Slots keep their numbers when a placement shrinks and grows, so slot R is not the
R-th entry of the record's ``nodes`` (the CLI used to pick the node by list position).
Real agents run real rank processes over a real server; the CLI runs as a process.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    JobRecord,
    JobSpec,
    JobState,
    RankExited,
    RankStarted,
    ReasonCode,
    ReplicaRange,
)
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService
from phalanx.services.natsd import NatsServer


async def chaos(url: str, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.services.cli", "chaos", *args, "--nats", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_kill_rank_finds_the_node_of_a_renumbered_slot(
        bus: Bus, bus_config: BusConfig, nats_server: NatsServer, uid: str,
        tmp_path: Path) -> None:
    job_id, node_a, node_b = f"chaos-{uid}", f"a-{uid}", f"b-{uid}"
    started: asyncio.Queue[RankStarted] = asyncio.Queue()
    exited: asyncio.Queue[RankExited] = asyncio.Queue()

    async def on_started(message: RankStarted, _: Delivery) -> None:
        await started.put(message)

    async def on_exited(message: RankExited, _: Delivery) -> None:
        await exited.put(message)

    await bus.subscribe(subjects.rank_started(job_id), RankStarted, on_started)
    await bus.subscribe(subjects.rank_exited(job_id), RankExited, on_exited)
    agents = [AgentService(AgentConfig(node_id=node, slots=1, heartbeat_interval_s=0.2,
                                       work_dir=str(tmp_path / node)), bus_config)
              for node in (node_a, node_b)]
    spec = JobSpec(name="chaos", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=2, max=2), grace_period_s=1.0,
                   command=["sleep", "600"])
    # Slot 0 is on node b, listed second; slot 2 on node a, listed first (slot 1 is gone).
    record = JobRecord(job_id=job_id, spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                       updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=[node_a, node_b],
                       slots=[2, 0], next_slot=3)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    await jobs.put(job_id, record)
    for agent in agents:
        await agent.start()
    try:
        ranks = {s.rank: s for s in [await asyncio.wait_for(started.get(), 30)
                                     for _ in range(2)]}
        assert {r: s.node_id for r, s in ranks.items()} == {0: node_b, 2: node_a}

        code, out = await chaos(nats_server.url, "kill-rank", job_id, "0")
        assert code == 0 and out.startswith(f"{node_b}: sent SIGKILL to rank 0"), out
        killed = await asyncio.wait_for(exited.get(), 30)
        assert (killed.rank, killed.node_id, killed.pid, killed.signal) == (
            0, node_b, ranks[0].pid, "SIGKILL")

        code, out = await chaos(nats_server.url, "kill-rank", job_id, "2", "--signal", "TERM")
        assert code == 0 and out.startswith(f"{node_a}: sent SIGTERM to rank 2"), out
        killed = await asyncio.wait_for(exited.get(), 30)
        assert (killed.rank, killed.node_id, killed.signal) == (2, node_a, "SIGTERM")

        code, out = await chaos(nats_server.url, "kill-rank", job_id, "1")
        assert code != 0 and f"{job_id!r} has no running rank 1" in out, out
    finally:
        for agent in agents:
            await agent.stop()
        await jobs.delete(job_id)
