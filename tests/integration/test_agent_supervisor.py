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

from proc_tree import children, parent, until
from test_agent_replicas import SLEEPS, admitted, queue_of

from phalanx.bus.client import Bus
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    JobRecord,
    NodeHeartbeat,
    RankExited,
    RankStarted,
)
from phalanx.services.manifest import start_ticks
from phalanx.services.natsd import NatsServer


async def test_ranks_outlive_their_agent_under_the_supervisor_and_are_adopted(
        bus: Bus, nats_server: NatsServer, uid: str, tmp_path: Path) -> None:
    job_id = f"supervised-{uid}"
    started = await queue_of(bus, subjects.rank_started(job_id), RankStarted)
    exited = await queue_of(bus, subjects.rank_exited(job_id), RankExited)
    beats = await queue_of(bus, subjects.node_heartbeat(uid), NodeHeartbeat)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    await jobs.put(job_id, admitted(job_id, uid, SLEEPS))
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
