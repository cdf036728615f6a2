"""A member that cannot form the newest generation says so until a newer one comes.

Real rank processes of ``runtime_worker.py`` on the session's nats-server, over
gloo, with a 3 s store timeout; the test plays elasticity. Generation 0 names an
address nobody listens at as rank 0's store, so rank 1 cannot reach it: it gives
the generation up (no member is dead, so no fault would replace it) and reports
that, stored in the job-events stream, and again every 2 s while it waits. The
test then publishes what elasticity decides on such a report, the same members
with a fresh namespace, and the job trains to its end with every step once.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from test_runtime_training import Job  # the same worker and job harness

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.stream import EventReader, ensure_job_events, last_seq
from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas import subjects
from phalanx.schemas.messages import Generation, GenerationGivenUp, GenerationReason, Member
from phalanx.services.agent.zygote import Launcher
from phalanx.services.natsd import NatsServer

STEPS = 30
MEMBERS = ["r0-0", "r1-0"]


def unused_address() -> str:
    """An address nothing listens at (a port taken and given back at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def started(job: Job, reports: list[GenerationGivenUp]) -> None:
    """Collect the job's given-up reports into ``reports``; start its members."""
    async def on_given_up(message: GenerationGivenUp, _: Delivery) -> None:
        reports.append(message)
        job.changed.set()

    await job.bus.subscribe(subjects.generation_given_up(job.uid), GenerationGivenUp,
                            on_given_up)
    for slot, replica in enumerate(MEMBERS):
        await job.start(replica, slot)


async def test_a_member_that_cannot_form_the_newest_generation_reports_it_while_it_waits(
        tmp_path: Path, nats_server: NatsServer, bus: Bus, uid: str, data: Path,
        launcher: Launcher) -> None:
    reports: list[GenerationGivenUp] = []
    await ensure_job_events(bus)
    cursor = await last_seq(bus)
    async with Job(bus, nats_server, uid, tmp_path, data, "--steps", str(STEPS),
                   "--collective-timeout", "3", launcher=launcher) as job:
        await started(job, reports)
        await job.until(lambda: all(r in job.ready for r in MEMBERS))
        members = [Member(replica_id="r0-0", rank=0, node_id="n", endpoint=unused_address()),
                   Member(replica_id="r1-0", rank=1, node_id="n",
                          endpoint=job.ready["r1-0"].endpoint)]
        await bus.publish(subjects.job_generation(uid), Generation(
            job_id=uid, generation=0, members=members, world_size=2, rendezvous=f"{uid}-g0",
            resume_step=0, reason=GenerationReason.START))
        job.generation = 0
        # Rank 1 gives generation 0 up and says so, and again while it waits.
        await job.until(lambda: len(reports) >= 2)
        assert {(r.job_id, r.generation, r.replica_id) for r in reports} == {(uid, 0, "r1-0")}
        assert "rendezvous of generation 0" in reports[0].reason
        assert reports[1].sent_at - reports[0].sent_at >= 1.5
        # Stored once (the repeats fall in the stream's duplicate window), where a new
        # elasticity leader reads it.
        reader = await EventReader(bus, cursor + 1, frozenset({"given_up"})).start()
        try:
            stored = await asyncio.wait_for(anext(aiter(reader)), 10)
        finally:
            await reader.close()
        assert stored.message == reports[0]
        # Elasticity's answer: the same members, a fresh rendezvous namespace.
        await job.publish(MEMBERS, GenerationReason.FAULT)
        replaced = time.time()
        codes = await job.exit_codes()
    assert codes == dict.fromkeys(MEMBERS, 0)
    assert all(r.sent_at < replaced + 1.0 for r in reports)  # it stopped once replaced
    records = record.read(tmp_path / "rec")
    assert record.verify(records, ElasticOrder(96, 16, seed=0), STEPS) == []


async def test_a_member_whose_collectives_failed_with_no_fault_reports_it_after_the_timeout(
        tmp_path: Path, nats_server: NatsServer, bus: Bus, uid: str, data: Path,
        launcher: Launcher) -> None:
    """Its peer gone with no fault ever published (no health here; in a cluster: a link
    cut between members, or lossy, with every process alive): the survivor's all-reduce
    fails and nothing else will happen. After the collective timeout (the grace a dead
    peer's fault has to arrive) it reports its generation given up, which elasticity
    forms again; without it the job deadlocked (issue 53's 20 % loss)."""
    reports: list[GenerationGivenUp] = []
    async with Job(bus, nats_server, uid, tmp_path, data, "--steps", "400",
                   "--collective-timeout", "3", launcher=launcher) as job:
        await started(job, reports)
        await job.publish(MEMBERS, GenerationReason.START)
        await job.until(lambda: job.step >= 10)
        job.kill("r1-0")
        killed = time.time()
        await job.until(lambda: bool(reports))
        assert {(r.generation, r.replica_id) for r in reports} == {(0, "r0-0")}
        assert "collectives failed with no member faulted" in reports[0].reason
        assert reports[0].sent_at - killed >= 2.5  # not before a fault could have come
        await job.publish(["r0-0"], GenerationReason.FAULT)  # what elasticity decides
        codes = await job.exit_codes()
    assert codes["r0-0"] == 0
    records = record.read(tmp_path / "rec")
    assert record.verify(records, ElasticOrder(96, 16, seed=0), 400) == []
