"""An agent launches each replica at most once, across its own restarts and the bus's.

Real agents (a subprocess, or in-process where the test needs its bus to go away),
a real nats-server and real rank processes: a shell that exits at once in slot 1
(a replica that died) and sleeps in slot 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import msgspec
import pytest
from restartable_nats import RestartableNats

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RemoteError
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    JobRecord,
    JobSpec,
    JobState,
    LaunchReplica,
    NodeHeartbeat,
    RankExited,
    RankStarted,
    ReasonCode,
    ReplicaRange,
    ReplicaReply,
)
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService
from phalanx.services.natsd import NatsServer

RANK = 'test "$PHALANX_RANK" = 1 && exit 3; exec sleep 600'  # the slot, in any world
#: A rank that runs until it is stopped.
SLEEPS = [sys.executable, "-c", "import time; time.sleep(600)"]


def admitted(job_id: str, node_id: str, command: list[str] | None = None) -> JobRecord:
    """Job ``job_id`` admitted with two replicas on ``node_id`` (grace period 2 s), each
    running ``command`` (default: slot 1's dies at once, slot 0's sleeps)."""
    spec = JobSpec(name="replicas", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=2, max=2), grace_period_s=2.0,
                   command=command or ["sh", "-c", RANK])
    return JobRecord(job_id=job_id, spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                     updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=[node_id, node_id])


async def queue_of(bus: Bus, subject: str, message_type: type) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()

    async def put(message, _: Delivery) -> None:
        await queue.put(message)

    await bus.subscribe(subject, message_type, put)
    return queue


async def process_exit(pid: int) -> None:
    """Return when process ``pid`` has exited (its pidfd turns readable)."""
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    fd = os.pidfd_open(pid)
    loop.add_reader(fd, lambda: gone.done() or gone.set_result(None))
    try:
        await gone
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def test_a_replica_is_launched_at_most_once_even_after_an_agent_restart(
        bus: Bus, nats_server: NatsServer, uid: str, tmp_path: Path) -> None:
    """Slot 1's replica dies; repeated launch requests never start it again, before or
    after the agent is SIGKILLed and restarted, and an older incarnation is refused.
    (A restarted agent used to launch ``r1-0`` again: only running ranks were kept.)"""
    job_id = f"once-{uid}"
    started = await queue_of(bus, subjects.rank_started(job_id), RankStarted)
    exited = await queue_of(bus, subjects.rank_exited(job_id), RankExited)
    beats = await queue_of(bus, subjects.node_heartbeat(uid), NodeHeartbeat)

    def agent() -> asyncio.Future:
        return asyncio.create_subprocess_exec(
            sys.executable, "-m", "phalanx.services.agent", "--node-id", uid, "--slots", "2",
            "--heartbeat-interval", "0.1", "--nats", nats_server.url,
            "--work-dir", str(tmp_path / "agent"),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)

    async def launch(replica_id: str, slot: int = 1) -> ReplicaReply:
        return await bus.request(subjects.agent_launch(uid), LaunchReplica(
            job_id=job_id, slot=slot, replica_id=replica_id), ReplicaReply, timeout_s=10)

    async def next_start() -> RankStarted:
        return await asyncio.wait_for(started.get(), 30)

    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    await jobs.put(job_id, admitted(job_id, uid))
    first = await agent()
    second = None
    try:
        firsts = {s.replica_id: s for s in [await next_start(), await next_start()]}
        assert sorted(firsts) == ["r0-0", "r1-0"]
        died = await asyncio.wait_for(exited.get(), 30)
        assert (died.replica_id, died.exit_code) == ("r1-0", 3)

        # Re-sent after it died: not started again.
        again = await launch("r1-0")
        assert again.pid is None and "already launched r1-0 in slot 1" in again.detail
        replacement = await launch("r1-1")
        assert replacement.pid is not None and replacement.detail.startswith("started r1-1")
        assert (await next_start()).replica_id == "r1-1"
        assert (await asyncio.wait_for(exited.get(), 30)).replica_id == "r1-1"

        first.send_signal(signal.SIGKILL)
        await first.wait()
        while not beats.empty():
            beats.get_nowait()
        second = await agent()
        await asyncio.wait_for(beats.get(), 30)  # registered, synced, serving launches

        assert (await launch("r1-1")).pid is None  # launched by its predecessor
        with pytest.raises(RemoteError) as older:
            await launch("r1-0")
        assert older.value.code == "409" and "older than r1-1" in older.value.description
        adopted = await launch("r0-0", slot=0)
        assert adopted.pid == firsts["r0-0"].pid and "already launched" in adopted.detail
        newer = await launch("r1-2")
        # The first start since the restart is the one asked for: r1-0 was not relaunched.
        start = await next_start()
        assert (start.replica_id, start.pid) == ("r1-2", newer.pid)
    finally:
        for proc in (first, second):
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGTERM)  # stops its ranks (adopted ones too)
                await proc.wait()
        await jobs.delete(job_id)


async def test_job_records_missed_while_disconnected_are_read_after_the_reconnection(
        restartable_nats: RestartableNats, tmp_path: Path) -> None:
    """The agent follows job records through plain publishes; a record changed without
    one reaching it (as while it is disconnected) is applied after its next reconnection."""
    config = BusConfig.load(env={}, servers=[restartable_nats.url], connect_timeout_s=5.0)
    agent = AgentService(AgentConfig(node_id="resync", slots=2, heartbeat_interval_s=0.2,
                                     work_dir=str(tmp_path / "agent")), config)
    async with await Bus.connect(config, name="test") as bus:
        started = await queue_of(bus, subjects.rank_started("rs-1"), RankStarted)
        jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
        record = admitted("rs-1", "resync")
        await jobs.put("rs-1", record)
        await agent.start()
        try:
            pids = {s.replica_id: s.pid for s in [await asyncio.wait_for(started.get(), 30)
                                                  for _ in range(2)]}
            # Cancelled with no publish: the agent cannot know until it reads the bucket.
            await jobs.put("rs-1", msgspec.structs.replace(record, state=JobState.CANCELLED,
                                                           nodes=[]))
            assert agent.ranks is not None and ("rs-1", 0) in agent.ranks.ranks
            restartable_nats.kill()
            restartable_nats.start()
            await asyncio.wait_for(process_exit(pids["r0-0"]), 30)
        finally:
            await agent.stop()
