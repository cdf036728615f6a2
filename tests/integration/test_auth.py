"""Bus permissions on a real nats-server started with ``phalanx auth init``'s config.

Each denial is proven twice: the server answers the publish (or subscription)
with a permission violation, and a viewer subscribed to every phalanx subject
receives nothing of it — the publisher's next, allowed message arrives and the
denied one never came before it (one connection's messages keep their order).
The allowed paths run through the real services: admission, health, elasticity
and an agent, each as its own identity, and a rank the agent launches as its
job's identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import nats.js.errors
import pytest

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import BusUnavailable, PermissionDenied, RemoteError
from phalanx.bus.kv import TypedKV
from phalanx.bus.stream import EventReader, ensure_job_events, last_seq
from phalanx.schemas import subjects
from phalanx.schemas.codec import decode
from phalanx.schemas.messages import (
    CatalogStep,
    CheckpointCatalog,
    ExitCause,
    Generation,
    GenerationReason,
    JobRecord,
    JobSpec,
    JobState,
    Member,
    NodeHeartbeat,
    NodeInfo,
    NodeRecord,
    RankExited,
    RankProgress,
    ReplicaRange,
    ReplicaReady,
    ShardCopy,
    SnapshotTier,
)
from phalanx.services.admission.config import AdmissionConfig
from phalanx.services.admission.service import AdmissionService
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService
from phalanx.services.auth.issuer import AuthDir
from phalanx.services.auth.roles import Role
from phalanx.services.base import Service
from phalanx.services.client import AdmissionClient
from phalanx.services.elasticity.core import ElasticityCore
from phalanx.services.elasticity.service import ElasticityService
from phalanx.services.health.core import HealthPolicy
from phalanx.services.health.service import HealthService
from phalanx.services.natsd import NatsServer, reload_config

Connect = Callable[..., Awaitable[Bus]]
NODES = ("node-a", "node-b", "node-c")  # node-c: the services' agent
JOBS = ("job-a", "job-b", "job-run", "job-view")  # each test its own


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> AuthDir:
    auth = AuthDir.init(tmp_path_factory.mktemp("auth") / "auth", nodes=NODES)
    for job in JOBS:
        auth.add(Role.RANK, job)
    return auth


@pytest.fixture(scope="module")
def secured(auth: AuthDir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    root = tmp_path_factory.mktemp("secured")
    with NatsServer(root / "js", port=0, log_path=root / "nats.log",
                    config_file=auth.config_path) as server:
        yield server


def config_for(auth: AuthDir, server: NatsServer, role: Role,
               scope: str | None = None) -> BusConfig:
    return BusConfig.load(env=auth.env(role, scope), servers=[server.url])


@pytest.fixture
async def connect(auth: AuthDir, secured: NatsServer) -> AsyncIterator[Connect]:
    """``await connect(role, scope)``: a Bus connected as that identity, closed after."""
    opened: list[Bus] = []

    async def connect(role: Role, scope: str | None = None) -> Bus:
        bus = await Bus.connect(config_for(auth, secured, role, scope), name=f"test-{role}")
        opened.append(bus)
        return bus

    yield connect
    for bus in opened:
        await bus.close()


@pytest.fixture
async def watcher(connect: Connect) -> Watcher:
    return await Watcher().start(await connect(Role.VIEWER))


class Watcher:
    """A viewer subscribed to every phalanx subject, recording what arrives in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._waiting: dict[str, asyncio.Event] = {}

    async def start(self, viewer: Bus) -> Watcher:
        async def on_message(msg) -> None:
            self.seen.append(msg.subject)
            if msg.subject in self._waiting:
                self._waiting[msg.subject].set()

        await viewer.nc.subscribe(subjects.everything(), cb=on_message)
        await viewer.nc.flush()
        return self

    async def until(self, subject: str) -> list[str]:
        """What arrived up to and including the first message on ``subject``."""
        event = self._waiting.setdefault(subject, asyncio.Event())
        if subject not in self.seen:
            await asyncio.wait_for(event.wait(), 5)
        return self.seen[:self.seen.index(subject) + 1]


