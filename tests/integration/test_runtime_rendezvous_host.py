"""A generation whose rendezvous host dies mid-rendezvous: the next one forms, and no live
member is taken for failed.

Real rank processes of ``runtime_worker.py`` on the session's nats-server, over gloo,
with a 10 s store timeout; the test plays health and elasticity (it publishes the
generations a fault brings). Four members train; r3-0 dies in step 5's all-reduce, and
generation 1 (r0-0, r1-0, r2-0) forms on r0-0's store. r0-0 dies in that rendezvous,
once every member has counted itself in, before the group connects: the others are
inside it. Its death is a fault, whose generation (r1-0, r2-0) must be the next try, and
form. (Seen here: the survivors were in gloo's connect, which did not fail when the
store's host died; the fault's generation superseded theirs, and they gave it up then.)

What the survivors must not do meanwhile is what health or elasticity would take for a
failure of theirs: go silent (a hang, past a job's default ``hang_timeout_s``), or name a
live member unreachable. Waiting on the store instead (the host's death resets their
connection), they may report generation 1 given up before the dead host's fault comes
(seen on a clean clone): elasticity then decides it again with the same members, one
failed try more before the fault's (docs/status.md), but no live member is blamed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import msgspec
from test_runtime_training import Job  # the same worker and job harness

from phalanx.bus.client import Bus, Delivery
from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas import subjects
from phalanx.schemas.messages import GenerationGivenUp, GenerationReason, JobSpec, RankProgress
from phalanx.services.agent.zygote import Launcher
from phalanx.services.natsd import NatsServer

STEPS = 30
MEMBERS = ["r0-0", "r1-0", "r2-0", "r3-0"]
SURVIVORS = ["r1-0", "r2-0"]
#: A job's default: a rank silent this long is faulted as hung.
HANG_TIMEOUT_S = next(field.default for field in msgspec.structs.fields(JobSpec)
                      if field.name == "hang_timeout_s")


async def test_a_generation_whose_rendezvous_host_dies_forms_on_the_next_try(
        tmp_path: Path, nats_server: NatsServer, bus: Bus, uid: str, data: Path,
        launcher: Launcher) -> None:
    reports: list[GenerationGivenUp] = []
    heard: dict[str, list[tuple[float, int]]] = {r: [] for r in SURVIVORS}

    async def on_given_up(message: GenerationGivenUp, _: Delivery) -> None:
        reports.append(message)

    async def on_progress(message: RankProgress, _: Delivery) -> None:
        if message.replica_id in heard:
            heard[message.replica_id].append((time.monotonic(), message.generation))

    await bus.subscribe(subjects.generation_given_up(uid), GenerationGivenUp, on_given_up)
    await bus.subscribe(subjects.health_job_ranks(uid), RankProgress, on_progress)
    env = {"PHALANX_CHAOS_KILL": "r3-0:5:allreduce,r0-0:g1:rendezvous"}
    async with Job(bus, nats_server, uid, tmp_path, data, "--steps", str(STEPS),
                   "--collective-timeout", "10", launcher=launcher) as job:
        for slot, replica in enumerate(MEMBERS):
            await job.start(replica, slot, env)
        await job.publish(MEMBERS, GenerationReason.START)
        assert await asyncio.wait_for(job.processes["r3-0"].wait(), 120) == -9
        await job.publish(["r0-0", *SURVIVORS], GenerationReason.FAULT)
        rendezvous = time.monotonic()
        assert await asyncio.wait_for(job.processes["r0-0"].wait(), 120) == -9
        await job.publish(SURVIVORS, GenerationReason.FAULT)  # the host's fault's generation
        codes = await job.exit_codes()
    assert codes == {"r0-0": -9, "r1-0": 0, "r2-0": 0, "r3-0": -9}, codes
    assert {(r.generation, tuple(r.unreachable)) for r in reports} <= {(1, ())}, reports
    records = record.read(tmp_path / "rec")
    # r0-0 died where it was told to: in generation 1's rendezvous, never applied.
    assert any(line["kind"] == "chaos" for line in records["r0-0"])
    assert [line["generation"] for line in records["r0-0"] if line["kind"] == "generation"] \
        == [0]
    for replica in SURVIVORS:
        applied = [line["generation"] for line in records[replica]
                   if line["kind"] == "generation"]
        assert applied == [0, 2], (replica, applied)  # generation 2 formed: the next try
        # Heard from all along, until it trained in generation 2: never silent for as long
        # as health takes for a hang.
        formed = next(at for at, generation in heard[replica]
                      if at >= rendezvous and generation == 2)
        times = [rendezvous, *(at for at, _ in heard[replica] if rendezvous <= at <= formed)]
        silent = max(b - a for a, b in itertools.pairwise(times))
        assert silent < HANG_TIMEOUT_S, (replica, silent)
    assert record.verify(records, ElasticOrder(96, 16, seed=0), STEPS) == []
