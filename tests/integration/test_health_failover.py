"""Health as two real processes on a real nats-server: the leader is SIGKILLed, a rank dies
while no instance leads, and the standby reports it, naming the replica; a restart of the
server on the same store makes nobody lost.

No agents and no torch: the test plays the agents and ranks by publishing their messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    ExitCause,
    Fault,
    FaultKind,
    JobRecord,
    JobSpec,
    JobState,
    Lease,
    NodeConditionChanged,
    NodeHeartbeat,
    RankExited,
    RankProgress,
    RankStarted,
    ReasonCode,
    ReplicaRange,
)
from phalanx.services.natsd import NatsServer
from phalanx.services.ports import free_port

JOB = "hf-1"
NODES = ["n0", "n0", "n1", "n1"]



def start(url: str, name: str, log_dir: Path) -> subprocess.Popen:
    log = (log_dir / f"{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx.services.health", "--instance", name],
        env={**os.environ, "PHALANX_NATS_URL": url, "PHALANX_HEALTH_LEASE_S": "1"},
        stdout=log, stderr=log)


class Cluster:
    """Plays two agents (heartbeats) and four ranks (progress) until stopped."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.faults: asyncio.Queue[Fault] = asyncio.Queue()
        self.conditions: list[NodeConditionChanged] = []
        self.alive = set(range(len(NODES)))
        self.step = 0

    async def beat(self) -> None:
        seq = 0
        while True:
            seq += 1
            for node in sorted(set(NODES)):
                await self.bus.publish(subjects.node_heartbeat(node), NodeHeartbeat(
                    node_id=node, seq=seq, sent_at=time.time()))
            self.step += 1
            for rank in sorted(self.alive):
                await self.bus.publish(subjects.health_rank(JOB, rank), RankProgress(
                    job_id=JOB, rank=rank, replica_id=f"r{rank}-0", generation=0,
                    step=self.step, step_time_s=0.1, sent_at=time.time()))
            await asyncio.sleep(0.1)


async def leader(bus: Bus, not_: str | None = None) -> str:
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    async for change in leases.watch():
        lease = None if change is None else change.value
        if lease is not None and lease.expires_at > time.time() and lease.holder != not_:
            return lease.holder
    raise AssertionError("the lease watch ended")


async def answering(bus: Bus, count: int) -> None:
    """Until ``count`` health instances answer the service PING: each has its SIGTERM
    handler by then, so stopping it is graceful (a standby still starting when a short
    test ended died of the signal: exit -15)."""
    seen: set[str] = set()
    answered = asyncio.Event()

    async def on_reply(msg) -> None:
        seen.add(json.loads(msg.data)["id"])
        answered.set()

    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox, cb=on_reply)
    try:
        while len(seen) < count:
            answered.clear()
            await bus.nc.publish("$SRV.PING.phalanx-health", b"", reply=inbox)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(answered.wait(), 0.5)
    finally:
        await sub.unsubscribe()


@contextlib.asynccontextmanager
async def running(url: str, tmp_path: Path) -> AsyncIterator[tuple[Bus, Cluster, dict]]:
    bus = await Bus.connect(BusConfig.load(env={}, servers=[url]))
    cluster = Cluster(bus)

    async def on_fault(fault: Fault, _: Delivery) -> None:
        await cluster.faults.put(fault)

    async def on_condition(msg: NodeConditionChanged, _: Delivery) -> None:
        cluster.conditions.append(msg)

    await bus.subscribe(subjects.job_fault(JOB), Fault, on_fault)
    await bus.subscribe(subjects.node_conditions(), NodeConditionChanged,
                        on_condition)
    instances = {name: start(url, name, tmp_path) for name in ("h1", "h2")}
    beats = asyncio.create_task(cluster.beat())
    try:
        await asyncio.wait_for(leader(bus), 30)
        await asyncio.wait_for(answering(bus, len(instances)), 30)
        jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
        await jobs.put(JOB, JobRecord(
            job_id=JOB, spec=JobSpec(name="hf", team="t", priority_class="normal",
                                     replicas=ReplicaRange(min=2, max=4), command=["true"],
                                     hang_timeout_s=1.0),
            state=JobState.ADMITTED, submitted_at=1.0, updated_at=1.0,
            reason_code=ReasonCode.ADMITTED, nodes=NODES))
        yield bus, cluster, instances
    finally:
        beats.cancel()
        alive = [p for p in instances.values() if p.poll() is None]
        for proc in alive:
            proc.send_signal(signal.SIGTERM)
        for proc in alive:
            assert proc.wait(20) == 0
        await bus.close()


