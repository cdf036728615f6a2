"""Warm spares on a real agent: taken for a replacement, replaced, yielding, stopped; a
job of replica groups keeps spare groups, taken whole.

A real agent (a subprocess), a real nats-server and real processes of a job's
command: a small Python rank that, as a spare, waits in
:func:`phalanx.runtime.spare.wait_for_identity` (what ``ElasticSession.from_env``
calls) and then prints the replica it became. Spares are found as a user would
find them: processes whose environment carries ``PHALANX_SPARE`` for the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from proc_tree import until
from spare_probe import spares_of
from test_agent_replicas import process_exit, queue_of

from phalanx.bus.client import Bus
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Generation,
    GenerationReason,
    JobRecord,
    JobSpec,
    JobState,
    LaunchReplica,
    Member,
    NodeHeartbeat,
    RankExited,
    RankStarted,
    ReasonCode,
    ReplicaRange,
    ReplicaReply,
)
from phalanx.services.natsd import NatsServer

RANK = """
import os, sys, time
from phalanx.runtime.spare import wait_for_identity
env = wait_for_identity(os.environ) if os.environ.get("PHALANX_SPARE") else os.environ
print("I am", env["PHALANX_REPLICA_ID"], "rank", env["RANK"], "local", env["LOCAL_RANK"],
      "gpus", env.get("CUDA_VISIBLE_DEVICES"), "admission", env["PHALANX_ADMISSION"],
      "port", env.get("MASTER_PORT"), flush=True)
time.sleep(600)
"""


def record(job_id: str, node_id: str, replicas: int, spares: int | None,
           state: JobState = JobState.ADMITTED, ranks: int = 1) -> JobRecord:
    spec = JobSpec(name="spares", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=replicas, max=replicas), grace_period_s=2.0,
                   command=[sys.executable, "-c", RANK], spares=spares,
                   ranks_per_replica=ranks)
    return JobRecord(job_id=job_id, spec=spec, state=state, submitted_at=1.0, updated_at=2.0,
                     reason_code=ReasonCode.ADMITTED if state is JobState.ADMITTED
                     else ReasonCode.FINISHED,
                     nodes=[node_id] * replicas if state is JobState.ADMITTED else [],
                     admission=3)


async def put(bus: Bus, jobs: TypedKV[JobRecord], job: JobRecord) -> None:
    """Store and publish a job record, as admission does."""
    await jobs.put(job.job_id, job)
    await bus.publish(subjects.job_state(job.job_id), job)


async def gone(pid: int) -> None:
    """Return once process ``pid`` has exited (at once if it has already)."""
    with contextlib.suppress(ProcessLookupError):
        await asyncio.wait_for(process_exit(pid), 10)


@contextlib.asynccontextmanager
async def running_agent(url: str, node_id: str, work_dir: Path, gpus: str = "",
                        slots: int = 3) -> AsyncIterator[asyncio.subprocess.Process]:
    """An agent with ``slots`` slots (on ``gpus``, one per slot, where given: no GPU is
    touched, the ranks here never import torch); stopped (SIGTERM) at the end if it still
    runs."""
    env = {**os.environ, "PHALANX_AGENT_GPUS": gpus} if gpus else None
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.services.agent", "--node-id", node_id,
        "--slots", str(slots),
        "--heartbeat-interval", "0.1", "--nats", url, "--work-dir", str(work_dir), env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await process.wait()


@pytest.fixture
async def agent(nats_server: NatsServer, uid: str,
                tmp_path: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    async with running_agent(nats_server.url, uid, tmp_path / "agent") as process:
        yield process


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)


async def program_environ_of(pid: int) -> dict[str, str]:
    """The environment a rank forked by a zygote shows once it runs its program: the
    agent reports the start when the zygote forks it, a moment before the child's
    ``/proc/<pid>/environ`` stops showing the zygote's."""
    return await until(lambda: (env := environ_of(pid)).get("PHALANX_JOB_ID") and env)


