"""A container's process layout, reproduced: ``phalanx agent --supervised`` as the first
process, the agent its child, the ranks the agent's. The agent SIGKILLed, the ranks go
on, reparented to the supervisor; the agent comes back in place and adopts them; a rank
that then dies is reaped (no zombie) and reported by the new agent; SIGTERM ends it all."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from test_agent_replicas import queue_of

from phalanx.bus.client import Bus
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    JobRecord,
    JobSpec,
    JobState,
    NodeHeartbeat,
    RankExited,
    RankStarted,
    ReasonCode,
    ReplicaRange,
)
from phalanx.services.manifest import start_ticks
from phalanx.services.natsd import NatsServer


def children(pid: int) -> set[int]:
    return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])


async def until(check, timeout_s: float = 30.0):
    """``check()`` once it is true (a /proc scan: there is nothing to subscribe to)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (found := check()):
        if loop.time() > deadline:
            raise TimeoutError(f"not within {timeout_s} s")
        await asyncio.sleep(0.05)
    return found


async def test_ranks_outlive_their_agent_under_the_supervisor_and_are_adopted(
        bus: Bus, nats_server: NatsServer, uid: str, tmp_path: Path) -> None:
    job_id = f"supervised-{uid}"
    started = await queue_of(bus, subjects.rank_started(job_id), RankStarted)
    exited = await queue_of(bus, subjects.rank_exited(job_id), RankExited)
    beats = await queue_of(bus, subjects.node_heartbeat(uid), NodeHeartbeat)
    spec = JobSpec(name="supervised", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=2, max=2), grace_period_s=2.0,
                   command=[sys.executable, "-c", "import time; time.sleep(600)"])
    record = JobRecord(job_id=job_id, spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                       updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=[uid, uid])
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    await jobs.put(job_id, record)
    supervisor = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.services.cli", "agent", "--supervised",
        "--node-id", uid, "--slots", "2", "--heartbeat-interval", "0.1",
        "--nats", nats_server.url, "--work-dir", str(tmp_path / "agent"),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        ranks = {(await asyncio.wait_for(started.get(), 60)).pid for _ in range(2)}
        (agent,) = children(supervisor.pid)
        assert {parent(pid) for pid in ranks} == {agent}  # the container's layout

        os.kill(agent, signal.SIGKILL)
        # The ranks go on, reparented to the supervisor (a subreaper), and the agent is
        # started again in place.
        await until(lambda: {parent(pid) for pid in ranks} == {supervisor.pid})
        (successor,) = await until(lambda: children(supervisor.pid) - ranks - {agent})
        assert all(start_ticks(pid) is not None for pid in ranks)
        while not beats.empty():
            beats.get_nowait()
        await asyncio.wait_for(beats.get(), 30)  # the successor is up, its ranks adopted
        assert started.empty()  # adopted, not started again

        # A rank dying now is reaped by the supervisor and reported by the successor.
        victim = min(ranks)
        os.kill(victim, signal.SIGKILL)
        report = await asyncio.wait_for(exited.get(), 30)
        assert report.pid == victim
        await until(lambda: start_ticks(victim) is None)  # no zombie left behind

        # SIGTERM, as a container stop sends it: passed to the agent, which stops the
        # other rank; the supervisor exits with the agent's status.
        supervisor.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(supervisor.wait(), 60) == 0
        (other,) = ranks - {victim}
        assert start_ticks(other) is None and start_ticks(successor) is None
    finally:
        if supervisor.returncode is None:
            supervisor.kill()
            await supervisor.wait()
        await jobs.delete(job_id)
