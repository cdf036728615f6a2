"""A replica of several ranks (a group, ``ranks_per_replica``) on a real agent.

A real nats-server, an agent in-process and real rank processes, each of which sends its
environment to the test over a Unix socket as it starts (no files polled). The group's
processes get the replica's identity, their group rank, their own slots and torchrun's
variables for the group; the group lives and dies together, and is reported as one
replica, once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import msgspec
from test_agent_replicas import process_exit, queue_of

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import environment, settings, subjects
from phalanx.schemas.messages import (
    ExitCause,
    JobRecord,
    JobSpec,
    JobState,
    LaunchReplica,
    LogReply,
    LogRequest,
    RankExited,
    RankStarted,
    ReasonCode,
    ReplicaRange,
    ReplicaReply,
)
from phalanx.services.agent import pidfd
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.ranks import RankSet
from phalanx.services.agent.service import AgentService
from phalanx.services.agent.zygote import ForkedProcess, Launcher

#: Sends its pid and environment to the test's socket, then runs until stopped.
REPORTS = """
import json, os, socket, time
with socket.socket(socket.AF_UNIX) as s:
    s.connect(os.environ["GROUP_TEST_SOCKET"])
    s.sendall(json.dumps({"pid": os.getpid(), "env": dict(os.environ)}).encode())
time.sleep(600)
"""


class Reports:
    """What the rank processes send: one JSON object each, by (replica id, group rank)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict] = asyncio.Queue()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.queue.put(json.loads(await reader.read()))
        writer.close()

    async def next(self, count: int) -> dict[tuple[str, int], dict]:
        got = [await asyncio.wait_for(self.queue.get(), 30) for _ in range(count)]
        return {(r["env"][environment.REPLICA_ID], int(r["env"][environment.GROUP_RANK])): r
                for r in got}


def groups_job(job_id: str, node_id: str, socket_path: Path) -> JobRecord:
    spec = JobSpec(name="groups", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=2, max=2), ranks_per_replica=2,
                   grace_period_s=2.0, env={"GROUP_TEST_SOCKET": str(socket_path)},
                   command=[sys.executable, "-c", REPORTS])
    return JobRecord(job_id=job_id, spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                     updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=[node_id, node_id])


