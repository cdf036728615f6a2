"""``phalanx logs`` reads a job's replica logs over the bus, from the agents of the nodes
that hold them: from a machine that holds none of them (the CLI's data dir is empty), a
log longer than one reply, and ``-f`` picking up a replica started while it follows,
until the job's record ends. Real agents, a real server; the CLI runs as a process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import pytest

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RemoteError
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    LOG_CHUNK_BYTES,
    JobRecord,
    JobSpec,
    JobState,
    LogReply,
    LogRequest,
    RankStarted,
    ReasonCode,
    ReplicaRange,
)
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.logs import replica_log
from phalanx.services.agent.service import AgentService
from phalanx.services.natsd import NatsServer


async def cli(url: str, elsewhere: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.services.cli", "logs", *args, "--nats", url,
        "--data-dir", str(elsewhere), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)


async def logs(url: str, elsewhere: Path, *args: str) -> tuple[int, bytes, str]:
    proc = await cli(url, elsewhere, *args)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out, err.decode()


def write(work_dir: Path, job_id: str, replica: str, text: bytes) -> Path:
    path = replica_log(work_dir, job_id, replica)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return path


@pytest.fixture
async def nodes(bus_config: BusConfig, uid: str, tmp_path: Path):
    """Two agents that run no ranks here (the logs are written as theirs would be)."""
    agents = {node: AgentService(AgentConfig(
        node_id=node, slots=2, heartbeat_interval_s=0.2, launch=False,
        work_dir=str(tmp_path / node)), bus_config) for node in (f"a-{uid}", f"b-{uid}")}
    for agent in agents.values():
        await agent.start()
    yield {node: tmp_path / node for node in agents}
    for agent in agents.values():
        await agent.stop()


async def a_job(bus: Bus, job_id: str, state: JobState = JobState.ADMITTED) -> TypedKV:
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    spec = JobSpec(name="logs", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=2, max=2), command=["sleep", "600"])
    await jobs.put(job_id, JobRecord(
        job_id=job_id, spec=spec, state=state, submitted_at=1.0, updated_at=1.0,
        reason_code=ReasonCode.ADMITTED if state is JobState.ADMITTED
        else ReasonCode.FINISHED, reason="training completed at step 9",
        nodes=["n0", "n0"] if state is JobState.ADMITTED else []))
    return jobs


async def test_the_logs_come_over_the_bus_from_every_node_in_replica_order(
        bus: Bus, nats_server: NatsServer, nodes: dict[str, Path], uid: str,
        tmp_path: Path) -> None:
    job_id = f"logs-{uid}"
    (a, a_dir), (b, b_dir) = nodes.items()
    long = b"".join(b"line %d of a replacement's output\n" % i for i in range(20_000))
    assert len(long) > 2 * LOG_CHUNK_BYTES  # three replies at least
    write(a_dir, job_id, "r0-0", b"first\n")
    write(b_dir, job_id, "r0-1", long)
    write(a_dir, job_id, "r1-0", b"no newline at the end")
    jobs = await a_job(bus, job_id, JobState.FINISHED)
    elsewhere = tmp_path / "elsewhere"  # this machine holds no agent's work dir
    try:
        code, out, err = await logs(nats_server.url, elsewhere, job_id)
        assert code == 0, err
        assert out == (f"==> r0-0 on {a} <==\n".encode() + b"first\n"
                       + f"==> r0-1 on {b} <==\n".encode() + long
                       + f"==> r1-0 on {a} <==\n".encode() + b"no newline at the end")

        code, out, err = await logs(nats_server.url, elsewhere, job_id, "--replica", "r0-1")
        assert (code, out) == (0, long), err
        # No generation (not under the runtime): rank 0 is slot 0's latest replica.
        code, out, err = await logs(nats_server.url, elsewhere, job_id, "--rank", "0")
        assert (code, out) == (0, long), err

        # The last lines, found reading the log backwards (10,000 lines span two replies).
        for n in (3, 10_000):
            code, out, err = await logs(nats_server.url, elsewhere, job_id, "--replica",
                                        "r0-1", "--tail", str(n))
            assert (code, out) == (0, b"".join(long.splitlines(keepends=True)[-n:])), err
        code, out, err = await logs(nats_server.url, elsewhere, job_id, "--tail", "1")
        assert out == (f"==> r0-0 on {a} <==\n".encode() + b"first\n"
                       + f"==> r0-1 on {b} <==\n".encode() + long.splitlines(True)[-1]
                       + f"==> r1-0 on {a} <==\n".encode() + b"no newline at the end")

        code, out, err = await logs(nats_server.url, elsewhere, job_id, "--replica", "r5-0")
        assert code != 0 and f"no agent holds a log of replica r5-0 of '{job_id}'" in err
        code, out, err = await logs(nats_server.url, elsewhere, f"none-{uid}")
        assert code != 0 and f"no job 'none-{uid}'" in err
    finally:
        await jobs.delete(job_id)


async def test_an_agent_refuses_a_request_that_names_a_path(
        bus: Bus, nodes: dict[str, Path], uid: str) -> None:
    """Ids are tokens: a replica named like a path never reaches the file system."""
    node, work_dir = next(iter(nodes.items()))
    write(work_dir, "secret", "r0-0", b"another job's\n")
    request = msgspec.msgpack.encode({"type": LogRequest.wire_name(), "job_id": f"j-{uid}",
                                      "replica_id": "../secret/r0-0"})
    reply = await bus.nc.request(subjects.agent_logs(node), request, timeout=10)
    assert reply.headers and reply.headers.get("Nats-Service-Error-Code") == "400", reply
    assert "replica_id" in reply.headers.get("Nats-Service-Error", "")
    with pytest.raises(RemoteError, match="404"):
        await bus.request(subjects.agent_logs(node),
                          LogRequest(job_id=f"j-{uid}", replica_id="r0-0"), LogReply)


async def test_follow_takes_in_a_replica_started_meanwhile_until_the_job_ends(
        bus: Bus, nats_server: NatsServer, nodes: dict[str, Path], uid: str,
        tmp_path: Path) -> None:
    job_id = f"follow-{uid}"
    (_, a_dir), (b, b_dir) = nodes.items()
    first = write(a_dir, job_id, "r0-0", b"step 1\n")
    jobs = await a_job(bus, job_id)
    follower = await cli(nats_server.url, tmp_path / "elsewhere", job_id, "-f")
    assert follower.stdout is not None
    try:
        assert await asyncio.wait_for(follower.stdout.readline(), 30) == b"r0-0 | step 1\n"
        with first.open("ab") as log:
            log.write(b"step 2\nstep 3 begun")
        assert await asyncio.wait_for(follower.stdout.readline(), 30) == b"r0-0 | step 2\n"
        # A replacement on the other node: its start is announced, its log followed.
        write(b_dir, job_id, "r0-1", b"joined\n")
        await bus.publish(subjects.rank_started(job_id), RankStarted(
            job_id=job_id, rank=0, world_size=2, node_id=b, pid=1, started_at=1.0,
            replica_id="r0-1"))
        assert await asyncio.wait_for(follower.stdout.readline(), 30) == b"r0-1 | joined\n"
        with first.open("ab") as log:
            log.write(b" and ended")  # written last, without its newline
        record = (await jobs.get(job_id)).value
        await jobs.put(job_id, msgspec.structs.replace(
            record, state=JobState.FINISHED, reason_code=ReasonCode.FINISHED,
            reason="training completed at step 3"))
        rest, err = await asyncio.wait_for(follower.communicate(), 30)
        assert follower.returncode == 0, err
        assert rest == b"r0-0 | step 3 begun and ended\n"
        assert err.decode().endswith(
            f"=== phalanx: {job_id} finished: training completed at step 3\n")
    finally:
        if follower.returncode is None:
            follower.kill()
            await follower.wait()
        await jobs.delete(job_id)