async def assert_refused(bus: Bus, subject: str, action: Awaitable[object],
                         what: str = "publish") -> None:
    """The server refuses ``bus`` the publish (or subscription) ``action`` makes."""
    with bus.refusal(subject, what) as refused:
        await action
        await asyncio.wait_for(refused, 5)


def forge(bus: Bus, subject: str) -> Awaitable[None]:
    """A raw publish on ``subject``: what the server allows does not depend on the payload."""
    return bus.nc.publish(subject, b"forged")


def progress(job: str, rank: int = 0) -> RankProgress:
    return RankProgress(job_id=job, rank=rank, replica_id=f"r{rank}-0", generation=0, step=1,
                        step_time_s=0.1, sent_at=time.time())


# --- ranks ---------------------------------------------------------------------------------


async def test_a_rank_publishes_its_own_jobs_progress_and_nothing_for_another_job(
        connect: Connect, watcher: Watcher) -> None:
    rank_a = await connect(Role.RANK, "job-a")
    forged = (subjects.job_fault("job-b"), subjects.job_fault("job-a"),
              subjects.health_rank("job-b", 0), subjects.replica_ready("job-b"),
              subjects.job_state("job-a"), subjects.node_heartbeat("node-a"))
    for subject in forged:
        await assert_refused(rank_a, subject, forge(rank_a, subject))
    await rank_a.publish(subjects.health_rank("job-a", 0), progress("job-a"))
    # The allowed report arrives, and none of the refused ones came before it.
    assert await watcher.until(subjects.health_rank("job-a", 0)) == [
        subjects.health_rank("job-a", 0)]


async def test_a_rank_hears_only_its_own_job_and_reads_no_one_elses_replies(
        connect: Connect) -> None:
    rank_a = await connect(Role.RANK, "job-a")
    for subject in (subjects.job_generation("job-b"), subjects.job_fault("job-b"),
                    "_INBOX.>", f"{subjects.inbox('cli')}.>"):
        await assert_refused(rank_a, subject, rank_a.nc.subscribe(subject), "subscription")
    heard = await rank_a.nc.subscribe(subjects.job_generation("job-a"))
    await rank_a.nc.flush()
    elasticity = await connect(Role.ELASTICITY)
    await elasticity.publish(subjects.job_generation("job-a"), generation("job-a"))
    assert (await heard.next_msg(timeout=5)).subject == subjects.job_generation("job-a")


async def test_a_rank_cannot_speak_for_another_job_from_its_own_subject(
        connect: Connect) -> None:
    """Permissions are per subject: a payload naming another job is refused on decode."""
    elasticity = await connect(Role.ELASTICITY)
    await ensure_job_events(elasticity)
    start = await last_seq(elasticity) + 1
    rank_a = await connect(Role.RANK, "job-a")
    for job in ("job-b", "job-a"):  # the forged one first: the stream keeps the order
        await rank_a.publish_event(subjects.replica_ready("job-a"), ReplicaReady(
            job_id=job, replica_id="r0-0", slot=0, node_id="node-a", endpoint="h:1"),
            event_id=f"ready-{job}-from-job-a")
    reader = await EventReader(elasticity, start, frozenset({"ready"})).start()
    try:
        event = await asyncio.wait_for(anext(aiter(reader)), 10)
    finally:
        await reader.close()
    assert event.message.job_id == "job-a"
    assert elasticity.counters.bad_messages == 1
    assert "names job 'job-b'" in elasticity.counters.last_error


def generation(job: str, number: int = 0) -> Generation:
    return Generation(job_id=job, generation=number, world_size=1, rendezvous=f"{job}-g{number}",
                      resume_step=0, reason=GenerationReason.START,
                      members=[Member(replica_id="r0-0", rank=0, node_id="node-a",
                                      endpoint="h:1")])


