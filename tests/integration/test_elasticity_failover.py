"""Elasticity as two real processes on a real nats-server: the leader is SIGKILLed, and what
happened meanwhile (a replacement's readiness, a node-lost fault) is acted on by the standby.

No agents and no torch: the test plays the job's ranks and health by publishing their
messages, and checks the generations the service publishes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.bus.stream import JOB_EVENTS
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Fault,
    FaultKind,
    Generation,
    GenerationApplied,
    GenerationGivenUp,
    GenerationReason,
    JobHistory,
    JobRecord,
    JobSpec,
    JobState,
    LaunchReplica,
    Lease,
    ReasonCode,
    ReplicaRange,
    ReplicaReady,
    ReplicaReply,
    StreamCursor,
)
from phalanx.services.natsd import NatsServer

JOB = "fo-1"
NODES = {0: "n0", 1: "n0", 2: "n1", 3: "n1"}


@pytest.fixture
async def bus(own_nats: NatsServer) -> AsyncIterator[Bus]:
    async with await Bus.connect(BusConfig.load(env={}, servers=[own_nats.url])) as b:
        yield b


def start(own_nats: NatsServer, name: str, log_dir: Path) -> subprocess.Popen:
    log = (log_dir / f"{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx.services.elasticity", "--instance", name],
        env={**os.environ, "PHALANX_NATS_URL": own_nats.url, "PHALANX_ELASTICITY_LEASE_S": "1"},
        stdout=log, stderr=log)


def stop(instances: dict[str, subprocess.Popen]) -> None:
    """SIGTERM the instances still running; each stops cleanly, even right after a
    takeover."""
    running = [proc for proc in instances.values() if proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    for proc in running:
        assert proc.wait(20) == 0


class Ranks:
    """What the job's ranks would do: report ready, apply generations."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.generations: asyncio.Queue[Generation] = asyncio.Queue()
        self.launches: asyncio.Queue[LaunchReplica] = asyncio.Queue()

    async def ready(self, replica: str, slot: int) -> None:
        await self.bus.publish_event(subjects.replica_ready(JOB), ReplicaReady(
            job_id=JOB, replica_id=replica, slot=slot, node_id=NODES[slot],
            endpoint=f"127.0.0.1:{9000 + slot}"), event_id=f"{JOB}-{replica}-ready")

    async def apply(self, g: Generation, step: int) -> None:
        for m in g.members:
            await self.bus.publish_event(subjects.generation_applied(JOB), GenerationApplied(
                job_id=JOB, generation=g.generation, replica_id=m.replica_id,
                committed_step=step, resume_step=step),
                event_id=f"{JOB}-{m.replica_id}-g{g.generation}")

    async def next_generation(self, number: int) -> Generation:
        while True:
            g = await asyncio.wait_for(self.generations.get(), 30)
            if g.generation == number:
                return g
            assert g.generation < number, f"skipped to generation {g.generation}"


async def admit(bus: Bus, replicas: ReplicaRange, nodes: list[str]) -> None:
    """Store JOB's record as admission does once it is admitted on ``nodes``."""
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    await jobs.put(JOB, JobRecord(
        job_id=JOB, spec=JobSpec(name="fo", team="t", priority_class="normal",
                                 replicas=replicas, command=["true"]),
        state=JobState.ADMITTED, submitted_at=1.0, updated_at=1.0,
        reason_code=ReasonCode.ADMITTED, nodes=nodes))


async def leader(bus: Bus, not_: str | None = None) -> str:
    """The current holder of the lease (other than ``not_``), as soon as there is one."""
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    async for change in leases.watch():
        if change is None:
            continue
        lease = change.value
        if lease is not None and lease.expires_at > time.time() and lease.holder != not_:
            return lease.holder
    raise AssertionError("the lease watch ended")


