"""Bus permissions on a real nats-server started with ``phalanx auth init``'s config.

Each denial is proven twice: the server answers the publish (or subscription)
with a permission violation, and a viewer subscribed to every phalanx subject
receives nothing of it — the publisher's next, allowed message arrives and the
denied one never came before it (one connection's messages keep their order).
The allowed paths run through the real services: admission, health, elasticity
and an agent, each as its own identity, and a rank the agent launches as its
job's identity.

The Kubernetes form runs on a second server configured as the chart's values
configure it (``phalanx auth kubernetes``): the static identities as NKEY users,
every other connection asked about through the auth callout, which the real
callout service answers. A rank connects with the token its agent minted for its
job and gets exactly its job's rank role; a forged, expired, unknown or ended job's
token gets nothing, and a job that ends gets no new connection and loses an open
one when its token expires.
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
from typing import Any

import msgspec
import nats.js.errors
import pytest

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import BusUnavailable, PermissionDenied, RemoteError
from phalanx.bus.kv import TypedKV
from phalanx.bus.stream import EventReader, ensure_job_events, last_seq
from phalanx.schemas import subjects
from phalanx.schemas.codec import decode
from phalanx.schemas.messages import (
    MAX_REPLICAS,
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
    ReasonCode,
    ReplicaRange,
    ReplicaReady,
    ShardCopy,
    SnapshotTier,
)
from phalanx.services.admission.config import AdmissionConfig
from phalanx.services.admission.service import AdmissionService
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService
from phalanx.services.auth import kubernetes, rank_token
from phalanx.services.auth.callout import Decision, Refusal
from phalanx.services.auth.credentials import token_rank_env
from phalanx.services.auth.issuer import AuthDir, new_seed, server_config
from phalanx.services.auth.replication_key import load_key
from phalanx.services.auth.roles import ANY, Role
from phalanx.services.base import Service
from phalanx.services.callout.config import CalloutConfig
from phalanx.services.callout.service import CalloutService
from phalanx.services.client import AdmissionClient
from phalanx.services.elasticity.core import ElasticityCore
from phalanx.services.elasticity.service import ElasticityService
from phalanx.services.health.core import HealthPolicy
from phalanx.services.health.service import HealthService
from phalanx.services.natsd import NatsCluster, NatsServer, reload_config

Connect = Callable[..., Awaitable[Bus]]
NODES = ("node-a", "node-b", "node-c")  # node-c: the services' agent
JOBS = ("job-a", "job-b", "job-run", "job-view", "job-big")  # each test its own


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


@contextlib.asynccontextmanager
async def connections(auth: AuthDir, server: NatsServer, name: str) -> AsyncIterator[Connect]:
    """``await connect(role, scope)``: a Bus connected to ``server`` as that identity of
    ``auth``, closed on the way out."""
    opened: list[Bus] = []

    async def connect(role: Role, scope: str | None = None) -> Bus:
        bus = await Bus.connect(config_for(auth, server, role, scope), name=f"{name}-{role}")
        opened.append(bus)
        return bus

    try:
        yield connect
    finally:
        for bus in opened:
            await bus.close()


@pytest.fixture
async def connect(auth: AuthDir, secured: NatsServer) -> AsyncIterator[Connect]:
    """``await connect(role, scope)``: a Bus connected as that identity, closed after."""
    async with connections(auth, secured, "test") as connect:
        yield connect


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
              subjects.job_state("job-a"), subjects.node_heartbeat("node-a"),
              # It may have its own job's snapshot shards fetched, no other job's.
              subjects.agent_fetch("node-a", "job-b"))
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


async def test_a_rank_reads_a_generation_stored_in_chunks_as_its_job(
        connect: Connect) -> None:
    """A generation past one payload (16,384 members): elasticity stores its chunks and
    publishes the pointer as itself; the job's rank reads it whole from the bucket and
    gets it whole on its subject, with its own identity's grants."""
    elasticity = await connect(Role.ELASTICITY)
    big = msgspec.structs.replace(
        generation("job-big", 1), world_size=MAX_REPLICAS,
        members=[Member(replica_id=f"r{i}-0", rank=i, node_id=f"node-{i // 8}",
                        endpoint=f"10.0.{i // 256}.{i % 256}:29500")
                 for i in range(MAX_REPLICAS)])
    rank = await connect(Role.RANK, "job-big")
    got: asyncio.Queue[Generation] = asyncio.Queue()

    async def on_generation(g: Generation, _: Delivery) -> None:
        got.put_nowait(g)

    await rank.subscribe(subjects.job_generation("job-big"), Generation, on_generation)
    await rank.nc.flush()
    generations = await TypedKV.open(elasticity.js, subjects.GENERATIONS_BUCKET, Generation)
    await generations.put("job-big", big)
    pointer = generations.pointer("job-big")
    assert pointer is not None and pointer.chunks >= 2
    await elasticity.publish(subjects.job_generation("job-big"), pointer)
    assert await asyncio.wait_for(got.get(), 10) == big
    entry = await (await TypedKV.open(rank.js, subjects.GENERATIONS_BUCKET,
                                      Generation)).get("job-big")
    assert entry is not None and entry.value == big


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
    # Nor serve another node's endpoints, its fetches included.
    for endpoint in (subjects.agent_launch("node-b"), subjects.agent_fetches("node-b")):
        await assert_refused(agent_a, endpoint, agent_a.nc.subscribe(endpoint),
                             "subscription")
    # Its own fetches it serves: a rank's request reaches it.
    fetches = await agent_a.nc.subscribe(subjects.agent_fetches("node-a"))
    rank = await connect(Role.RANK, "job-a")
    await rank.nc.publish(subjects.agent_fetch("node-a", "job-a"), b"asked")
    assert (await fetches.next_msg(timeout=5)).data == b"asked"

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