async def test_a_rank_stores_its_readiness_and_reads_its_generation(connect: Connect) -> None:
    elasticity = await connect(Role.ELASTICITY)
    await ensure_job_events(elasticity)
    generations = await TypedKV.open(elasticity.js, subjects.GENERATIONS_BUCKET, Generation)
    await generations.put("job-a", generation("job-a", 3))
    rank_a = await connect(Role.RANK, "job-a")
    stored = await TypedKV.open(rank_a.js, subjects.GENERATIONS_BUCKET, Generation)
    entry = await stored.get("job-a")
    assert entry is not None and entry.value.generation == 3
    ready = ReplicaReady(job_id="job-a", replica_id="r0-0", slot=0, node_id="node-a",
                         endpoint="h:1", sent_at=time.time())
    assert await rank_a.publish_event(subjects.replica_ready("job-a"), ready,
                                      event_id="ready-job-a-1") > 0
    # Writing the bucket is elasticity's: a rank cannot advance its own generation.
    key = subjects.kv_key(subjects.GENERATIONS_BUCKET, "job-a")
    await assert_refused(rank_a, key, forge(rank_a, key))


# --- agents --------------------------------------------------------------------------------


def node_record(node: str, seq: int) -> NodeRecord:
    now = time.time()
    return NodeRecord(node=NodeInfo(node_id=node, host="h", slots=1, failure_domain="d",
                                    agent_pid=1, agent_version="t", started_at=now),
                      heartbeat_seq=seq, heartbeat_at=now)


async def test_an_agent_cannot_impersonate_another_node(connect: Connect,
                                                         watcher: Watcher) -> None:
    agent_a = await connect(Role.AGENT, "node-a")
    agent_b = await connect(Role.AGENT, "node-b")
    nodes_b = await TypedKV.open(agent_b.js, subjects.NODES_BUCKET, NodeRecord)
    await nodes_b.put("node-b", node_record("node-b", 7))

    heartbeat_b = subjects.node_heartbeat("node-b")
    await assert_refused(agent_a, heartbeat_b, forge(agent_a, heartbeat_b))
    # Its registry entry, through the KV API: a publish on the key's subject, refused
    # (so never acknowledged).
    nodes_a = await TypedKV.open(agent_a.nc.jetstream(timeout=0.5), subjects.NODES_BUCKET,
                                 NodeRecord)
    nodes_a.failover_s = 0  # no answer here is a refusal, not an election: no 15 s retry
    with pytest.raises(nats.errors.TimeoutError):
        await assert_refused(agent_a, subjects.kv_key(subjects.NODES_BUCKET, "node-b"),
                             nodes_a.put("node-b", node_record("node-b", 99)))
    # Nor serve another node's endpoints.
    launch_b = subjects.agent_launch("node-b")
    await assert_refused(agent_a, launch_b, agent_a.nc.subscribe(launch_b), "subscription")

    await nodes_a.put("node-a", node_record("node-a", 1))  # its own entry: allowed
    await agent_a.publish(subjects.node_heartbeat("node-a"), NodeHeartbeat(
        node_id="node-a", seq=1, sent_at=time.time()))
    assert heartbeat_b not in await watcher.until(subjects.node_heartbeat("node-a"))
    entry = await nodes_b.get("node-b")
    assert entry is not None and entry.value.heartbeat_seq == 7


# --- the services, the operator and the viewer -----------------------------------------------

RANK_SCRIPT = """
from phalanx.runtime.progress import ProgressReporter
with ProgressReporter.from_env() as reporter:
    for step in range(1, 4):
        reporter.report(step, 0.01, final=step == 3)
"""


