"""The agent's shell: registry entry, heartbeats, rank processes and chaos over NATS.

The agent follows admitted job records (``phalanx.job.*.state``, and the jobs
bucket at start-up and again after every reconnection to the bus, since the
plain publishes sent while it was disconnected are lost) and runs this node's
ranks of each; a rank's start and exit are stored in the job-events stream at
once. Records are applied per job in order, jobs independently, so stopping
one job's ranks (up to its grace period) never delays another's launch.
Elasticity's launch requests are idempotent: a replica launched here before
is never started again (:mod:`.ranks`).

Beside the ranks, the agent keeps the node's snapshot store (:mod:`.snapshots`),
answers its ranks' reservations and other nodes' fetches of it
(:mod:`.snapshot_endpoints`) and replicates it (:mod:`.replication`): a listener takes
its wards' snapshots (its port is in the node record), a sender streams this node's to
the buddy the checkpoint service placed (KV bucket ``phalanx_buddies``, re-read every
:data:`BUDDY_REFRESH_S`).

On a node whose GPUs NVML sees (:mod:`.nvml`), the slots are those GPUs, and their
health is polled (:mod:`.gpu_health`): a GPU fault cordons that GPU's slots in the node
record and SIGKILLs the ranks there.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import nats.errors
from opentelemetry import context as otel_context

from phalanx.bus import telemetry
from phalanx.bus.client import Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import Conflict, RequestRefused
from phalanx.bus.kv import TypedKV
from phalanx.bus.stream import ensure_job_events
from phalanx.schemas import __version__, subjects
from phalanx.schemas.errors import ConfigError, PhalanxError
from phalanx.schemas.messages import (
    BuddyPlacement,
    ChaosAction,
    ChaosReply,
    ChaosRequest,
    Generation,
    JobRecord,
    JobState,
    LaunchReplica,
    LogReply,
    LogRequest,
    NodeCondition,
    NodeConditionChanged,
    NodeHeartbeat,
    NodeInfo,
    NodeRecord,
    NodeStatusRequest,
    RankExited,
    RankStarted,
    ReplicaFetch,
    ReplicaReply,
    SnapshotRecord,
    SnapshotReserve,
    StopReplica,
)
from phalanx.services import metrics
from phalanx.services.agent import core, cpus, fence, identity, replica_tls
from phalanx.services.agent.cgroups import MemoryCgroups
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.gpu_health import GpuHealth
from phalanx.services.agent.logs import read_logs
from phalanx.services.agent.nvml import GpuWatch, discover
from phalanx.services.agent.rank_output import RankOutput
from phalanx.services.agent.ranks import RankSet, ReplicaOutdated
from phalanx.services.agent.replication import Address, ReplicaListener, ReplicaSender
from phalanx.services.agent.snapshot_endpoints import SnapshotEndpoints
from phalanx.services.agent.snapshots import (
    SnapshotStore,
    claim_in_default_place,
    default_limit,
    default_root,
)
from phalanx.services.agent.spares import SpareSet
from phalanx.services.agent.zygote import Launcher
from phalanx.services.auth import rank_token
from phalanx.services.auth.credentials import (
    rank_env,
    shared_rank_env,
    token_rank_env,
)
from phalanx.services.auth.replication_key import load_key
from phalanx.services.base import Service
from phalanx.services.manifest import start_ticks
from phalanx.services.paths import default_data_dir

log = logging.getLogger("phalanx.agent")
BUDDY_REFRESH_S = 2.0
#: How often an agent reads the record of a holder of its node id it is watching.
HOLDER_POLL_S = 0.1
#: Ended jobs remembered (replicas of them are refused), newest kept.
ENDED_KEPT = 4096
#: How often the ranks' log files are looked at (:mod:`.rank_output`).
RANK_OUTPUT_INTERVAL_S = 0.5


def _to_stdout(lines: bytes) -> None:
    sys.stdout.buffer.write(lines)
    sys.stdout.buffer.flush()


class AgentService(Service):
    """One per machine: keeps its node registered and alive in the registry."""

    description = "phalanx node agent"
    metric_families = metrics.AGENT

    def __init__(self, config: AgentConfig, bus_config: BusConfig | None = None) -> None:
        super().__init__("phalanx-agent", config.node_id, bus_config,
                         shutdown_timeout_s=config.shutdown_timeout_s)
        self.config = config
        if config.cpus:
            cpus.run_on(config.cpus)
        nvml = discover() if config.discover_gpus else None
        found = nvml.gpus if nvml is not None else None
        try:
            #: The node's slots and the GPU of each (empty: CPU slots).
            self.slots, self.gpus = core.node_gpus(config.slots, config.gpus, found,
                                                   len(config.cpus) or os.cpu_count() or 1)
            watch = GpuWatch(nvml)  # its baseline: the readings at start
        except BaseException:
            if nvml is not None:
                nvml.close()
            raise
        self.gpu_health = GpuHealth(
            watch, self.gpus, self.slots, stored=lambda: self.record,
            read=lambda: self._node_record(config.node_id),
            kill=lambda slots, why, seen_at: self.ranks.gpu_fault(slots, why, seen_at)
            if self.ranks is not None else [],
            write=lambda: self._refresh_record(time.time(), self._slots_used()))
        self._record_write = asyncio.Lock()  # record writes in order: the revision kept
        self.info = NodeInfo(
            node_id=config.node_id, host=config.address or socket.gethostname(), slots=self.slots,
            failure_domain=config.failure_domain, labels=config.labels,
            agent_pid=os.getpid(), agent_version=__version__, started_at=time.time(),
            gpus=found or [],
        )
        self.nodes: TypedKV[NodeRecord] | None = None
        self.record: NodeRecord | None = None
        self.ranks: RankSet | None = None
        self.spares: SpareSet | None = None
        self.launcher = Launcher(self.work_dir, zygotes=config.zygote,
                                 template=config.zygote_template)
        self._job_locks: dict[str, asyncio.Lock] = {}
        self.jobs: TypedKV[JobRecord] | None = None
        self.generations: TypedKV[Generation] | None = None
        root = Path(config.snapshot_dir) if config.snapshot_dir \
            else default_root(config.node_id, self.work_dir)
        if not config.snapshot_dir:  # the default place: shared by every agent of the host
            claim_in_default_place(root, self.work_dir)
        uids = config.job_uid_range
        if uids is not None:
            missing = identity.missing_capabilities(
                Path("/proc/self/status").read_text(), uids, (os.getuid(), os.getgid()))
            if missing:
                raise ConfigError(f"agent.job_uids {uids.start}-{uids.stop - 1}: this agent "
                                  f"cannot run jobs as their own users: it lacks "
                                  f"{'; '.join(missing)} (docs/deploy.md)")
        #: Each job's user and private directories here (None: jobs run as the agent).
        self.identities = None if uids is None else identity.JobIdentities(
            self.work_dir, uids, identity.private_roots(config.node_id, self.work_dir))
        self.snapshots = SnapshotStore(root, config.snapshot_limit_bytes
                                       if config.snapshot_limit_bytes is not None
                                       else default_limit(root),
                                       None if self.identities is None
                                       else self.identities.user)
        self.ended: dict[str, None] = {}  # jobs seen terminal, oldest first
        #: Mints the rank tokens an auth callout admits ranks by (read once, refused here).
        self.token_key = load_key(config.rank_token_key_file, "rank token key") \
            if config.rank_token_key_file else None
        key = load_key(config.replica_key_file) if config.replica_key_file else None
        #: The cluster's key: replication's, and the root of each job's rendezvous secret.
        self.cluster_key = key
        tls_dir = config.replica_tls_dir
        self.replicas = ReplicaListener(
            self.snapshots, config.node_id, self._announce, self.ended.__contains__, key,
            replica_tls.context(tls_dir, server=True) if tls_dir else None)
        self.sender = ReplicaSender(
            self.snapshots, config.node_id, self._buddy, config.replica_duty, key,
            replica_tls.context(tls_dir, server=False) if tls_dir else None)
        self._buddy_read: tuple[float, Address | None] = (float("-inf"), None)

    def _holder_dead(self, held: NodeRecord | None) -> bool:
        """Whether ``held`` was an agent on this host whose process is gone."""
        return held is not None and held.node.host == self.info.host \
            and start_ticks(held.node.agent_pid) is None

    async def _watch_holder(self, nodes: TypedKV[NodeRecord]) -> NodeRecord | None:
        """If another agent, not known gone, holds this node id: watch its record for
        ``lost_after_s`` by this agent's clock, and return it if no heartbeat of its came
        (the id may be taken, :func:`.core.silent_holder`). None otherwise: nobody to
        watch, or the holder beat (registering then refuses at once)."""
        node_id = self.config.node_id
        held, _ = await nodes.current(node_id)
        if held is None or core.same_agent(held.node, self.info) or self._holder_dead(held):
            return None
        log.info("node id %s is held by pid %d on %s: watching for its heartbeats for %g s",
                 node_id, held.node.agent_pid, held.node.host, self.config.lost_after_s)
        deadline = time.monotonic() + self.config.lost_after_s
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, HOLDER_POLL_S))
            if not core.silent_holder(held, (await nodes.current(node_id))[0]):
                return None
        return held

    async def setup(self) -> None:
        assert self.bus is not None
        await self._listen()
        self.nodes = await self.bucket(subjects.NODES_BUCKET, NodeRecord)
        self.buddies = await self.bucket(subjects.BUDDIES_BUCKET, BuddyPlacement)
        silent = await self._watch_holder(self.nodes)
        entry = await self.nodes.modify(
            self.config.node_id,
            lambda existing: core.register(existing, self.info, time.time(),
                                           holder_dead=self._holder_dead(existing),
                                           silent=silent))
        self.record = entry.value
        await self.add_endpoint("status", subjects.agent_status(self.config.node_id),
                                NodeStatusRequest, self.on_status)
        await self.add_endpoint("chaos", subjects.agent_chaos(self.config.node_id),
                                ChaosRequest, self.on_chaos)
        await self.add_endpoint("logs", subjects.agent_logs(self.config.node_id), LogRequest,
                                self.on_logs, concurrent=True)
        if self.gpu_health.watch.nvml is not None:
            self.keep_running(lambda: self.gpu_health.run(
                self.sleep_or_stop, self.config.gpu_poll_interval_s), "gpu health")
        if not self.config.launch:
            self.keep_running(self.heartbeat_loop, "heartbeat")
            return
        await ensure_job_events(self.bus)  # where rank starts and exits are stored
        cgroups, no_cgroups = MemoryCgroups.find() if self.config.confine_memory \
            else (None, "agent.confine_memory is off")
        if cgroups is None:
            log.info("ranks' memory_per_rank is not enforced here: %s", no_cgroups)
        default_durable = self.work_dir.parent.parent / "checkpoints"
        if (node_local := self.config.node_local_durable(default_durable, os.environ)):
            log.warning(node_local)
        self.ranks = RankSet(self.config.node_id, self.work_dir, self.bus_config_url(),
                             self._host_of, self._report, capacity=self.slots,
                             replacement_nice=self.config.replacement_nice,
                             advertise_host=self.info.host, bus_identity=self._rank_identity(),
                             snapshot_dir=self.snapshots.job_dir,
                             checkpoint_dir=Path(self.config.checkpoint_dir)
                             if self.config.checkpoint_dir else default_durable,
                             gpus=self.gpus, found_gpus=self.gpu_health.watch.gpus,
                             slot_cpus=cpus.shares(self.config.cpus, self.slots)
                             if self.config.cpus and not self.gpus else (),
                             cordoned=self.gpu_health.cordoned_now, launcher=self.launcher,
                             identities=self.identities, store_key=self.cluster_key,
                             cgroups=cgroups, no_cgroups=no_cgroups)
        await self.ranks.adopt()
        ranks = self.ranks
        # A cordoned slot holds no spare either.
        self.spares = self.ranks.spares = SpareSet(
            self.config.node_id, self.work_dir, self.slots, self.gpus,
            self.ranks.job_environment,
            lambda: ranks.slots_placed() + len(self.gpu_health.cordoned),
            lambda: ranks.held_slots() | set(self.gpu_health.cordoned), launcher=self.launcher,
            pin=ranks.pin, user=ranks.job_user, confine=ranks.confine,
            unconfine=ranks.unconfine)
        metrics.RANKS.set_function(lambda: len(ranks.ranks))
        # Both open before the first record arrives: reconciling one reads the generations.
        self.jobs = await self.bucket(subjects.JOBS_BUCKET, JobRecord)
        self.generations = await self.bucket(subjects.GENERATIONS_BUCKET, Generation)
        await self.bus.subscribe(subjects.job_states(), JobRecord, self.on_job_state)
        await self._sync_jobs()
        # Served once what was launched here is known and the first reconcile of every job
        # holds its lock: a launch request never races the start-up.
        await self.add_endpoint("launch", subjects.agent_launch(self.config.node_id),
                                LaunchReplica, self.on_launch, concurrent=True)
        await self.add_endpoint("stop", subjects.agent_stop(self.config.node_id),
                                StopReplica, self.on_stop, concurrent=True)
        endpoints = SnapshotEndpoints(self.config.node_id, self.snapshots, self.sender,
                                      ranks.jobs, self._node_record)
        await self.add_endpoint("snapshot", subjects.agent_snapshot(self.config.node_id),
                                SnapshotReserve, endpoints.reserve)
        # The job is in the subject, and a fetch naming another job is refused as bad input.
        await self.add_endpoint("fetch", subjects.agent_fetches(self.config.node_id),
                                ReplicaFetch, endpoints.fetch, concurrent=True)
        # Records published while disconnected were missed: read them all again after.
        self.bus.on_reconnect(self._on_reconnect)
        self.keep_running(self.heartbeat_loop, "heartbeat")
        self.keep_running(self.fence_loop, "fence")
        self.keep_running(lambda: self.sender.run(self.sleep_or_stop), "replicate")
        self.keep_running(lambda: self.until_stopped(self._follow_generations()), "generations")
        if self.config.tee_rank_output or self.config.rank_log_max_bytes:
            output = RankOutput(self.work_dir / "jobs",
                                _to_stdout if self.config.tee_rank_output else None,
                                self.config.rank_log_max_bytes)
            self.keep_running(lambda: self._follow_rank_output(output), "rank output")
        log.info("registered", extra={"node": self.config.node_id, "slots": self.slots,
                                      "gpus": [g.uuid for g in self.gpu_health.watch.gpus],
                                      "failure_domain": self.config.failure_domain})

    async def _follow_rank_output(self, output: RankOutput) -> None:
        while not await self.sleep_or_stop(RANK_OUTPUT_INTERVAL_S):
            await asyncio.to_thread(output.look)

    async def _follow_generations(self) -> None:
        """Which jobs have a generation, so run a phalanx session: a job that leaves its
        spares unset keeps them from then on (:func:`.core.spares_wanted`); and on which
        nodes its newest one runs (the replicas of the others are pruned). A failure of
        the watch is retried: it must not stop the agent, and its ranks with it."""
        assert self.generations is not None and self.spares is not None
        assert self.bus is not None
        while True:
            try:
                async for change in self.generations.follow(self.bus.resync_event()):
                    if change is not None:
                        await self.spares.session_seen(change.key, change.value is not None)
                        if change.value is not None:
                            self.snapshots.generation_seen(
                                change.key, change.value.generation,
                                [member.node_id for member in change.value.members])
            except Exception as exc:  # the bus gone for longer than its retries
                log.warning("following the jobs' generations failed (%s); again in 1 s", exc)
            if await self.sleep_or_stop(1.0):
                return

    async def _listen(self) -> None:
        """Start the replication listener; its port goes into the node record. Without
        one (the address cannot be bound) the node holds no buddy's replicas, logged."""
        host = self.config.replica_host
        try:
            if host is None:
                host = str((await asyncio.get_running_loop().getaddrinfo(
                    self.info.host, None, family=socket.AF_INET))[0][4][0])
            port = await self.replicas.start(host, self.config.replica_port)
        except OSError as exc:
            log.error("no replication listener on %s (%s): this node keeps no buddy's "
                      "snapshots", host or self.info.host, exc)
            return
        self.info = msgspec.structs.replace(self.info, replica_port=port)
        log.info("replication listener", extra={"host": host, "port": port})

    async def _announce(self, record: SnapshotRecord) -> None:
        assert self.bus is not None
        await self.bus.publish(subjects.ckpt_snapshot(record.job_id), record)

    async def _buddy(self) -> Address | None:
        """Where this node's buddy listens (None: no placement or no listener), as read at
        most BUDDY_REFRESH_S ago; a read that fails keeps the last answer."""
        read_at, address = self._buddy_read
        if time.monotonic() - read_at < BUDDY_REFRESH_S:
            return address
        assert self.nodes is not None  # opened in start(), before the sender runs
        try:
            placement, _ = await self.buddies.current(self.config.node_id)
            record = None
            if placement is not None and placement.buddy_id:
                record, _ = await self.nodes.current(placement.buddy_id)
            address = None if record is None or not record.node.replica_port else (
                record.node.node_id, record.node.host, record.node.replica_port)
        except (PhalanxError, TimeoutError, OSError, nats.errors.Error) as exc:
            log.warning("cannot read this node's buddy: %s", exc)
        self._buddy_read = (time.monotonic(), address)
        return address

    def _ended(self, job_id: str) -> None:
        """``job_id`` is over: its snapshots and replicas here go (after its ranks, if it
        has any here: :meth:`_reconcile`), and replicas of it are refused from now on."""
        self.ended[job_id] = None
        while len(self.ended) > ENDED_KEPT:
            del self.ended[next(iter(self.ended))]
        if self.ranks is None or job_id not in self.ranks.jobs():
            self.snapshots.drop(job_id)
            self._release_user(job_id)

    def _release_user(self, job_id: str) -> None:
        """Give ``job_id``'s uid back once nothing of it is left here: no rank, no spare,
        no snapshot (:meth:`.identity.JobIdentities.release`)."""
        if self.identities is None:
            return
        here = set(self.snapshots.jobs())
        if self.ranks is not None:
            here |= {job for job, _ in self.ranks.ranks}
        if self.spares is not None:
            here |= set(self.spares.spares)
        self.identities.release(job_id, here)

    async def _on_reconnect(self) -> None:
        self.spawn(self._resync(), "resync jobs")  # not inside nats-py's reconnection

    async def _resync(self) -> None:
        """Reconcile every job record after a reconnection, retrying while the server
        cannot list them yet (JetStream recovering after a restart): a failure here must
        neither skip the records missed meanwhile nor stop the agent and its ranks."""
        while True:
            try:
                await self._sync_jobs()
                return
            except (nats.errors.Error, TimeoutError, OSError) as exc:
                log.warning("cannot read the job records after a reconnection (%r); "
                            "retrying", exc)
            if await self.sleep_or_stop(self.config.heartbeat_interval_s):
                return

    async def _sync_jobs(self) -> None:
        """Reconcile every job record (each in its job's own order), and stop ranks whose
        job is gone."""
        assert self.jobs is not None and self.ranks is not None
        records, _ = await self.jobs.entries()
        known = {r.value.job_id for r in records}
        for entry in records:
            self._apply(entry.value)
        for job_id in self.ranks.jobs() - known:  # its job is gone: stop it, forget it
            self.spawn(self._drop_job(job_id), f"drop {job_id}")
        for job_id in self.snapshots.jobs() - known:  # snapshots of a job that is gone
            self.snapshots.drop(job_id)
        for job_id in set(self.identities.held if self.identities is not None else ()) \
                - known:
            self._release_user(job_id)

    @property
    def work_dir(self) -> Path:
        if self.config.work_dir:
            return Path(self.config.work_dir)
        return default_data_dir() / "agents" / self.config.node_id

    def _rank_identity(self) -> Callable[[str], dict[str, str]] | None:
        """What each job's ranks connect as (trusting the server's certificate as the
        agent does): the job's own identity, or the ranks' shared one, or nothing."""
        assert self.bus is not None
        ca_file = self.bus.config.tls_ca_file
        if self.config.rank_keys_dir is not None:
            return functools.partial(rank_env, Path(self.config.rank_keys_dir),
                                     ca_file=ca_file)
        if self.config.rank_nkey is not None:
            shared = shared_rank_env(Path(self.config.rank_nkey), ca_file)
            return lambda _job_id: shared
        if self.token_key is not None:
            key, ttl_s = self.token_key, self.config.rank_token_ttl_s

            def minted(job_id: str) -> dict[str, str]:  # a fresh token for every start
                token = rank_token.mint(key, job_id, now=time.time(), ttl_s=ttl_s,
                                        nonce=os.urandom(rank_token.NONCE_BYTES))
                return token_rank_env(token, job_id, ca_file)

            return minted
        return None

    def bus_config_url(self) -> str:
        assert self.bus is not None
        return ",".join(self.bus.config.servers)

    async def _node_record(self, node_id: str) -> NodeRecord | None:
        """A node's record as the registry holds it now (None: it holds none)."""
        assert self.nodes is not None
        record, _ = await self.nodes.current(node_id)
        return record

    async def _host_of(self, node_id: str) -> str:
        record = await self._node_record(node_id)  # unreadable: as good as unknown
        return record.node.host if record is not None else "127.0.0.1"

    async def _report(self, event: RankStarted | RankExited) -> None:
        """Publish a rank's start or exit inside a span that names it: a trace's root."""
        assert self.bus is not None
        # A start continues the trace of what launched it (admission's decision, or the
        # recovery that asked for a replacement); an exit starts a trace of its own, the
        # recovery's, whatever task reported it.
        parent = None
        attributes: dict[str, str | int]
        if isinstance(event, RankStarted):
            subject, name = subjects.rank_started(event.job_id), f"rank {event.rank} started"
            attributes = {"phalanx.pid": event.pid}
        else:
            subject, name = subjects.rank_exited(event.job_id), f"rank {event.rank} exited"
            attributes = {"phalanx.exit.cause": event.cause.value,
                          "phalanx.exit.code": -1 if event.exit_code is None else event.exit_code,
                          "phalanx.exit.signal": event.signal or ""}
            parent = otel_context.Context()
            metrics.RANK_EXITS.labels(event.cause.value).inc()
        attributes.update({"phalanx.job": event.job_id, "phalanx.rank": event.rank,
                           "phalanx.node": self.config.node_id,
                           "phalanx.replica": event.replica_id or ""})
        # Stored in the job-events stream before it counts as sent: health and elasticity
        # must never miss an exit. One id per process and kind, so the "lost" report of a
        # restarted agent for an exit already reported is stored once.
        kind = "started" if isinstance(event, RankStarted) else "exited"
        with telemetry.tracer().start_as_current_span(name, context=parent,
                                                      attributes=attributes):
            await self.bus.publish_event(
                subject, event, event_id=f"{event.job_id}-{self.config.node_id}-{event.pid}-{kind}")

    async def on_status(self, request: NodeStatusRequest, delivery: Delivery) -> NodeRecord:
        assert self.record is not None
        return self.record

    async def on_logs(self, request: LogRequest, _: Delivery) -> LogReply:
        return await asyncio.to_thread(read_logs, self.work_dir, self.config.node_id, request)

    async def on_job_state(self, record: JobRecord, _: Delivery) -> None:
        self._apply(record)

    def _apply(self, record: JobRecord) -> None:
        """Reconcile ``record`` in its job's own task, after that job's earlier records."""
        if record.state.terminal:
            self._ended(record.job_id)
        mine = self.config.node_id in record.nodes
        if mine or (self.ranks is not None and record.job_id in self.ranks.jobs()):
            self.spawn(self._reconcile(record), f"reconcile {record.job_id}")

    async def _reconcile(self, record: JobRecord) -> None:
        assert self.ranks is not None
        async with self._job_locks.setdefault(record.job_id, asyncio.Lock()):
            try:
                elastic = record.state is JobState.ADMITTED and await self._elastic(record.job_id)
                await self.ranks.reconcile(record, elastic=elastic)
                if self.spares is not None:
                    await self.spares.reconcile(record)
                if record.state.terminal:  # its snapshots are needed no more
                    self.snapshots.drop(record.job_id)
                    self._release_user(record.job_id)
            except Exception:  # one job's trouble must not stop the agent
                log.exception("reconciling %s failed", record.job_id)

    async def _elastic(self, job_id: str) -> bool:
        """Is the job's membership managed by elasticity (it has a generation)?"""
        assert self.generations is not None
        try:
            return await self.generations.get(job_id) is not None
        except PhalanxError as exc:
            log.warning("cannot read %s's generation: %s", job_id, exc)
            return False

    async def _drop_job(self, job_id: str) -> None:
        assert self.ranks is not None
        async with self._job_locks.setdefault(job_id, asyncio.Lock()):
            await self.ranks.drop(job_id)
            if self.spares is not None:
                await self.spares.drop(job_id)
            self._release_user(job_id)

    async def on_launch(self, request: LaunchReplica, _: Delivery) -> ReplicaReply:
        """Run a new replica in one of a job's slots here (elasticity's replacements)."""
        assert self.ranks is not None and self.jobs is not None
        entry = await self.jobs.get(request.job_id)
        if entry is None:
            raise RequestRefused("404", f"no job {request.job_id!r}")
        async with self._job_locks.setdefault(request.job_id, asyncio.Lock()):
            try:
                done = await self.ranks.replace(entry.value, request.slot, request.replica_id,
                                                warm_only=request.warm_only, gang=request.gang)
            except (LookupError, ReplicaOutdated) as exc:
                raise RequestRefused("409", str(exc)) from None
            except OSError as exc:
                raise RequestRefused("500", str(exc)) from None
        where = f"{request.replica_id} in slot {request.slot}"
        if done.no_spare:
            detail = f"not started {where}: no warm spare of {request.job_id} here"
        elif done.new:
            detail = f"started {where}" + (" from a warm spare" if done.from_spare else "")
        else:
            detail = f"already launched {where}" + ("" if done.pid else " (it has exited)")
        return ReplicaReply(node_id=self.config.node_id, replica_id=request.replica_id,
                            pid=done.pid, detail=detail, spare=done.from_spare)

    async def on_stop(self, request: StopReplica, _: Delivery) -> ReplicaReply:
        """Stop a replica its job no longer needs (a joiner when the training is over)."""
        assert self.ranks is not None
        async with self._job_locks.setdefault(request.job_id, asyncio.Lock()):
            pid = await self.ranks.stop_replica(request.job_id, request.slot,
                                                request.replica_id)
        detail = f"stopped {request.replica_id}" if pid else f"{request.replica_id} not running"
        return ReplicaReply(node_id=self.config.node_id, replica_id=request.replica_id, pid=pid,
                            detail=detail)

    async def on_chaos(self, request: ChaosRequest, _: Delivery) -> ChaosReply:
        """Inject a fault the way a user would: kill a rank, kill or pause this agent."""
        assert self.ranks is not None and self.bus is not None
        node = self.config.node_id
        loop = asyncio.get_running_loop()
        # Say so first: what the fault does is the operator's doing, not the node's, and
        # health must not cordon it for that.
        now = time.time()
        over = now + (request.duration_s if request.action is ChaosAction.PAUSE_AGENT else 0.0)
        await self.bus.publish(subjects.node_chaos(node), NodeConditionChanged(
            node_id=node, condition=NodeCondition.CHAOS, at=now, until=over,
            reason=f"phalanx chaos {request.action.value}"))
        if not await self.bus.round_trip(10.0):
            log.warning("the chaos notice may not have reached the server before the fault",
                        extra={"action": request.action.value})
        match request.action:
            case ChaosAction.KILL_RANK:
                assert request.job_id is not None and request.rank is not None
                sig = signal.Signals[f"SIG{request.signal}"]
                try:
                    pid = self.ranks.signal(request.job_id, request.rank, sig)
                except KeyError:
                    raise RequestRefused("404", f"rank {request.rank} of {request.job_id} "
                                                f"does not run on {node}") from None
                return ChaosReply(node_id=node, pid=pid,
                                  detail=f"sent {sig.name} to rank {request.rank} (pid {pid})")
            case ChaosAction.KILL_AGENT:
                # Answer first; die right after, like a machine losing power.
                loop.call_later(0.05, os.kill, os.getpid(), signal.SIGKILL)
                return ChaosReply(node_id=node, pid=os.getpid(), detail="agent SIGKILLed")
            case ChaosAction.PAUSE_AGENT:
                # A stopped process cannot wake itself: a detached sleeper sends SIGCONT.
                await asyncio.create_subprocess_exec(
                    "sh", "-c", f"sleep {request.duration_s}; kill -CONT {os.getpid()}",
                    start_new_session=True)
                loop.call_later(0.05, os.kill, os.getpid(), signal.SIGSTOP)
                return ChaosReply(node_id=node, pid=os.getpid(),
                                  detail=f"agent paused for {request.duration_s:g} s")
            case ChaosAction.GPU_FAULT:
                assert request.gpu is not None
                try:
                    done = await self.gpu_health.inject(request.gpu, request.gpu_fault,
                                                        request.code)
                except ValueError as exc:
                    raise RequestRefused("404", f"{node}: {exc}") from None
                return ChaosReply(node_id=node, detail="; ".join(done) or "nothing seen")
        raise RequestRefused("400", f"unknown chaos action {request.action}")

    async def heartbeat_loop(self) -> None:
        """Publish a heartbeat every interval, and refresh the registry entry beside it.

        The heartbeat, what health judges the node by, never waits for the registry write:
        on a loaded bus a JetStream write can take longer than the node timeout, and
        heartbeats held behind it had health judge live nodes lost (bench/scale.py, 200
        simulated nodes). A refresh still under way when the next is due is not doubled,
        and one still under way at a stop is cancelled.
        A bus outage is logged and retried at the next beat; losing the node id to another
        agent stops this one.
        """
        assert self.bus is not None and self.nodes is not None
        subject = subjects.node_heartbeat(self.config.node_id)
        seq = self.record.heartbeat_seq if self.record is not None else 0
        refresh: asyncio.Task[None] | None = None
        try:
            while not await self.sleep_or_stop(self.config.heartbeat_interval_s):
                now = time.time()
                used = self._slots_used()
                if refresh is not None and refresh.done():
                    refresh.result()  # NodeIdTaken stops the agent
                    refresh = None
                if refresh is None:
                    refresh = asyncio.create_task(self._refresh_record(now, used))
                seq += 1
                try:
                    await self.bus.publish(subject, NodeHeartbeat(
                        node_id=self.config.node_id, seq=seq, sent_at=now, slots_used=used))
                except Exception as exc:
                    log.warning("heartbeat failed: %s", exc)
        finally:
            if refresh is not None:
                # A stop does not wait out a write that may be retrying through a registry
                # failover (the KV's FAILOVER_S, 15 s): teardown deregisters all the same.
                refresh.cancel()
                await asyncio.wait([refresh])
                if not refresh.cancelled():
                    refresh.exception()  # retrieved: the agent stops whatever it was

    async def fence_loop(self) -> None:
        """Each heartbeat interval, a round trip with the bus; the node's ranks SIGKILLed
        once none has been answered by a server in the cluster's majority for
        ``fence_after_s`` (:mod:`.fence`)."""
        assert self.bus is not None and self.ranks is not None
        interval = self.config.heartbeat_interval_s
        watch = fence.BusWatch(self.config.fence_s, time.monotonic())
        while not await self.sleep_or_stop(interval):
            sent = time.monotonic()
            # A server cut from its cluster still answers: only one that answers for the
            # majority confirms that the node is heard (the bus moves off one that does not).
            if await self.bus.round_trip(interval) and self.bus.in_majority:
                watch.confirmed(sent)
                continue
            verdict = watch.verdict(time.monotonic(), len(self.ranks.ranks))
            if verdict is not None:
                killed = self.ranks.fence()
                log.warning(verdict.message, extra={
                    "ranks": sorted(f"{r.job_id}/{r.replica_id}" for r in killed),
                    "unconfirmed_s": round(verdict.unconfirmed_s, 3)})

    def _slots_used(self) -> int:
        return min(self.ranks.slots_used if self.ranks is not None else 0, self.info.slots)

    async def _refresh_record(self, now: float, used: int) -> None:
        """Write the heartbeat into the node's registry entry, with its slot and snapshot
        use (an earlier membership's snapshot rings are pruned first) and the slots it
        cordoned since the last write."""
        assert self.nodes is not None
        for job_id in list(self.snapshots.current):
            if self.snapshots.prune(job_id):
                log.info("pruned earlier snapshot rings", extra={"job": job_id})
        for job_id in self.snapshots.jobs():
            if self.snapshots.prune_replicas(job_id):
                log.info("pruned earlier replicas", extra={"job": job_id})
            if self.snapshots.prune_departed(job_id):
                log.info("pruned the replicas of nodes the job left", extra={"job": job_id})
        memory = {"snapshot_bytes": self.snapshots.used(),
                  "snapshot_limit_bytes": self.snapshots.limit,
                  "snapshot_refused": self.snapshots.refused}
        health = self.gpu_health
        async with self._record_write:
            unstored, before = dict(health.unstored), set(health.cordoned)
            try:
                entry = await self.nodes.modify(
                    self.config.node_id,
                    lambda record: msgspec.structs.replace(
                        core.heartbeat(record, self.info, now, used, unstored), **memory))
            except core.NodeIdTaken:
                raise
            except Exception as exc:
                log.warning("registry refresh failed: %s", exc)
                return
            self.record = entry.value
            health.written(unstored)
        if set(health.cordoned) != before and self.spares is not None:
            self.spawn(self.spares.refresh(), "spares")  # a slot cordoned or uncordoned

    async def teardown(self) -> None:
        """Stop the ranks (reported lost: their jobs still want them) and deregister: a
        cleanly stopped node leaves the registry at once, its snapshots freed — unless
        the stop is a restart (``AgentConfig.stop_is_restart``), which keeps both.

        The entry is read first and deleted only if it is this agent's, at the revision
        read, so an agent that lost its id to another never removes the other's entry
        (and a registry write cancelled by the stop but stored after all is no obstacle).
        """
        await self.replicas.stop()
        if self.spares is not None:
            await self.spares.stop_all()
        if self.ranks is not None:
            await self.ranks.stop_all()
        await self.launcher.close()  # after the ranks: their zygotes report their exits
        await self.gpu_health.close()
        if self.config.stop_is_restart:
            log.info("stopped for a restart: registry entry and snapshots kept",
                     extra={"node": self.config.node_id})
            return
        self.snapshots.clear()
        if self.identities is not None:  # its ranks are stopped: their folders go
            self.identities.close()
        if self.nodes is None or self.record is None:
            return
        stored, revision = await self.nodes.current(self.config.node_id)
        try:
            if stored is None or not core.same_agent(stored.node, self.info):
                raise Conflict(f"the entry of {self.config.node_id} is not this agent's")
            await self.nodes.delete(self.config.node_id, revision=revision)
        except Conflict:
            log.warning("not deregistering: the entry is no longer ours")
            return
        log.info("deregistered", extra={"node": self.config.node_id})