@contextlib.asynccontextmanager
async def running_services(auth: AuthDir, server: NatsServer, work_dir: Path,
                           agent_scope: str = "node-c", **agent: Any) -> AsyncIterator[None]:
    """Admission, health, elasticity and an agent (identity ``agent_scope``, settings
    ``agent``), each as its own identity."""
    started: list[Service] = []
    try:
        for make in (
                lambda: AdmissionService(AdmissionConfig(lease_s=1.0),
                                         config_for(auth, server, Role.ADMISSION),
                                         instance="a0"),
                lambda: HealthService(HealthPolicy(), config_for(auth, server, Role.HEALTH),
                                      instance="h0", lease_s=1.0),
                lambda: ElasticityService(ElasticityCore,
                                          config_for(auth, server, Role.ELASTICITY),
                                          instance="e0", lease_s=1.0),
                lambda: AgentService(AgentConfig(
                    node_id="node-c", slots=2, heartbeat_interval_s=0.2, lost_after_s=3.0,
                    work_dir=str(work_dir), **agent),
                    config_for(auth, server, Role.AGENT, agent_scope))):
            service = make()
            await service.start()  # a permission it lacks would fail its setup
            started.append(service)
        yield
    finally:
        for service in reversed(started):
            await service.stop()


@pytest.fixture
async def services(auth: AuthDir, secured: NatsServer,
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[None]:
    """Admission, health, elasticity and node-c's agent, each as its own identity."""
    async with running_services(auth, secured, tmp_path_factory.mktemp("agent"),
                                rank_keys_dir=str(auth.ranks_dir)):
        yield


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


# --- the Kubernetes form: the auth callout admits each job's ranks as their job -------------

@pytest.fixture(scope="module")
def k8s_auth(tmp_path_factory: pytest.TempPathFactory) -> AuthDir:
    """What ``phalanx auth kubernetes`` makes: static identities, the callout's keys."""
    return kubernetes.prepare(tmp_path_factory.mktemp("k8s") / "auth", "phalanx")


def chart_config(auth: AuthDir, path: Path) -> Path:
    """Write at ``path`` a server config as the chart's values make it: TLS on the client
    port and the values' ``config.merge`` (NKEY users, the auth callout, the system
    account)."""
    config = {**server_config(auth.identities(), auth.tls_dir),
              **kubernetes.nats_values(auth)["config"]["merge"]}  # type: ignore[index]
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def k8s_server(k8s_auth: AuthDir,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A server configured as the chart's values configure it: TLS on the client port and
    the values' ``authorization`` block (NKEY users, and the auth callout)."""
    root = tmp_path_factory.mktemp("k8s-server")
    chart_config(k8s_auth, root / "nats.conf")
    with NatsServer(root / "js", port=0, log_path=root / "nats.log",
                    config_file=root / "nats.conf") as server:
        yield server


@pytest.fixture(scope="module")
async def callout_service(k8s_auth: AuthDir, k8s_server: NatsServer
                          ) -> AsyncIterator[CalloutService]:
    service = CalloutService(CalloutConfig(
        issuer_seed_file=str(k8s_auth.callout_issuer_path),
        token_key_file=str(k8s_auth.rank_token_key_path)),
        config_for(k8s_auth, k8s_server, Role.CALLOUT), instance="c0")
    await service.start()
    yield service
    await service.stop()


@pytest.fixture
async def k8s_connect(k8s_auth: AuthDir, k8s_server: NatsServer,
                      callout_service: CalloutService) -> AsyncIterator[Connect]:
    """``await k8s_connect(role)``: a Bus connected as that static identity."""
    async with connections(k8s_auth, k8s_server, "k") as connect:
        yield connect


@contextlib.contextmanager
def recording(service: CalloutService, queue: asyncio.Queue[Decision]) -> Iterator[None]:
    """Put each answer ``service`` gives into ``queue`` meanwhile."""
    answer = service.answer

    async def recorded(request: bytes) -> Decision:
        decision = await answer(request)
        queue.put_nowait(decision)
        return decision

    service.answer = recorded  # type: ignore[method-assign]
    try:
        yield
    finally:
        del service.answer


@pytest.fixture
def decisions(callout_service: CalloutService) -> Iterator[asyncio.Queue[Decision]]:
    """The callout's answers from now on, in order."""
    queue: asyncio.Queue[Decision] = asyncio.Queue()
    with recording(callout_service, queue):
        yield queue


def token_config(auth: AuthDir, server: NatsServer, job: str, *, key: bytes | None = None,
                 now: float | None = None, ttl_s: float = 600.0) -> BusConfig:
    """What an agent gives a rank of ``job``: a freshly minted token (with the cluster's key
    unless another is given)."""
    token = rank_token.mint(key or load_key(auth.rank_token_key_path), job,
                            now=time.time() if now is None else now, ttl_s=ttl_s,
                            nonce=os.urandom(rank_token.NONCE_BYTES))
    return BusConfig.load(env=token_rank_env(token, job, str(auth.ca_path)),
                          servers=[server.url], connect_timeout_s=2.0)


async def put_job(admission: Bus, job: str, state: JobState) -> None:
    jobs = await TypedKV.open(admission.js, subjects.JOBS_BUCKET, JobRecord)
    await jobs.put(job, JobRecord(job_id=job, spec=job_spec("k8s"), state=state,
                                  submitted_at=1.0, updated_at=time.time(),
                                  reason_code=ReasonCode.QUEUED,
                                  nodes=["node-x"] if state is JobState.ADMITTED else []))


REFUSED = "Authorization Violation|Broken pipe|Connection reset by peer"


async def test_a_rank_token_admits_its_job_s_rank_role_and_nothing_more(
        k8s_auth: AuthDir, k8s_server: NatsServer, k8s_connect: Connect,
        decisions: asyncio.Queue[Decision]) -> None:
    admission = await k8s_connect(Role.ADMISSION)
    for job in ("k8s-a", "k8s-b"):
        await put_job(admission, job, JobState.ADMITTED)
    await TypedKV.open(admission.js, subjects.GENERATIONS_BUCKET, Generation)  # as it does
    watcher = await Watcher().start(await k8s_connect(Role.VIEWER))
    rank_a = await Bus.connect(token_config(k8s_auth, k8s_server, "k8s-a"), name="rank-a")
    try:
        admitted = decisions.get_nowait()
        assert (admitted.job_id, admitted.refusal) == ("k8s-a", None)
        # Another job's progress and readiness, its own job's record and fault, a node's
        # heartbeat, a submission: refused.
        for subject in (subjects.health_rank("k8s-b", 0), subjects.replica_ready("k8s-b"),
                        subjects.job_state("k8s-a"), subjects.job_fault("k8s-a"),
                        subjects.node_heartbeat("node-a"), subjects.admission_submit(),
                        subjects.kv_key(subjects.JOBS_BUCKET, "k8s-a"),
                        subjects.auth_callout()):
            await assert_refused(rank_a, subject, forge(rank_a, subject))
        for subject in (subjects.job_generation("k8s-b"), subjects.auth_callout()):
            await assert_refused(rank_a, subject, rank_a.nc.subscribe(subject),
                                 "subscription")
        await rank_a.publish(subjects.health_rank("k8s-a", 0), progress("k8s-a"))
        assert await watcher.until(subjects.health_rank("k8s-a", 0)) == [
            subjects.health_rank("k8s-a", 0)]
        # Its job's generation it reads, as a rank does.
        stored = await TypedKV.open(rank_a.js, subjects.GENERATIONS_BUCKET, Generation)
        assert await stored.get("k8s-a") is None
    finally:
        await rank_a.close()
        # The server is the module's: a later test that starts admission and an agent
        # would otherwise restore these jobs, admitted on a node that does not exist,
        # requeue them onto its agent and wait behind them (seen: its rank never ran).
        for job in ("k8s-a", "k8s-b"):
            await put_job(admission, job, JobState.FINISHED)


async def test_a_forged_expired_or_ended_job_s_token_does_not_connect(
        k8s_auth: AuthDir, k8s_server: NatsServer, k8s_connect: Connect,
        decisions: asyncio.Queue[Decision]) -> None:
    admission = await k8s_connect(Role.ADMISSION)
    await put_job(admission, "k8s-live", JobState.ADMITTED)
    await put_job(admission, "k8s-done", JobState.FINISHED)
    for config, refusal in (
            (token_config(k8s_auth, k8s_server, "k8s-live", key=os.urandom(32)),
             Refusal.BAD_TOKEN),
            (token_config(k8s_auth, k8s_server, "k8s-live", now=time.time() - 120, ttl_s=60),
             Refusal.EXPIRED_TOKEN),
            (token_config(k8s_auth, k8s_server, "k8s-done"), Refusal.ENDED_JOB),
            (token_config(k8s_auth, k8s_server, "k8s-never"), Refusal.UNKNOWN_JOB),
            (BusConfig.load(env={"PHALANX_NATS_CA": str(k8s_auth.ca_path)},
                            servers=[k8s_server.url], connect_timeout_s=2.0),
             Refusal.NO_TOKEN)):
        with pytest.raises(BusUnavailable, match=REFUSED):
            await Bus.connect(config)
        asked = [decisions.get_nowait() for _ in range(decisions.qsize())]  # each try
        assert asked and {(d.job_id, d.refusal) for d in asked} == {(None, refusal)}, asked


async def test_static_identities_connect_without_the_callout(
        k8s_auth: AuthDir, k8s_server: NatsServer, k8s_connect: Connect,
        decisions: asyncio.Queue[Decision], tmp_path: Path) -> None:
    for role, scope in ((Role.HEALTH, None), (Role.CLI, None), (Role.AGENT, ANY)):
        bus = await k8s_connect(role, scope)
        assert await bus.round_trip(5.0)
    assert decisions.empty(), "the server asked about a static identity"
    # A key the config does not list is no static identity: asked about, and refused.
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(new_seed()[0])
    env = {**k8s_auth.env(Role.HEALTH), "PHALANX_NATS_NKEY": str(stranger)}
    with pytest.raises(BusUnavailable, match=REFUSED):
        await Bus.connect(BusConfig.load(env=env, servers=[k8s_server.url],
                                         connect_timeout_s=2.0))
    assert {d.refusal for d in [decisions.get_nowait() for _ in range(decisions.qsize())]} \
        == {Refusal.NO_TOKEN}


async def test_a_job_that_ends_gets_no_new_connection_and_loses_its_own_at_expiry(
        k8s_auth: AuthDir, k8s_server: NatsServer, k8s_connect: Connect,
        decisions: asyncio.Queue[Decision]) -> None:
    admission = await k8s_connect(Role.ADMISSION)
    await put_job(admission, "k8s-end", JobState.ADMITTED)
    rank = await Bus.connect(token_config(k8s_auth, k8s_server, "k8s-end", ttl_s=3.0),
                             name="rank-end")
    try:
        admitted = decisions.get_nowait()
        assert admitted.job_id == "k8s-end" and admitted.expires_at is not None
        assert admitted.expires_at <= time.time() + 3.0
        await put_job(admission, "k8s-end", JobState.FINISHED)
        # From now on no rank of the job gets in, whatever its token.
        with pytest.raises(BusUnavailable, match=REFUSED):
            await Bus.connect(token_config(k8s_auth, k8s_server, "k8s-end"))
        assert {d.refusal for d in [decisions.get_nowait() for _ in
                                    range(decisions.qsize())]} == {Refusal.ENDED_JOB}
        # The one already open ends when its token does: the server closes it (nats-py
        # then gives it up; no callback says so, so its state is watched).
        deadline = time.monotonic() + 10
        while rank.connected:
            assert time.monotonic() < deadline, "the expired connection stayed open"
            await asyncio.sleep(0.1)
    finally:
        await rank.close()


#: docs/security.md's bound on how long an ended job's rank connection stays open: the
#: revoker's default interval (it closes one at once when it sees the job end).
REVOKED_WITHIN_S = CalloutConfig(issuer_seed_file="-", token_key_file="-").revoke_interval_s


async def closed(disconnected: asyncio.Event, within_s: float) -> None:
    """Wait until the server closed a connection (nats-py then reconnects), as its
    :meth:`Bus.disconnect_event` tells."""
    try:
        await asyncio.wait_for(disconnected.wait(), within_s)
    except TimeoutError:
        raise AssertionError(f"still connected after {within_s:g} s") from None


async def test_an_ended_job_s_open_connection_is_closed_and_its_token_refused(
        k8s_auth: AuthDir, k8s_server: NatsServer, k8s_connect: Connect,
        decisions: asyncio.Queue[Decision]) -> None:
    """A callout holding the system account's user revokes: it closes the open rank
    connections of a job that ended before it started (a restarted callout, from the
    jobs' records alone) and of one that ends while it runs (at once: its interval here
    is an hour). Each rank's client reconnects with its token, and is refused: its job
    ended."""
    admission = await k8s_connect(Role.ADMISSION)
    for job in ("k8s-gone", "k8s-ends"):
        await put_job(admission, job, JobState.ADMITTED)
    gone = await Bus.connect(token_config(k8s_auth, k8s_server, "k8s-gone"), name="rank-gone")
    ends = await Bus.connect(token_config(k8s_auth, k8s_server, "k8s-ends"), name="rank-ends")
    assert [decisions.get_nowait().job_id for _ in range(2)] == ["k8s-gone", "k8s-ends"]
    revoking = CalloutService(CalloutConfig(
        issuer_seed_file=str(k8s_auth.callout_issuer_path),
        token_key_file=str(k8s_auth.rank_token_key_path),
        system_seed_file=str(k8s_auth.system_user_path), revoke_interval_s=3600.0),
        config_for(k8s_auth, k8s_server, Role.CALLOUT), instance="c1")
    try:
        gone_closed, ends_closed = gone.disconnect_event(), ends.disconnect_event()
        await put_job(admission, "k8s-gone", JobState.FINISHED)
        assert gone.connected  # its token is good for 10 minutes
        await revoking.start()
        await closed(gone_closed, REVOKED_WITHIN_S)
        assert ends.connected and not ends_closed.is_set()
        await put_job(admission, "k8s-ends", JobState.CANCELLED)
        await closed(ends_closed, REVOKED_WITHIN_S)
        # Both clients try again with their tokens (either callout answers): refused, and
        # the refusal says why.
        with recording(revoking, decisions):
            said: set[str] = set()
            while said != {"job k8s-gone is finished", "job k8s-ends is cancelled"}:
                refused = await asyncio.wait_for(decisions.get(), 10)
                assert (refused.job_id, refused.refusal) == (None, Refusal.ENDED_JOB), refused
                said.add(refused.message)
        assert not (gone.connected or ends.connected)
        # The revoker closed both (counted once the server answered its kick: a client can
        # see its connection closed before that, but not be refused a new one).
        assert revoking.revoker is not None
        assert revoking.revoker.kicked == {str(Refusal.ENDED_JOB): 2}
    finally:
        await revoking.stop()
        for rank in (gone, ends):
            await rank.close()


async def test_the_revoker_closes_an_ended_job_s_connections_on_every_server(
        k8s_auth: AuthDir, tmp_path: Path) -> None:
    """On a cluster of three servers configured as the chart's (routes over the CA's TLS
    and a password), a job's ranks connected one to each server all lose their
    connections when the job ends: every server lists its own, and closes its own."""
    config = chart_config(k8s_auth, tmp_path / "nats.conf")
    with NatsCluster(tmp_path / "js", 3, log_dir=tmp_path, config_file=config,
                     secured=k8s_auth.route_security()) as cluster:
        def on(role: Role) -> BusConfig:
            return BusConfig.load(env=k8s_auth.env(role), servers=list(cluster.urls))

        revoking = CalloutService(CalloutConfig(
            issuer_seed_file=str(k8s_auth.callout_issuer_path),
            token_key_file=str(k8s_auth.rank_token_key_path),
            system_seed_file=str(k8s_auth.system_user_path), revoke_interval_s=3600.0),
            on(Role.CALLOUT), instance="cluster")
        await revoking.start()
        ranks: list[Bus] = []
        try:
            async with await Bus.connect(on(Role.ADMISSION)) as admission:
                await put_job(admission, "k8s-spread", JobState.ADMITTED)
                for i, server in enumerate(cluster.servers):  # one rank on each
                    ranks.append(await Bus.connect(
                        token_config(k8s_auth, server, "k8s-spread"), name=f"rank-{i}"))
                    assert ranks[-1].nc.connected_url is not None
                    assert ranks[-1].nc.connected_url.port == server.port
                closed_events = [rank.disconnect_event() for rank in ranks]
                refusals: asyncio.Queue[Decision] = asyncio.Queue()
                with recording(revoking, refusals):
                    await put_job(admission, "k8s-spread", JobState.FINISHED)
                    for event in closed_events:
                        await closed(event, REVOKED_WITHIN_S)
                    # Each reconnects with its token, to whichever server: refused.
                    for _ in ranks:
                        refused = await asyncio.wait_for(refusals.get(), 10)
                        assert refused.message == "job k8s-spread is finished", refused
                assert revoking.revoker is not None
                assert revoking.revoker.kicked == {str(Refusal.ENDED_JOB): 3}
        finally:
            await revoking.stop()
            for rank in ranks:
                await rank.close()


@pytest.mark.usefixtures("callout_service")
async def test_an_agent_holding_the_token_key_starts_a_rank_as_its_job_alone(
        k8s_auth: AuthDir, k8s_server: NatsServer, k8s_connect: Connect,
        tmp_path: Path) -> None:
    """The Kubernetes agents' way: the agent (as ``agents``) mints a token for the job; the
    rank reports as its job, and its environment holds no agent credential, no agent
    setting and not the key."""
    seen_env = tmp_path / "rank-env.json"
    spec = JobSpec(name="k8s", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=1, max=1),
                   command=[sys.executable, "-c", ENV_RANK_SCRIPT, str(seen_env)])
    async with running_services(k8s_auth, k8s_server, tmp_path / "agent", agent_scope=ANY,
                                rank_token_key_file=str(k8s_auth.rank_token_key_path)):
        cli = AdmissionClient(await k8s_connect(Role.CLI))
        viewer = await k8s_connect(Role.VIEWER)
        reports = await viewer.nc.subscribe(subjects.health_job_ranks("k8s-run"))
        await cli.submit(spec, "k8s-run")
        assert decode((await reports.next_msg(timeout=20)).data,
                      RankProgress).job_id == "k8s-run"
        await reports.unsubscribe()
        await asyncio.wait_for(wait_state(viewer, "k8s-run", JobState.FINISHED), 20)
    env = json.loads(seen_env.read_text())
    key = load_key(k8s_auth.rank_token_key_path)
    assert rank_token.verify(key, env["PHALANX_NATS_TOKEN"], now=time.time()).job_id == \
        "k8s-run"
    assert env["PHALANX_NATS_INBOX_PREFIX"] == "_INBOX.rank-k8s-run"
    assert not [k for k in env if k.startswith("PHALANX_AGENT_")]
    assert not {"PHALANX_NATS_NKEY", "PHALANX_NATS_CREDS", "PHALANX_NATS_USER"} & set(env)
    secret = k8s_auth.rank_token_key_path.read_text().strip()
    assert not [k for k, v in env.items() if secret in v or "agents.nk" in v], "a key"


ENV_RANK_SCRIPT = """
import json, os, sys
from phalanx.runtime.progress import ProgressReporter
with open(sys.argv[1], "w") as f:
    json.dump(dict(os.environ), f)
with ProgressReporter.from_env() as reporter:
    for step in range(1, 4):
        reporter.report(step, 0.01, final=step == 3)
"""


async def test_an_operator_revokes_a_node_and_its_agent_is_shut_out(
        auth: AuthDir, secured: NatsServer) -> None:
    """``phalanx auth revoke-node``: the node's identity goes, and once the server reloads
    its config the agent's connection is closed and it cannot come back; revoking what is
    not there says so."""
    assert secured.process is not None
    root = str(auth.root)
    cli("auth", "add-node", root, "node-retired")
    kept = auth.root / "retired-seed.nk"
    kept.write_bytes(auth.seed_path(Role.AGENT, "node-retired").read_bytes())
    kept.chmod(0o600)
    env = {**auth.env(Role.AGENT, "node-retired"), "PHALANX_NATS_NKEY": str(kept)}
    reload_config(secured.process.pid)
    deadline = time.monotonic() + 10
    while True:  # the server admits the new identity once it has reloaded
        try:
            agent = await Bus.connect(BusConfig.load(env=env, servers=[secured.url]))
            break
        except BusUnavailable:
            assert time.monotonic() < deadline
    try:
        revoked = cli("auth", "revoke-node", root, "node-retired")
        assert "revoked agent-node-retired" in revoked.stdout and "SIGHUP" in revoked.stdout
        assert "agent-node-retired" not in {who.name for who in auth.identities()}
        assert not auth.seed_path(Role.AGENT, "node-retired").exists()
        reload_config(secured.process.pid)
        deadline = time.monotonic() + 10
        while agent.connected:
            assert time.monotonic() < deadline, "the revoked node stayed connected"
            await asyncio.sleep(0.1)
        with pytest.raises(BusUnavailable):
            await Bus.connect(BusConfig.load(env=env, servers=[secured.url],
                                             connect_timeout_s=2.0))
    finally:
        await agent.close()
    again = cli("auth", "revoke-node", root, "node-retired", check=False)
    assert again.returncode == 1 and "holds no identity agent-node-retired" in again.stderr
    gone = cli("auth", "revoke-job", root, "job-never-added", check=False)
    assert gone.returncode == 1 and "rank-job-never-added" in gone.stderr
