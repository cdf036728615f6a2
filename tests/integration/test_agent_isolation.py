"""One job cannot touch another on a node: a real agent runs each job as a user of its own.

An agent (a process, root, with ``agent.job_uids`` and the cluster's keys as
``phalanx auth kubernetes`` writes them) runs a victim job, started cold, and an attacker
job, forked from the agent's zygote (isolation_probe.py). The attacker's attempts on
the agent's keys, the victim's snapshot buffer, its ``/proc/<pid>/environ`` and its
rendezvous store each fail with a permission error, while the victim uses all of its
own.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from job_users import JOB_UIDS, reachable
from proc_tree import until
from process_env import shared_environment
from test_agent_replicas import queue_of

from phalanx.bus.client import Bus
from phalanx.bus.kv import TypedKV
from phalanx.schemas import settings, subjects
from phalanx.schemas.messages import (
    CheckpointPolicy,
    JobRecord,
    JobSpec,
    JobState,
    RankStarted,
    ReasonCode,
    ReplicaRange,
    SnapshotReservation,
    SnapshotReserve,
)
from phalanx.services.agent.identity import USERS_FILE, private_roots
from phalanx.services.natsd import NatsServer

pytestmark = pytest.mark.timeout(120)
PROBE = Path(__file__).resolve().parent / "isolation_probe.py"
FIRST_UID, LAST_UID = (int(n) for n in JOB_UIDS.split("-"))


@dataclass
class Node:
    """An agent process running jobs as their own users, and what it was given."""

    node_id: str
    work_dir: Path
    keys: list[Path]  # every secret file `phalanx auth init` wrote: the agent's keys
    jobs: TypedKV[JobRecord]

    async def put(self, bus: Bus, record: JobRecord) -> None:
        """Store ``record`` and announce it, as admission does."""
        await self.jobs.put(record.job_id, record)
        await bus.publish(subjects.job_state(record.job_id), record)

    def said(self, job_id: str) -> list[dict[str, Any]]:
        """The JSON lines job ``job_id``'s replica r0-0 printed so far."""
        path = self.work_dir / "jobs" / job_id / "r0-0.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.startswith("{")]

    async def saying(self, job_id: str, key: str) -> dict[str, Any]:
        """The first line of job ``job_id``'s replica that holds ``key``, once printed."""
        found: dict[str, Any] = await until(
            lambda: next((line for line in self.said(job_id) if key in line), None))
        return found


def job(job_id: str, node_id: str, command: list[str], env: dict[str, str] | None = None,
        state: JobState = JobState.ADMITTED, spares: int = 0) -> JobRecord:
    spec = JobSpec(name="iso", team="t", priority_class="normal", command=command,
                   replicas=ReplicaRange(min=1, max=1), grace_period_s=2.0, env=env or {},
                   checkpoint=CheckpointPolicy(memory_every_steps=1), spares=spares)
    return JobRecord(job_id=job_id, spec=spec, state=state, submitted_at=1.0, updated_at=1.0,
                     reason_code=ReasonCode.ADMITTED, nodes=[node_id])


@pytest.fixture
async def node(bus: Bus, nats_server: NatsServer, uid: str,
               tmp_path: Path) -> AsyncIterator[Node]:
    """An agent with ``agent.job_uids``, and the keys of ``phalanx auth kubernetes`` (the
    agents' seed and rank token key among them) in a folder every user may enter (as a
    mounted Secret is): only the files' modes guard them."""
    shelf = Path(tempfile.mkdtemp(prefix="phalanx-keys-"))
    auth = shelf / "auth"
    subprocess.run([sys.executable, "-m", "phalanx.services.cli", "auth", "kubernetes",
                    str(auth)], check=True, capture_output=True, timeout=60)
    for folder in (shelf, auth, auth / "keys", auth / "tls"):
        folder.chmod(0o755)
    keys = sorted(p for p in auth.rglob("*") if p.is_file() and not p.stat().st_mode & 0o044)
    env = shared_environment()
    env.pop(settings.AGENT("zygote_template"), None)  # its zygote where the jobs' users reach
    env.update({settings.AGENT("job_uids"): JOB_UIDS,
                settings.AGENT("replica_key_file"): str(auth / "keys" / "replication.key")})
    work_dir = tmp_path / "agent"
    with (tmp_path / "agent.log").open("wb") as log:
        agent = await asyncio.create_subprocess_exec(
            *reachable([sys.executable, "-m", "phalanx.services.agent", "--node-id", uid,
                        "--slots", "4", "--heartbeat-interval", "0.2", "--nats",
                        nats_server.url, "--work-dir", str(work_dir)]),
            env=env, stdout=log, stderr=log, cwd=Path(__file__).resolve().parents[2])
    try:
        jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
        yield Node(uid, work_dir, keys, jobs)
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(agent.wait(), 30)
        except TimeoutError:
            agent.kill()
            await agent.wait()
        shutil.rmtree(shelf, ignore_errors=True)
    # A clean stop leaves none of the folders it made for jobs.
    assert not any(root.exists() for root in private_roots(uid, work_dir))


async def test_a_rank_of_one_job_cannot_touch_another_job_or_the_agent(
        bus: Bus, node: Node) -> None:
    victim_id, attacker_id = f"victim-{node.node_id}", f"attacker-{node.node_id}"
    started = await queue_of(bus, subjects.rank_started(victim_id), RankStarted)
    # The victim starts cold (a shell first), with a warm spare; the attacker is forked
    # from the zygote.
    await node.put(bus, job(victim_id, node.node_id, [
        "/bin/sh", "-c", f'exec "{sys.executable}" "{PROBE}" victim'], spares=1))
    victim_pid = (await asyncio.wait_for(started.get(), 60)).pid
    store = await node.saying(victim_id, "store")
    assert store["member_read"] == "mine"  # its own members use its store
    reserved = await bus.request(subjects.agent_snapshot(node.node_id), SnapshotReserve(
        job_id=victim_id, replica_id="r0-0", shard=0, shards=1, nbytes=4096),
        SnapshotReservation)
    snapshot = Path(reserved.paths[0])
    await node.saying(victim_id, "wrote")  # its own snapshot buffer is its to write

    await node.put(bus, job(attacker_id, node.node_id, [
        sys.executable, str(PROBE), "attacker"], env={
            "PROBE_FILES": os.pathsep.join(map(str, node.keys)),
            "PROBE_TOKEN_KEY": str(next(k for k in node.keys if k.name == "rank-token.key")),
            "PROBE_SNAPSHOT": str(snapshot), "PROBE_PID": str(victim_pid),
            "PROBE_STORE": store["store"]}))
    await node.saying(attacker_id, "done")

    victim, attacker = node.said(victim_id)[0], node.said(attacker_id)[0]
    for who in (victim, attacker):
        assert FIRST_UID <= who["uid"] <= LAST_UID and who["gid"] == who["uid"]
        assert who["groups"] == [] and who["umask"] == 0o077 and who["tmp_mode"] == "0o700"
        assert who["secret"]
    assert victim["uid"] != attacker["uid"]
    spare = await until(lambda: next((json.loads(line) for path in (
        node.work_dir / "jobs" / victim_id / "spares").glob("*.log")
        for line in path.read_text().splitlines() if line.startswith("{")), None))
    assert (spare["uid"], spare["home"]) == (victim["uid"], victim["home"])  # its job's
    assert attacker["dumpable"] == 0  # forked: not dumpable, whoever asks
    assert Path(attacker["tmpdir"]).parent == Path(attacker["home"]) != Path(victim["home"])

    attempts = {line["what"]: line for line in node.said(attacker_id) if "what" in line}
    names = {key.name for key in node.keys}
    assert {"agents.nk", "rank-token.key", "replication.key", "replication-key.pem"} <= names
    assert all(f"read {key}" in attempts for key in node.keys) and "mint a token" in attempts
    for what, result in attempts.items():
        assert result["permission"], f"{what}: {result}"
    assert attempts["connect store"]["raised"] == "StoreRefused"
    assert snapshot.read_bytes().startswith(b"victim's own")
    assert (snapshot.stat().st_uid, snapshot.parent.stat().st_mode & 0o777) == (
        victim["uid"], 0o700)

    # Once the jobs are over, nothing of them is left here and their uids are free again.
    for job_id in (victim_id, attacker_id):
        record = (await node.jobs.get(job_id)).value  # type: ignore[union-attr]
        await node.put(bus, job(job_id, node.node_id, record.spec.command,
                                state=JobState.CANCELLED))
    await until(lambda: json.loads((node.work_dir / USERS_FILE).read_text()) == {})
    assert not any(Path(who["home"]).exists() for who in (victim, attacker))
    assert not snapshot.parent.exists()