async def test_a_group_starts_its_ranks_together_and_dies_together(
        bus: Bus, bus_config: BusConfig, uid: str, tmp_path: Path) -> None:
    """Two replicas of two ranks on a node of 4 slots: four processes with the right
    variables. SIGKILL of one process takes its group's other down, and the replica's
    exit is reported once, with the killed process's status; a cancel stops every
    process of every group."""
    job_id = f"groups-{uid}"
    reports = Reports()
    socket_path = tmp_path / "reports.sock"
    server = await asyncio.start_unix_server(reports.serve, path=str(socket_path))
    started = await queue_of(bus, subjects.rank_started(job_id), RankStarted)
    exited = await queue_of(bus, subjects.rank_exited(job_id), RankExited)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    record = groups_job(job_id, uid, socket_path)
    await jobs.put(job_id, record)
    agent = AgentService(AgentConfig(node_id=uid, slots=4, heartbeat_interval_s=0.2,
                                     work_dir=str(tmp_path / "agent")), bus_config)
    await agent.start()
    try:
        first = await reports.next(4)
        assert sorted(first) == [("r0-0", 0), ("r0-0", 1), ("r1-0", 0), ("r1-0", 1)]
        starts = {s.replica_id: s for s in [await asyncio.wait_for(started.get(), 30)
                                            for _ in range(2)]}
        ports = set()
        for (replica, group_rank), report in first.items():
            env = report["env"]
            slot = int(replica[1])
            assert {k: env.get(k) for k in (
                environment.JOB_ID, environment.RANK, environment.WORLD_SIZE,
                environment.RANKS_PER_REPLICA, environment.GROUP_RANK, "RANK", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK", "MASTER_ADDR",
                environment.DEVICE, environment.WORLD_OF_ONE_MARK)} == {
                environment.JOB_ID: job_id, environment.RANK: str(slot),
                environment.WORLD_SIZE: "2", environment.RANKS_PER_REPLICA: "2",
                environment.GROUP_RANK: str(group_rank), "RANK": str(group_rank),
                "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                "LOCAL_RANK": str(group_rank), "MASTER_ADDR": "127.0.0.1",
                environment.DEVICE: "cpu", environment.WORLD_OF_ONE_MARK: None}, replica
            assert env["MASTER_PORT"] == first[(replica, 1 - group_rank)]["env"]["MASTER_PORT"]
            ports.add(env["MASTER_PORT"])
            if group_rank == 0:
                assert starts[replica].pid == report["pid"]  # one start, group rank 0's pid
        assert len(ports) == 2  # a port of each group's own
        assert agent.ranks is not None
        held = {e.replica_id: sorted(e.node_slots) for e in agent.ranks.ranks.values()}
        assert sorted(held.values()) == [[0, 1], [2, 3]]  # each group two slots of its own

        # One process of r1-0 dies: its other is stopped, r0-0 runs on.
        killed = first[("r1-0", 1)]["pid"]
        os.kill(killed, signal.SIGKILL)
        await asyncio.wait_for(process_exit(first[("r1-0", 0)]["pid"]), 30)
        end = await asyncio.wait_for(exited.get(), 30)
        assert (end.replica_id, end.pid, end.signal, end.cause) == \
            ("r1-0", killed, "SIGKILL", ExitCause.EXITED)
        assert all(os.path.exists(f"/proc/{first[('r0-0', g)]['pid']}") for g in (0, 1))

        # Its replacement is a new group, meeting on a new port.
        reply = await bus.request(subjects.agent_launch(uid), LaunchReplica(
            job_id=job_id, slot=1, replica_id="r1-1"), ReplicaReply, timeout_s=10)
        assert reply.pid is not None
        second = await reports.next(2)
        assert sorted(second) == [("r1-1", 0), ("r1-1", 1)]
        assert second[("r1-1", 0)]["env"]["MASTER_PORT"] not in ports
        assert (await asyncio.wait_for(started.get(), 30)).replica_id == "r1-1"

        # Each process logged to its own file, listed by the agent in order.
        logs = await bus.request(subjects.agent_logs(uid), LogRequest(job_id=job_id),
                                 LogReply, timeout_s=10)
        assert [log.replica_id for log in logs.logs] == [
            "r0-0_g0", "r0-0_g1", "r1-0_g0", "r1-0_g1", "r1-1_g0", "r1-1_g1"]

        # A cancel stops every process; each replica is reported once, stopped.
        cancelled = msgspec.structs.replace(record, state=JobState.CANCELLED, nodes=[])
        await jobs.put(job_id, cancelled)
        await bus.publish(subjects.job_state(job_id), cancelled)
        ends = [await asyncio.wait_for(exited.get(), 30) for _ in range(2)]
        assert sorted((e.replica_id, e.cause) for e in ends) == [
            ("r0-0", ExitCause.STOPPED), ("r1-1", ExitCause.STOPPED)]
        # Reported once every process of the group is gone (reaped by the agent).
        assert not [r["pid"] for r in [*first.values(), *second.values()]
                    if os.path.exists(f"/proc/{r['pid']}")]
        assert exited.empty()  # r1-0 was reported once
    finally:
        await agent.stop()
        server.close()
        await jobs.delete(job_id)


def on_n1(job_id: str, command: str, grace_period_s: float = 30.0) -> JobRecord:
    """Job ``job_id``: one replica of two ranks on n1, each running ``command`` (sh)."""
    spec = JobSpec(name=job_id, team="t", priority_class="normal", ranks_per_replica=2,
                   grace_period_s=grace_period_s, replicas=ReplicaRange(min=1, max=1),
                   command=["sh", "-c", command])
    return JobRecord(job_id=job_id, spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                     updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=["n1"])


def rank_set(tmp_path: Path, launcher: Launcher | None = None,
             exited: asyncio.Queue[RankExited] | None = None,
             ) -> tuple[RankSet, asyncio.Queue[RankExited]]:
    """An agent's ranks on n1 in ``tmp_path`` (``launcher``: cold starts by default) and
    the exits they report (into ``exited`` where given)."""
    exited = asyncio.Queue() if exited is None else exited

    async def report(message: RankStarted | RankExited) -> None:
        if isinstance(message, RankExited):
            await exited.put(message)

    async def host_of(_: str) -> str:
        return "127.0.0.1"

    return RankSet("n1", tmp_path, "nats://127.0.0.1:1", host_of, report, capacity=4,
                   launcher=launcher), exited


async def test_a_group_that_exits_0_is_reported_clean_once(tmp_path: Path) -> None:
    ranks, exited = rank_set(tmp_path)
    try:
        await ranks.reconcile(on_n1("clean", "exit 0"))
        end = await asyncio.wait_for(exited.get(), 30)
        assert (end.replica_id, end.exit_code, end.signal, end.cause) == \
            ("r0-0", 0, None, ExitCause.EXITED)
        assert ranks.ranks == {}
    finally:
        await ranks.stop_all()
    assert exited.empty()