@pytest.fixture
async def services(auth: AuthDir, secured: NatsServer,
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[None]:
    """Admission, health, elasticity and node-c's agent, each as its own identity."""
    started: list[Service] = []
    work_dir = tmp_path_factory.mktemp("agent")
    for make in (
            lambda: AdmissionService(AdmissionConfig(lease_s=1.0),
                                     config_for(auth, secured, Role.ADMISSION), instance="a0"),
            lambda: HealthService(HealthPolicy(), config_for(auth, secured, Role.HEALTH),
                                  instance="h0", lease_s=1.0),
            lambda: ElasticityService(ElasticityCore,
                                      config_for(auth, secured, Role.ELASTICITY),
                                      instance="e0", lease_s=1.0),
            lambda: AgentService(AgentConfig(
                node_id="node-c", slots=2, heartbeat_interval_s=0.2, lost_after_s=3.0,
                work_dir=str(work_dir), rank_keys_dir=str(auth.ranks_dir)),
                config_for(auth, secured, Role.AGENT, "node-c"))):
        service = make()
        await service.start()  # a permission it lacks would fail its setup
        started.append(service)
    yield
    for service in reversed(started):
        await service.stop()


def job_spec(name: str) -> JobSpec:
    return JobSpec(name=name, team="t", priority_class="normal",
                   replicas=ReplicaRange(min=1, max=1),
                   command=[sys.executable, "-c", RANK_SCRIPT])


async def wait_state(viewer: Bus, job_id: str, state: JobState) -> None:
    jobs = await TypedKV.open(viewer.js, subjects.JOBS_BUCKET, JobRecord)
    async with contextlib.aclosing(jobs.watch()) as changes:  # stops its consumer
        async for change in changes:
            if change is not None and change.key == job_id and change.value is not None \
                    and change.value.state is state:
                return


@pytest.mark.usefixtures("services")
async def test_the_operator_submits_a_job_whose_ranks_run_as_the_job(connect: Connect) -> None:
    cli = AdmissionClient(await connect(Role.CLI))
    viewer = await connect(Role.VIEWER)
    reports = await viewer.nc.subscribe(subjects.health_job_ranks("job-run"))
    record = await cli.submit(job_spec("auth"), "job-run")
    assert record.state is JobState.PENDING
    # The rank reports progress: only the job's identity may, so the agent gave it that
    # (as the agent, or as nobody, it would have been refused).
    assert decode((await reports.next_msg(timeout=10)).data, RankProgress).job_id == "job-run"
    await reports.unsubscribe()  # with reports left unread, closing would wait for them
    # Health saw every rank exit 0 and finished the job: its job-record writes are allowed.
    await asyncio.wait_for(wait_state(viewer, "job-run", JobState.FINISHED), 20)


@pytest.mark.usefixtures("services")
async def test_a_job_without_an_identity_does_not_start_as_anyone_else(
        connect: Connect, watcher: Watcher) -> None:
    cli = AdmissionClient(await connect(Role.CLI))
    viewer = await connect(Role.VIEWER)
    exits = await viewer.nc.subscribe(subjects.rank_exited("no-key"))
    await cli.submit(job_spec("auth"), "no-key")
    exited = decode((await exits.next_msg(timeout=10)).data, RankExited)
    assert exited.cause is ExitCause.LAUNCH_FAILED and "no-key.nk is missing" in exited.detail
    assert not any(seen.startswith(subjects.health_job_ranks("no-key")[:-1])
                   for seen in watcher.seen)


@pytest.mark.usefixtures("services")
async def test_a_viewer_reads_but_cannot_submit_or_cancel(connect: Connect) -> None:
    cli = AdmissionClient(await connect(Role.CLI))
    await cli.submit(job_spec("auth"), "job-view")
    viewer_bus = await connect(Role.VIEWER)
    viewer = AdmissionClient(viewer_bus)
    assert (await viewer.explain("job-view")).job_id == "job-view"
    assert (await viewer.job("job-view")) is not None
    with pytest.raises(PermissionDenied):
        await viewer.cancel("job-view")
    with pytest.raises(PermissionDenied):
        await viewer.submit(job_spec("auth"), "job-c")
    with pytest.raises(PermissionDenied):
        await viewer.scale("job-view", 1)
    # The operator may scale: admission answers (and refuses a rigid job by its rules).
    with pytest.raises(RemoteError, match="rigid"):
        await cli.scale("job-view", 1)
    # Nor around admission, straight into the jobs bucket where cancellations are stored.
    key = subjects.kv_key(subjects.JOBS_BUCKET, "job-view")
    await assert_refused(viewer_bus, key, forge(viewer_bus, key))
    assert (await viewer.job("job-c")) is None
    assert (await viewer.job("job-view")).state is not JobState.CANCELLED
    assert (await cli.cancel("job-view")).state is JobState.CANCELLED


async def test_the_operator_and_the_viewer_read_the_checkpoint_catalog(
        auth: AuthDir, secured: NatsServer, connect: Connect) -> None:
    checkpoint = await connect(Role.CHECKPOINT)
    catalogs = await TypedKV.open(checkpoint.js, subjects.CHECKPOINTS_BUCKET, CheckpointCatalog)
    copy = ShardCopy(shard=0, node_id="node-a", tier=SnapshotTier.LOCAL, nbytes=8,
                     checksum="00000000000000aa")
    await catalogs.put("job-a", CheckpointCatalog(job_id="job-a", steps=[
        CatalogStep(step=7, shards=1, total_bytes=8, copies=[copy])]))
    env = {**os.environ, **auth.env(Role.CLI), "PHALANX_NATS_URL": secured.url}
    listed = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "phalanx.services.cli", "ckpt", "ls", "job-a", "--json"],
        capture_output=True, text=True, timeout=60, env=env)
    assert listed.returncode == 0, listed.stderr
    assert [row["step"] for row in json.loads(listed.stdout)] == [7]
    viewer = await connect(Role.VIEWER)
    seen = await (await TypedKV.open(viewer.js, subjects.CHECKPOINTS_BUCKET,
                                     CheckpointCatalog)).get("job-a")
    assert seen is not None and seen.value.steps[0].copies == [copy]
    key = subjects.kv_key(subjects.CHECKPOINTS_BUCKET, "job-a")
    for reader in (await connect(Role.CLI), viewer):  # the catalog is the service's to write
        await assert_refused(reader, key, forge(reader, key))