async def test_a_replacement_is_a_spare_which_is_replaced_and_stopped_with_its_job(
        bus: Bus, agent: asyncio.subprocess.Process, uid: str, tmp_path: Path) -> None:
    job_id = f"spares-{uid}"
    started = await queue_of(bus, subjects.rank_started(job_id), RankStarted)
    exited = await queue_of(bus, subjects.rank_exited(job_id), RankExited)
    beats = await queue_of(bus, subjects.node_heartbeat(uid), NodeHeartbeat)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    await put(bus, jobs, record(job_id, uid, replicas=2, spares=1))
    try:
        ranks = {s.replica_id: s for s in [await asyncio.wait_for(started.get(), 30)
                                           for _ in range(2)]}
        assert sorted(ranks) == ["r0-0", "r1-0"]
        (spare,) = await until(lambda: spares_of(job_id))
        # A spare holds no slot: the node reports its two ranks' slots only.
        while not beats.empty():
            beats.get_nowait()
        assert (await asyncio.wait_for(beats.get(), 10)).slots_used == 2

        os.kill(ranks["r1-0"].pid, signal.SIGKILL)
        died = await asyncio.wait_for(exited.get(), 30)
        assert died.replica_id == "r1-0"
        reply = await bus.request(subjects.agent_launch(uid), LaunchReplica(
            job_id=job_id, slot=1, replica_id="r1-1"), ReplicaReply, timeout_s=10)
        assert (reply.spare, reply.pid) == (True, spare), reply
        assert reply.detail == "started r1-1 in slot 1 from a warm spare"
        start = await asyncio.wait_for(started.get(), 10)
        assert (start.replica_id, start.pid, start.admission) == ("r1-1", spare, 3)
        # The spare is r1-1 now, in the slot r1-0 left (RankStarted's rank 1), writing to
        # its log; torchrun's variables make it a world of one, as any replica of a job
        # that has a generation.
        log_path = tmp_path / "agent" / "jobs" / job_id / "r1-1.log"
        await until(lambda: "I am r1-1 rank 0 local 0" in log_path.read_text())
        assert "starting on warm spare spare-1" in log_path.read_text()
        assert "admission 3" in log_path.read_text()  # the record's, told with its identity

        # The spare taken is replaced; a spare killed is replaced too, and neither
        # is reported as a rank.
        (second,) = await until(lambda: spares_of(job_id) - {spare})
        os.kill(second, signal.SIGKILL)
        (third,) = await until(lambda: spares_of(job_id) - {spare, second})
        assert exited.empty() and started.empty()

        # The job ends: its ranks and its spare are stopped.
        await put(bus, jobs, record(job_id, uid, replicas=2, spares=1,
                                      state=JobState.FINISHED))
        await gone(third)
        await gone(spare)
        assert spares_of(job_id) == set()
    finally:
        await jobs.delete(job_id)


async def test_a_spare_yields_its_slot_to_another_job_and_none_outlives_the_agent(
        bus: Bus, agent: asyncio.subprocess.Process, uid: str) -> None:
    first, other = f"spares-{uid}", f"other-{uid}"
    started = await queue_of(bus, subjects.rank_started(other), RankStarted)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    await put(bus, jobs, record(first, uid, replicas=2, spares=1))
    try:
        (spare,) = await until(lambda: spares_of(first))
        # Another job is placed on the spare's free slot: its rank starts at once and
        # the spare goes.
        await put(bus, jobs, record(other, uid, replicas=1, spares=1))
        assert (await asyncio.wait_for(started.get(), 30)).replica_id == "r0-0"
        await gone(spare)
        assert spares_of(first) == set() and spares_of(other) == set()

        # Asked for from a spare only, with none here: nothing starts, nothing stops,
        # and the replica id is not used up: the same launch, cold, starts it.
        ask = LaunchReplica(job_id=first, slot=1, replica_id="r1-1", warm_only=True)
        reply = await bus.request(subjects.agent_launch(uid), ask, ReplicaReply, timeout_s=10)
        assert (reply.pid, reply.spare) == (None, False), reply
        assert reply.detail == f"not started r1-1 in slot 1: no warm spare of {first} here"
        cold = msgspec.structs.replace(ask, warm_only=False)
        reply = await bus.request(subjects.agent_launch(uid), cold, ReplicaReply, timeout_s=10)
        assert reply.detail == "started r1-1 in slot 1" and reply.pid is not None, reply

        # The second job ends: the slot is free again, the first job's spare comes back.
        await put(bus, jobs, record(other, uid, replicas=1, spares=1,
                                     state=JobState.FINISHED))
        (back,) = await until(lambda: spares_of(first))
        agent.send_signal(signal.SIGTERM)
        await asyncio.wait_for(agent.wait(), 30)
        await gone(back)
        assert spares_of(first) == set()
    finally:
        await jobs.delete(first)
        await jobs.delete(other)