async def test_a_standby_reports_a_crash_that_happened_while_no_leader_ran(
        tmp_path: Path) -> None:
    with NatsServer(tmp_path / "js", port=0) as server:
        async with running(server.url, tmp_path) as (bus, cluster, instances):
            first = await leader(bus)
            # The agent on n0 replaces slot 1's replica, then the new one reports progress.
            await bus.publish_event(subjects.rank_started(JOB), RankStarted(
                job_id=JOB, rank=1, world_size=4, node_id="n0", pid=4242, started_at=1.0,
                replica_id="r1-1"), event_id="start-r1-1")
            await asyncio.sleep(0.5)
            assert cluster.faults.empty()
            instances[first].send_signal(signal.SIGKILL)
            instances[first].wait()
            cluster.alive.discard(1)
            await bus.publish_event(subjects.rank_exited(JOB), RankExited(
                job_id=JOB, rank=1, node_id="n0", pid=4242, cause=ExitCause.EXITED,
                exited_at=2.0, signal="SIGKILL", replica_id="r1-1"), event_id="exit-r1-1")
            await asyncio.wait_for(leader(bus, not_=first), 30)
            fault = await asyncio.wait_for(cluster.faults.get(), 30)
            assert (fault.kind, fault.rank, fault.replica_id) == (FaultKind.CRASH, 1, "r1-1")
            # The ranks that keep reporting are not judged hung by the new leader.
            await asyncio.sleep(2.5)
            assert cluster.faults.empty()
            assert cluster.conditions == []


async def test_a_bus_restart_makes_no_node_or_rank_lost(tmp_path: Path) -> None:
    port = free_port()
    server = NatsServer(tmp_path / "js", port=port).start()
    try:
        async with running(server.url, tmp_path) as (_, cluster, _):
            await asyncio.sleep(1.5)  # watched, heard from, judged
            server.process.kill()
            server.process.wait()
            await asyncio.sleep(4.0)  # longer than the node timeout (3 s) and hang timeout
            server = NatsServer(tmp_path / "js", port=port).start()
            await asyncio.sleep(4.0)  # everyone reconnects and reports again
            assert cluster.faults.empty(), cluster.faults.get_nowait()
            assert [c.condition for c in cluster.conditions] == []
            # Still judging: a rank that stops reporting now is a hang.
            cluster.alive.discard(3)
            fault = await asyncio.wait_for(cluster.faults.get(), 10)
            assert (fault.kind, fault.rank, fault.replica_id) == (FaultKind.HANG, 3, "r3-0")
    finally:
        server.stop()


async def test_rank_events_that_overtake_their_jobs_record_are_not_lost(tmp_path: Path) -> None:
    """A job's record (the leader's watch of the jobs bucket) and its ranks' events (the
    stream) come through two consumers, so a rank can start and die before the watch
    brings its job. The leader reads such a job's record ahead of the event: every one
    of these crashes is reported as one, naming its replica. (An event of a job not yet
    watched was dropped and counted as handled: the crash was never reported.)"""
    with NatsServer(tmp_path / "js", port=0) as server:
        async with running(server.url, tmp_path) as (bus, _, _):
            await leader(bus)
            faults: asyncio.Queue[Fault] = asyncio.Queue()

            async def on_fault(fault: Fault, _: Delivery) -> None:
                await faults.put(fault)

            await bus.subscribe(subjects.job_events("fault"), Fault, on_fault)
            records = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
            jobs = [f"overtaken-{i}" for i in range(20)]
            for job in jobs:
                await records.put(job, JobRecord(
                    job_id=job, spec=JobSpec(name="ov", team="t", priority_class="normal",
                                             replicas=ReplicaRange(min=1, max=1),
                                             command=["true"], hang_timeout_s=600.0),
                    state=JobState.ADMITTED, submitted_at=1.0, updated_at=1.0,
                    reason_code=ReasonCode.ADMITTED, nodes=["n0"]))
                await bus.publish_event(subjects.rank_started(job), RankStarted(
                    job_id=job, rank=0, world_size=1, node_id="n0", pid=7, started_at=1.0,
                    replica_id="r0-1"), event_id=f"start-{job}")
                await bus.publish_event(subjects.rank_exited(job), RankExited(
                    job_id=job, rank=0, node_id="n0", pid=7, cause=ExitCause.EXITED,
                    exited_at=2.0, signal="SIGKILL", replica_id="r0-1"), event_id=f"exit-{job}")
            reported: dict[str, tuple[FaultKind, str | None]] = {}
            while len(reported) < len(jobs):
                try:
                    fault = await asyncio.wait_for(faults.get(), 20)
                except TimeoutError:
                    raise AssertionError(f"crashes never reported: "
                                         f"{sorted(set(jobs) - set(reported))}") from None
                reported[fault.job_id] = (fault.kind, fault.replica_id)
            assert reported == {job: (FaultKind.CRASH, "r0-1") for job in jobs}