# --- the auth directory ----------------------------------------------------------------------


def test_auth_commands_print_no_seed_and_keep_seeds_private(tmp_path: Path) -> None:
    root = tmp_path / "auth"
    outputs = [cli("auth", "init", str(root), "--node", "n1", "--host", "bus.example"),
               cli("auth", "add-node", str(root), "n2"),
               cli("auth", "add-job", str(root), "j1"),
               cli("auth", "add-job", str(root), "j1")]  # again: it exists, nothing new
    assert "exists" in outputs[-1].stdout
    again = cli("auth", "init", str(root), check=False)
    assert again.returncode == 1 and "already holds an auth directory" in again.stderr
    seeds = sorted(root.rglob("*.nk"))
    assert len(seeds) == 6 + 2 + 1
    for path in seeds:
        assert path.stat().st_mode & 0o777 == 0o600
        seed = path.read_text()
        assert not any(seed[2:20] in o.stdout + o.stderr for o in [*outputs, again])
    # The server config holds public keys only.
    assert not any(path.read_text()[2:20] in (root / "nats.conf").read_text() for path in seeds)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "phalanx.services.cli", *args],
                            capture_output=True, text=True, timeout=60)
    assert not check or result.returncode == 0, result.stderr
    return result


async def test_a_revoked_identity_is_disconnected_and_cannot_come_back(
        auth: AuthDir, secured: NatsServer, connect: Connect, tmp_path: Path) -> None:
    """A job's identity revoked (as when the job ends) and the server reloaded: its
    connection is closed, and its seed no longer gets anyone in."""
    assert secured.process is not None
    auth.add(Role.RANK, "job-gone")
    reload_config(secured.process.pid)
    deadline = time.monotonic() + 10
    while True:  # the server admits the new identity once it has reloaded
        try:
            rank = await connect(Role.RANK, "job-gone")
            break
        except BusUnavailable:
            assert time.monotonic() < deadline
    kept = tmp_path / "job-gone.nk"
    kept.write_bytes(auth.seed_path(Role.RANK, "job-gone").read_bytes())
    env = {**auth.env(Role.RANK, "job-gone"), "PHALANX_NATS_NKEY": str(kept)}

    assert auth.remove(Role.RANK, "job-gone")
    assert not auth.remove(Role.RANK, "job-gone")  # nothing left to revoke
    assert not auth.seed_path(Role.RANK, "job-gone").exists()
    assert "rank-job-gone" not in {who.name for who in auth.identities()}
    reload_config(secured.process.pid)
    deadline = time.monotonic() + 10
    while rank.connected:  # no callback says so: the client notices the closed socket
        assert time.monotonic() < deadline, "the revoked identity stayed connected"
        await asyncio.sleep(0.1)
    # Refused: the server's answer, or its close of the socket, as the client sees it first.
    with pytest.raises(BusUnavailable,
                       match="Authorization Violation|Broken pipe|Connection reset by peer"):
        await Bus.connect(BusConfig.load(env=env, servers=[secured.url], connect_timeout_s=2.0))
    # The same way in with an identity that was not revoked works.
    await (await Bus.connect(config_for(auth, secured, Role.RANK, "job-a"))).close()