async def test_on_gpus_a_spare_waits_on_a_free_gpu_and_its_replica_runs_there(
        bus: Bus, nats_server: NatsServer, uid: str, tmp_path: Path) -> None:
    first, other = f"spares-{uid}", f"other-{uid}"
    started = await queue_of(bus, subjects.rank_started(first), RankStarted)
    exited = await queue_of(bus, subjects.rank_exited(first), RankExited)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    async with running_agent(nats_server.url, uid, tmp_path / "agent", gpus="0,1,2"):
        await put(bus, jobs, record(first, uid, replicas=1, spares=1))
        try:
            rank = await asyncio.wait_for(started.get(), 30)
            assert (await program_environ_of(rank.pid))["CUDA_VISIBLE_DEVICES"] == "0"
            # The spare sees the first free slot's GPU, as a rank there would.
            (spare,) = await until(lambda: spares_of(first))
            assert {k: environ_of(spare).get(k) for k in ("CUDA_VISIBLE_DEVICES",
                                                          "PHALANX_DEVICE", "LOCAL_RANK")} \
                == {"CUDA_VISIBLE_DEVICES": "1", "PHALANX_DEVICE": "cuda", "LOCAL_RANK": "0"}

            # Another job's rank is placed on that GPU's slot: the spare goes, and one
            # starts on the GPU still free.
            await put(bus, jobs, record(other, uid, replicas=1, spares=0))
            await gone(spare)
            (moved,) = await until(lambda: spares_of(first))
            assert environ_of(moved)["CUDA_VISIBLE_DEVICES"] == "2"

            # The rank on GPU 0 dies: its replacement is the spare, in the slot of the
            # spare's GPU (2), not in the lowest free slot (0, another GPU): it sees that
            # GPU alone, as cuda:LOCAL_RANK (0).
            os.kill(rank.pid, signal.SIGKILL)
            assert (await asyncio.wait_for(exited.get(), 30)).replica_id == "r0-0"
            reply = await bus.request(subjects.agent_launch(uid), LaunchReplica(
                job_id=first, slot=0, replica_id="r0-1"), ReplicaReply, timeout_s=10)
            assert (reply.spare, reply.pid) == (True, moved), reply
            log_path = tmp_path / "agent" / "jobs" / first / "r0-1.log"
            await until(lambda: "I am r0-1 rank 0 local 0 gpus 2" in log_path.read_text())
        finally:
            await jobs.delete(first)
            await jobs.delete(other)


async def test_unset_spares_start_once_the_job_has_a_generation_and_stop_without(
        bus: Bus, agent: asyncio.subprocess.Process, uid: str) -> None:
    job_id = f"spares-{uid}"
    started = await queue_of(bus, subjects.rank_started(job_id), RankStarted)
    beats = await queue_of(bus, subjects.node_heartbeat(uid), NodeHeartbeat)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    generations = await TypedKV.open(bus.js, subjects.GENERATIONS_BUCKET, Generation)
    await put(bus, jobs, record(job_id, uid, replicas=2, spares=None))
    try:
        for _ in range(2):
            await asyncio.wait_for(started.get(), 30)
        # No generation: the command may not run a session, and a spare of it would run
        # the whole command. Nothing starts while the agent beats on.
        while not beats.empty():
            beats.get_nowait()
        for _ in range(5):
            await asyncio.wait_for(beats.get(), 10)
        assert spares_of(job_id) == set()

        # Its ranks reported ready from a session: elasticity stores the job's generation.
        await generations.put(job_id, Generation(
            job_id=job_id, generation=0, world_size=2, rendezvous=f"{job_id}-g0",
            resume_step=0, reason=GenerationReason.START,
            members=[Member(replica_id=f"r{i}-0", rank=i, node_id=uid) for i in range(2)]))
        (spare,) = await until(lambda: spares_of(job_id))
        # The generation gone (the job's membership ended), the default spare goes too.
        await generations.delete(job_id)
        await gone(spare)
        assert spares_of(job_id) == set()
    finally:
        await jobs.delete(job_id)
        with contextlib.suppress(Exception):
            await generations.delete(job_id)


