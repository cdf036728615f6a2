"""A nats-server restart changes no job: admission judges no node lost on the silence its
own disconnection caused.

Real parts, no torch: a restartable nats-server with a JetStream store, two admission
instances (one leads), two agent processes whose ranks sleep, and one admitted job.
The server is SIGKILLed and started again 3 s later on the same port and store — longer
than admission's node timeout (2 s), shorter than its lease (5 s). Before the fix, the
registry entries' old heartbeats made admission requeue the job the moment it reconnected.
The timeout is admission's grace after its reconnection too, in which each agent must
reconnect and write a heartbeat: at 1 s an agent starved of CPU by the rest of the suite
(three test processes on two cores) once missed it, and its node was judged lost.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from restartable_nats import RestartableNats

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.bus.tasks import within
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    JobRecord,
    JobSpec,
    JobState,
    Lease,
    NodeHeartbeat,
    ReplicaRange,
)
from phalanx.services.admission.config import AdmissionConfig
from phalanx.services.admission.service import AdmissionService
from phalanx.services.admission.store import LedgerStore
from phalanx.services.client import AdmissionClient
from phalanx.services.natsd import NatsServer

LOST_AFTER_S = 2.0
OUTAGE_S = 3.0
NODES = ("n0", "n1")


@pytest.mark.parametrize("lease_s", [5.0, 1.0], ids=["outage-within-the-lease",
                                                     "outage-beyond-the-lease"])
async def test_a_bus_restart_leaves_an_admitted_job_alone(restartable_nats: RestartableNats,
                                                          tmp_path: Path, lease_s: float) -> None:
    """Within the lease the leader keeps leading; beyond it the lease runs out during the
    outage and a new term (this instance's or the standby's) rebuilds from KV: either
    way nothing about the job changes."""
    config = BusConfig.load(env={}, servers=[restartable_nats.url], connect_timeout_s=5.0)
    agents = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.services.agent", "--node-id", node, "--slots", "2",
        "--heartbeat-interval", "0.2", "--nats", restartable_nats.url,
        "--work-dir", str(tmp_path / node),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        for node in NODES]
    admissions = [AdmissionService(AdmissionConfig(lease_s=lease_s, lost_after_s=LOST_AFTER_S),
                                   config, instance=name) for name in ("a0", "a1")]
    async with await Bus.connect(config, name="test") as bus:
        states: list[JobRecord] = []
        beats: asyncio.Queue[NodeHeartbeat] = asyncio.Queue()

        async def on_state(record: JobRecord, _: Delivery) -> None:
            states.append(record)

        async def on_beat(beat: NodeHeartbeat, _: Delivery) -> None:
            await beats.put(beat)

        async def every_node_beats_after(t: float) -> None:
            heard: set[str] = set()
            while heard != set(NODES):
                beat = await beats.get()
                if beat.sent_at > t:
                    heard.add(beat.node_id)

        await bus.subscribe(subjects.job_states(), JobRecord, on_state)
        await bus.subscribe(subjects.node_heartbeats(), NodeHeartbeat, on_beat)
        try:
            await asyncio.wait_for(every_node_beats_after(0.0), 30)
            for admission in admissions:
                await admission.start()
            await AdmissionClient(bus, timeout_s=5.0).submit(JobSpec(
                name="steady", team="t", priority_class="normal",
                replicas=ReplicaRange(min=4, max=4), grace_period_s=1.0,
                command=["sleep", "600"]), "steady-1", retry_s=30)
            jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
            ledger = LedgerStore((await TypedKV.open(bus.js, subjects.ADMISSION_BUCKET, Lease)).kv,
                                 subjects.ADMISSION_BUCKET)
            record = await asyncio.wait_for(reaches(jobs, "steady-1", JobState.ADMITTED), 30)
            before = await jobs.get("steady-1")
            await ledger.load()
            placements, claims = dict(ledger.stored), dict(ledger.claims)
            published = len(states)

            restartable_nats.kill()
            await asyncio.sleep(OUTAGE_S)  # the fault: the bus is down this long
            restartable_nats.start()
            await asyncio.wait_for(every_node_beats_after(time.time()), 30)
            # A leader that judged stale entries would have done so by now: on its first
            # tick after reconnecting, before the agents' fresh heartbeats were written.
            await asyncio.sleep(2 * LOST_AFTER_S)

            after = await jobs.get("steady-1")
            assert after is not None and after.revision == before.revision, (
                after.value.state, after.value.reason)
            assert after.value.nodes == record.nodes
            await ledger.load()
            assert (ledger.stored, ledger.claims) == (placements, claims)  # not even rewritten
            assert states[published:] == []  # no state change published
            leaders = [a for a in admissions if a.term is not None and a.term.serving]
            assert len(leaders) == 1
            assert all(e.alive for e in leaders[0].term.node_events.values())

            # Still judging: a node that really goes silent is lost after the timeout.
            agents[1].send_signal(signal.SIGSTOP)
            requeued = await asyncio.wait_for(reaches(jobs, "steady-1", JobState.PENDING), 30)
            assert requeued.nodes == [] and "1 schedulable nodes" in requeued.reason
        finally:
            for admission in admissions:
                await admission.stop()
            for agent in agents:
                if agent.returncode is None:
                    agent.send_signal(signal.SIGCONT)
                    agent.send_signal(signal.SIGTERM)
                    await agent.wait()


async def reaches(jobs: TypedKV[JobRecord], job_id: str, state: JobState) -> JobRecord:
    """``job_id``'s record once it is in ``state`` (a KV watch, no polling)."""
    async for change in jobs.watch():
        if change is not None and change.key == job_id and change.value is not None \
                and change.value.state is state:
            return change.value
    raise AssertionError("watch ended")


async def test_a_close_ends_against_a_server_that_stopped_reading(own_nats: NatsServer) -> None:
    """A hung server (SIGSTOP) reads nothing: nats-py's close flushed what was unsent
    first and waited on the socket for good. Bus.close gives that up and ends."""
    assert own_nats.process is not None
    bus = await Bus.connect(BusConfig.load(env={}, servers=[own_nats.url]))
    own_nats.process.send_signal(signal.SIGSTOP)
    try:
        blob = b"x" * 500_000
        stalled = False
        for _ in range(200):  # until the socket is full and a publish waits on the server
            try:
                await within(bus.nc.publish(f"stall.{uuid.uuid4().hex}", blob), 0.5)
            except TimeoutError:
                stalled = True
                break
        assert stalled, "the publishes never waited on the stopped server"
        await within(bus.close(), 120)
        assert bus.nc.is_closed
    finally:
        own_nats.process.send_signal(signal.SIGCONT)