async def test_a_standby_takes_over_and_acts_on_what_happened_while_no_leader_ran(
        own_nats: NatsServer, bus: Bus, tmp_path: Path) -> None:
    ranks = Ranks(bus)

    async def on_generation(g: Generation, _: Delivery) -> None:
        await ranks.generations.put(g)

    async def on_launch(request: LaunchReplica, _: Delivery) -> ReplicaReply:
        await ranks.launches.put(request)
        return ReplicaReply(node_id="n0", replica_id=request.replica_id, pid=1, detail="ok")

    await bus.subscribe(subjects.job_generation(JOB), Generation, on_generation)
    for node in ("n0", "n1"):
        await bus.subscribe(subjects.agent_launch(node), LaunchReplica, on_launch)
    instances = {name: start(own_nats, name, tmp_path) for name in ("e1", "e2")}
    try:
        first = await asyncio.wait_for(leader(bus), 30)
        await admit(bus, ReplicaRange(min=2, max=4), list(NODES.values()))
        for slot in NODES:
            await ranks.ready(f"r{slot}-0", slot)
        g0 = await ranks.next_generation(0)
        assert g0.world_size == 4
        await ranks.apply(g0, 5)
        # A crash: r1-0 is dropped, and once the survivors applied that, r1-1 is launched.
        await bus.publish_event(subjects.job_fault(JOB), Fault(
            fault_id="f1", job_id=JOB, kind=FaultKind.CRASH, node_id="n0", detected_at=2.0,
            rank=1, replica_id="r1-0"), event_id="f1")
        g1 = await ranks.next_generation(1)
        assert [m.replica_id for m in g1.members] == ["r0-0", "r2-0", "r3-0"]
        await ranks.apply(g1, 7)
        launch = await asyncio.wait_for(ranks.launches.get(), 30)
        assert (launch.replica_id, launch.slot) == ("r1-1", 1)

        # The leader dies; meanwhile the replacement becomes ready and node n1 is lost.
        instances[first].send_signal(signal.SIGKILL)
        instances[first].wait()
        await ranks.ready("r1-1", 1)
        for slot, replica in ((2, "r2-0"), (3, "r3-0")):
            await bus.publish_event(subjects.job_fault(JOB), Fault(
                fault_id=f"lost-{slot}", job_id=JOB, kind=FaultKind.NODE_LOST, node_id="n1",
                detected_at=3.0, rank=slot, replica_id=replica), event_id=f"lost-{slot}")

        await asyncio.wait_for(leader(bus, not_=first), 30)
        # The standby re-asserts the current generation, then acts on both events (in one
        # generation or two, as they arrive): r1-1 joins, r2-0 and r3-0 are dropped.
        g = await ranks.next_generation(2)
        while [m.replica_id for m in g.members] != ["r0-0", "r1-1"]:
            assert g.generation < 5 and g.world_size >= 2, g
            await ranks.apply(g, 9)
            g = await ranks.next_generation(g.generation + 1)
        stored = await TypedKV.open(bus.js, subjects.GENERATIONS_BUCKET, Generation)
        assert (await stored.get(JOB)).value == g
    finally:
        stop(instances)


async def test_a_generation_given_up_while_no_leader_ran_is_decided_again_by_the_standby(
        own_nats: NatsServer, bus: Bus, tmp_path: Path) -> None:
    """Its members could not form generation 0 and, none dead, wait for a newer one; their
    reports, stored while no leader ran, make the standby decide it again, once."""
    ranks = Ranks(bus)
    members = ["r0-0", "r1-0"]

    async def on_generation(g: Generation, _: Delivery) -> None:
        await ranks.generations.put(g)

    async def gave_up(replica: str, generation: int, n: int) -> None:
        await bus.publish_event(subjects.generation_given_up(JOB), GenerationGivenUp(
            job_id=JOB, generation=generation, replica_id=replica, reason="timed out"),
            event_id=f"{JOB}-{replica}-g{generation}-given-up-{n}")

    await bus.subscribe(subjects.job_generation(JOB), Generation, on_generation)
    instances = {name: start(own_nats, name, tmp_path) for name in ("e1", "e2")}
    try:
        first = await asyncio.wait_for(leader(bus), 30)
        await admit(bus, ReplicaRange(min=2, max=2), ["n0", "n0"])
        for slot, replica in enumerate(members):
            await ranks.ready(replica, slot)
        g0 = await ranks.next_generation(0)
        assert [m.replica_id for m in g0.members] == members
        instances[first].send_signal(signal.SIGKILL)
        instances[first].wait()
        for replica in members:
            await gave_up(replica, 0, 0)
        await asyncio.wait_for(leader(bus, not_=first), 30)
        # The standby re-asserts generation 0, then decides it again: the same members.
        g1 = await ranks.next_generation(1)
        assert [m.replica_id for m in g1.members] == members
        assert (g1.reason, g1.rendezvous) == (GenerationReason.FAULT, f"{JOB}-g1")
        assert "gave up generation 0" in g1.cause
        # A report of generation 0 heard again (after the stream's duplicate window)
        # changes nothing: when the members' reports of applying generation 1, read after
        # it, are in the history, generation 1 is still the last.
        await gave_up("r0-0", 0, 1)
        await ranks.apply(g1, 0)
        history = await TypedKV.open(bus.js, subjects.HISTORY_BUCKET, JobHistory)

        async def applied() -> JobHistory:
            async for change in history.watch():
                if change is not None and change.key == JOB and change.value is not None \
                        and change.value.generations[-1].applied_resume_step is not None:
                    return change.value
            raise AssertionError("the history watch ended")

        told = await asyncio.wait_for(applied(), 30)
        assert [g.generation for g in told.generations] == [0, 1]
    finally:
        stop(instances)