async def test_a_job_of_groups_keeps_a_spare_group_that_replaces_a_dead_group_whole(
        bus: Bus, nats_server: NatsServer, uid: str, tmp_path: Path) -> None:
    """One group of 2 ranks on 4 slots: the 2 free slots hold a spare group, whose two
    processes, started with the group's variables on a port of their own, become the
    replacement group's ranks 0 and 1 on that same port; one of a spare group killed
    takes the other down, and a new spare group starts."""
    job_id = f"groups-{uid}"
    started = await queue_of(bus, subjects.rank_started(job_id), RankStarted)
    exited = await queue_of(bus, subjects.rank_exited(job_id), RankExited)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    async with running_agent(nats_server.url, uid, tmp_path / "agent", slots=4):
        await put(bus, jobs, record(job_id, uid, replicas=1, spares=1, ranks=2))
        try:
            rank = await asyncio.wait_for(started.get(), 30)
            spare = await until(lambda: len(found := spares_of(job_id)) == 2 and found)
            envs = {int(environ_of(pid)["RANK"]): environ_of(pid) for pid in spare}
            port = envs[0]["MASTER_PORT"]
            assert {(g, e["WORLD_SIZE"], e["MASTER_PORT"], e["PHALANX_GROUP_RANK"])
                    for g, e in envs.items()} == {(0, "2", port, "0"), (1, "2", port, "1")}
            assert "PHALANX_REPLICA_ID" not in envs[0]

            os.kill(rank.pid, signal.SIGKILL)  # its agent takes the other rank down
            assert (await asyncio.wait_for(exited.get(), 30)).replica_id == "r0-0"
            reply = await bus.request(subjects.agent_launch(uid), LaunchReplica(
                job_id=job_id, slot=0, replica_id="r0-1"), ReplicaReply, timeout_s=10)
            first = next(pid for pid in spare if environ_of(pid)["RANK"] == "0")
            assert (reply.spare, reply.pid) == (True, first), reply
            start = await asyncio.wait_for(started.get(), 10)
            assert (start.replica_id, start.pid) == ("r0-1", first)
            logs = tmp_path / "agent" / "jobs" / job_id
            # Each told its rank of the group, on the spare group's port.
            await until(lambda: all(f"I am r0-1 rank {g} local {g}" in text
                                    and f"port {port}" in text
                                    for g in (0, 1)
                                    for text in [(logs / f"r0-1_g{g}.log").read_text()]))

            # The one taken is replaced; one rank of the next killed takes its group down,
            # and another spare group starts. None is reported as a rank.
            second = await until(lambda: len(found := spares_of(job_id) - spare) == 2
                                 and found)
            os.kill(min(second), signal.SIGKILL)
            for pid in second:
                await gone(pid)
            await until(lambda: len(spares_of(job_id) - spare - second) == 2)
            assert exited.empty() and started.empty()
        finally:
            await jobs.delete(job_id)


async def test_on_gpus_each_rank_of_a_spare_group_sees_its_own_free_gpu(
        bus: Bus, nats_server: NatsServer, uid: str, tmp_path: Path) -> None:
    job_id = f"groups-{uid}"
    started = await queue_of(bus, subjects.rank_started(job_id), RankStarted)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    async with running_agent(nats_server.url, uid, tmp_path / "agent", gpus="0,1,2,3",
                             slots=4):
        await put(bus, jobs, record(job_id, uid, replicas=1, spares=1, ranks=2))
        try:
            await asyncio.wait_for(started.get(), 30)  # the group, on GPUs 0 and 1
            spare = await until(lambda: len(found := spares_of(job_id)) == 2 and found)
            # Rank s of the spare group on the s-th free GPU, seen alone as cuda:0.
            assert sorted((environ_of(pid)["RANK"], environ_of(pid)["CUDA_VISIBLE_DEVICES"],
                           environ_of(pid)["LOCAL_RANK"]) for pid in spare) == [
                ("0", "2", "0"), ("1", "3", "0")]
        finally:
            await jobs.delete(job_id)