async def test_a_rank_that_exits_0_while_another_does_not_end_is_no_clean_group(
        tmp_path: Path) -> None:
    """Group rank 0 exits 0, rank 1 never does: rank 1 is given the grace period to end
    by itself, then stopped, and the group is reported with rank 1's SIGTERM."""
    ranks, exited = rank_set(tmp_path)
    try:
        await ranks.reconcile(on_n1(
            "half", f'test "${environment.GROUP_RANK}" = 0 && exit 0; exec sleep 600',
            grace_period_s=0.5))
        end = await asyncio.wait_for(exited.get(), 30)
        assert (end.exit_code, end.signal, end.cause) == (None, "SIGTERM", ExitCause.EXITED)
        assert sorted(p.name for p in (tmp_path / "jobs" / "half").iterdir()) == [
            "r0-0_g0.log", "r0-0_g1.log"]
    finally:
        await ranks.stop_all()


async def test_a_restarted_agent_adopts_a_group_and_ends_it_whole(tmp_path: Path) -> None:
    """A group adopted after an agent restart: one of its processes killed, the other is
    stopped by the new agent and the replica is reported lost, once."""
    first, _ = rank_set(tmp_path)
    await first.reconcile(on_n1("adopted", "exec sleep 600"))
    (entry,) = first.ranks.values()
    assert entry.watcher is not None
    entry.watcher.cancel()  # the first agent is gone: nothing of it watches any more
    pids = [entry.pid, *(m.pid for m in entry.group)]
    second, exited = rank_set(tmp_path)
    try:
        await second.adopt()
        (adopted,) = second.ranks.values()
        assert [adopted.pid, *(m.pid for m in adopted.group)] == pids
        os.kill(pids[1], signal.SIGKILL)
        end = await asyncio.wait_for(exited.get(), 30)
        assert (end.replica_id, end.cause, end.pid) == ("r0-0", ExitCause.LOST, pids[1])
        assert second.ranks == {}
    finally:
        await second.stop_all()
    assert exited.empty()


#: A group's process that ends by itself, exit 0, once ``release`` exists.
ENDS_WHEN_RELEASED = """
import os, pathlib, sys, time
release = pathlib.Path(sys.argv[1])
while not release.exists():
    time.sleep(0.05)
"""


async def test_a_restarted_agent_reports_the_status_its_ranks_wrote_not_lost(
        tmp_path: Path) -> None:
    """Ranks forked from a zygote, their agent gone: one group ends while no agent
    watches, another after a new agent adopted it. Both exit 0 by themselves and are
    reported so, by the status each process wrote as it ended, not ``lost`` (a lost end
    of a job's last ranks started replacements that waited for members long gone)."""
    script = tmp_path / "ends.py"
    script.write_text(ENDS_WHEN_RELEASED)

    def group(job_id: str) -> JobRecord:
        spec = JobSpec(name=job_id, team="t", priority_class="normal", ranks_per_replica=2,
                       replicas=ReplicaRange(min=1, max=1),
                       command=[sys.executable, str(script), str(tmp_path / job_id)])
        return JobRecord(job_id=job_id, spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                         updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=["n1"])

    exited: asyncio.Queue[RankExited] = asyncio.Queue()

    def agent() -> RankSet:  # forking from zygotes, as an agent does
        return rank_set(tmp_path, Launcher(tmp_path / "zygotes", template=os.environ.get(
            settings.AGENT("zygote_template"))), exited)[0]

    first = agent()
    await first.reconcile(group("unwatched"))
    await first.reconcile(group("adopted"))
    pids = {}
    for entry in first.ranks.values():
        assert entry.watcher is not None
        entry.watcher.cancel()  # the first agent is gone
        pids[entry.job_id] = [entry.pid, *(m.pid for m in entry.group)]
    assert all(isinstance(p, ForkedProcess) for e in first.ranks.values()
               for _, _, _, p in e.processes())
    (tmp_path / "unwatched").touch()
    for pid in pids["unwatched"]:
        await asyncio.wait_for(pidfd.ended(pid), 30)
    second = agent()
    try:
        await second.adopt()
        end = await asyncio.wait_for(exited.get(), 30)
        assert (end.job_id, end.exit_code, end.cause) == ("unwatched", 0, ExitCause.EXITED)
        assert list(second.ranks) == [("adopted", 0)]
        (tmp_path / "adopted").touch()
        end = await asyncio.wait_for(exited.get(), 30)
        assert (end.job_id, end.exit_code, end.cause) == ("adopted", 0, ExitCause.EXITED)
        assert second.ranks == {}
        assert not any((tmp_path / "exits").glob("*/*"))  # each removed once reported
    finally:
        await second.stop_all()
        await first.launcher.close()
        await second.launcher.close()