async def test_readiness_that_overtakes_its_jobs_record_is_not_lost(
        own_nats: NatsServer, bus: Bus, tmp_path: Path) -> None:
    """A job's record (the leader's watch of the jobs bucket) and its replicas' readiness
    (the stream) come through two consumers, so a replica can be ready before the watch
    brings its job. The leader reads such a job's record ahead of the event (and its core
    keeps early events until the record comes): every job starts its first generation
    with all its replicas. (Health dropped such events: the same race,
    tests/integration/test_health_failover.py.)"""
    jobs = [f"overtaken-{i}" for i in range(12)]
    first: dict[str, Generation] = {}
    formed = asyncio.Event()

    async def on_generation(g: Generation, _: Delivery) -> None:
        first.setdefault(g.job_id, g)
        if len(first) == len(jobs):
            formed.set()

    await bus.subscribe(subjects.job_events("generation"), Generation, on_generation)
    instance = start(own_nats, "e1", tmp_path)
    try:
        await asyncio.wait_for(leader(bus), 30)
        records = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
        for job in jobs:
            await records.put(job, JobRecord(
                job_id=job, spec=JobSpec(name="ov", team="t", priority_class="normal",
                                         replicas=ReplicaRange(min=2, max=2),
                                         command=["true"]),
                state=JobState.ADMITTED, submitted_at=1.0, updated_at=1.0,
                reason_code=ReasonCode.ADMITTED, nodes=["n0", "n1"]))
            for slot, node in enumerate(("n0", "n1")):
                await bus.publish_event(subjects.replica_ready(job), ReplicaReady(
                    job_id=job, replica_id=f"r{slot}-0", slot=slot, node_id=node,
                    endpoint=f"127.0.0.1:{9000 + slot}"), event_id=f"{job}-{slot}-ready")
        try:
            await asyncio.wait_for(formed.wait(), 20)
        except TimeoutError:
            raise AssertionError(f"no generation for {sorted(set(jobs) - set(first))}") from None
        assert {job: [m.replica_id for m in g.members] for job, g in first.items()} == \
            {job: ["r0-0", "r1-0"] for job in jobs}
    finally:
        instance.send_signal(signal.SIGTERM)
        assert instance.wait(20) == 0


async def stored_history(histories: TypedKV, holds) -> JobHistory:
    """JOB's stored history once it ``holds`` (the leader stores it after acting)."""
    async for change in histories.watch():
        if change is not None and change.key == JOB and change.value is not None \
                and holds(change.value):
            return change.value
    raise AssertionError("the history watch ended")


async def test_a_requeued_jobs_history_keeps_its_first_admission_across_a_failover(
        own_nats: NatsServer, bus: Bus, tmp_path: Path) -> None:
    """Admitted, trained, requeued (its record pending), the leader SIGKILLed, admitted
    again: the standby's history of the new admission carries the first one's
    generations (``JobHistory.earlier``), read from what the first leader stored."""
    ranks = Ranks(bus)

    async def on_generation(g: Generation, _: Delivery) -> None:
        await ranks.generations.put(g)

    await bus.subscribe(subjects.job_generation(JOB), Generation, on_generation)
    histories = await TypedKV.open(bus.js, subjects.HISTORY_BUCKET, JobHistory)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    instances = {name: start(own_nats, name, tmp_path) for name in ("e1", "e2")}
    try:
        first = await asyncio.wait_for(leader(bus), 30)
        await admit(bus, ReplicaRange(min=2, max=2), ["n0", "n1"])
        for slot in (0, 1):
            await ranks.ready(f"r{slot}-0", slot)
        g0 = await ranks.next_generation(0)
        await ranks.apply(g0, 40)
        before = await stored_history(histories, lambda h: h.generations and
                                      h.generations[0].applied_resume_step == 40)
        record = (await jobs.get(JOB)).value
        await jobs.put(JOB, msgspec.structs.replace(
            record, state=JobState.PENDING, reason_code=ReasonCode.PREEMPTED, nodes=[]))
        # The leader has stored its stream position past the first admission's events
        # (it does every second): the standby does not read them again. (One that read
        # them again could take them for the next admission's: docs/status.md.)
        last = (await bus.js.stream_info(JOB_EVENTS)).state.last_seq
        cursors = await TypedKV.open(bus.js, subjects.CURSORS_BUCKET, StreamCursor)
        async for change in cursors.watch():
            if change is not None and change.key == "elasticity" and change.value is not None \
                    and change.value.seq >= last:
                break
        instances[first].send_signal(signal.SIGKILL)
        instances[first].wait()
        await asyncio.wait_for(leader(bus, not_=first), 30)

        await admit(bus, ReplicaRange(min=2, max=2), ["n1", "n0"])
        for slot in (0, 1):  # the new admission's replicas, again r<slot>-0
            await bus.publish_event(subjects.replica_ready(JOB), ReplicaReady(
                job_id=JOB, replica_id=f"r{slot}-0", slot=slot, node_id=["n1", "n0"][slot],
                endpoint=f"127.0.0.1:{9100 + slot}"), event_id=f"{JOB}-r{slot}-0-ready-again")
        again = await ranks.next_generation(0)
        while again.members[0].node_id != "n1":  # the first admission's, re-asserted
            again = await ranks.next_generation(0)
        stored = await stored_history(histories, lambda h: h.generations and (
            h.generations[0].decided_at != before.generations[0].decided_at))
        assert stored.earlier == before.generations
        assert [(g.generation, g.applied_resume_step) for g in stored.earlier] == [(0, 40)]
        assert [(g.generation, g.members) for g in stored.generations] == [
            (0, ["r0-0", "r1-0"])]
    finally:
        stop(instances)
        await jobs.delete(JOB)
