"""The rank processes of one node: launch, watch, stop, and adopt after an agent crash.

Which ranks run here follows from admitted job records: rank (slot) ``s`` of
a job runs on the node the record places slot ``s`` on.
:meth:`RankSet.reconcile` launches what a record wants and was never
launched, and stops what it no longer wants; a record that is not admitted
(pending again, cancelled, finished) stops every rank of its job. The
process in a slot is a *replica*, ``r<slot>-0`` at first; elasticity
replaces a failed one with ``r<slot>-1`` … through :meth:`RankSet.replace`,
so a rank that died is never restarted behind elasticity's back. A replica
is launched at most once here (:func:`~phalanx.services.agent.core.launch_verdict`):
a launch request repeated after it started, even after it exited, is
answered "already launched", one for an older incarnation is refused. What to
start, stop, let leave or keep, and in which slots, is decided by the pure rules
of :mod:`.reconcile` (offered by :mod:`.core`) from what runs and what was
launched here; this module carries the decisions out.

A rank gets the environment a torchrun script expects (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``; on a node that lists GPUs, ``CUDA_VISIBLE_DEVICES`` is its slot's GPU
alone and ``LOCAL_RANK`` 0, so that ``cuda:LOCAL_RANK`` is that GPU; on a CPU node a
gang's ``LOCAL_RANK`` is the index of the node's slot it runs in) plus
``PHALANX_*`` for the runtime (``PHALANX_BACKEND``: the spec's ``backend``). Those
variables describe the job's gang until the job has a generation (or from the start, if
its spec declares a ``session``); from then on (its
replacements, joiners and spares) they make each process a world of its own
(:data:`~phalanx.schemas.environment.WORLD_OF_ONE`): a ported DDP script's own
``init_process_group`` must not wait for a gang that is gone. A gang restarted whole
(:meth:`RankSet.replace` with ``gang``: a replica failed before any was ready) gets the
gang's variables again, with a ``MASTER_PORT`` of its incarnation. The rank runs
in its own session so a stop reaches its children too, and logs to
``<work_dir>/jobs/<job>/<replica>.log`` (one file per replica, so a
replacement's output never runs on from its predecessor's; the agent writes a
header line when it starts it).

A replica of several ranks (``ranks_per_replica`` S > 1, a *group*) is S processes
started together, held until every one of them is on the manifest, each on its share
of the replica's slots with the replica's ``PHALANX_*`` identity plus its group rank,
torchrun's variables describing the group (:func:`~.core.group_variables`, with a
``MASTER_PORT`` picked free here for each group incarnation, below the ephemeral
ports), and a log of its own (``<replica>_g<group rank>.log``). It is one rank to everyone else: one
``RankStarted`` (with group rank 0's pid), one ``RankExited`` once every process of
it is gone (:func:`~.core.group_exit`); the first process to end takes the others
down (:func:`~.core.siblings_wait_s`), and a stop stops them all.

A rank's exit is reported the moment the event loop's child watcher sees it. A stop
is SIGTERM to the process group, then SIGKILL after the job's grace period. A rank of
an elastic job whose slot admission took away (a planned shrink) first gets to *leave*: the runtime
finishes its step and exits 0 by itself, told by elasticity's leave
generation; only if it is still there after the spec's
``scaling.graceful_shutdown_timeout_s`` is it stopped. Either way its exit is
reported with cause ``stopped``, and its slot counts as taken until it is gone,
so the ranks of the job that preempted it start the moment it exits.
A rank stopped because the agent itself shuts down is reported ``lost``
instead: its job still wants it (:func:`~phalanx.services.agent.core.exit_cause`).
A rank whose GPU failed is SIGKILLed at once (:meth:`RankSet.gpu_fault`: no grace
period, the GPU cannot finish a step) and reported ``gpu_fault``, its detail naming
the GPU and the fault. No rank starts on a cordoned slot, and on a node whose GPUs
NVML described a rank is pinned to the CPUs close to its GPUs
(``os.sched_setaffinity`` the moment it is spawned, before it starts threads).

With ``agent.job_uids`` every process of a job runs as its job's user
(:mod:`.identity`: :meth:`RankSet.job_user`), with a private ``HOME`` and ``TMPDIR``;
where the job sets ``memory_per_rank``, each one runs in a memory cgroup of its own,
joined while it is held (:mod:`.cgroups`: :meth:`RankSet.confine`), and an exit the OOM
killer caused is reported ``oom``. Where the cluster has a key, every process of a job
gets the job's rendezvous secret (``PHALANX_STORE_SECRET``), and no other.

Every running rank is recorded in ``<work_dir>/ranks.json`` with its start
time (from ``/proc``), so an agent restarted after a crash finds its ranks
again: one still running is adopted (watched through a pidfd; its exit
status is then unknown, reported as ``lost``), one that died meanwhile is
reported ``lost`` at once. Nothing keeps a slot without an agent watching it.
Beside them the manifest keeps the last replica launched in every slot, with
the placement it was launched for, so a restarted agent neither starts
``r<slot>-0`` again in a slot whose replica died nor a replica elasticity
asks for again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import socket
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import msgspec

from phalanx.schemas import environment, zygote
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import (
    DETAIL_CHARS,
    ExitCause,
    GpuInfo,
    JobRecord,
    RankExited,
    RankStarted,
)
from phalanx.schemas.replicas import incarnation, member_log
from phalanx.services.agent import core, pidfd, priority
from phalanx.services.agent.cgroups import MemoryCgroups
from phalanx.services.agent.core import (
    JobUser,
    StopReason,
    exit_cause,
    rank_cpus,
    rank_devices,
)
from phalanx.services.agent.cpus import pin as pin_cpus
from phalanx.services.agent.identity import EXIT_STATUSES, JobIdentities
from phalanx.services.agent.logs import replica_log, utc_now
from phalanx.services.agent.zygote import ChildProcess, ForkedProcess, Launcher
from phalanx.services.auth.credentials import rank_environment
from phalanx.services.deadline import wait_set
from phalanx.services.manifest import MANIFEST, start_ticks
from phalanx.services.ports import group_master_port

if TYPE_CHECKING:
    from phalanx.services.agent.spares import Spare, SpareSet

log = logging.getLogger("phalanx.agent.ranks")


def resolves(host: str) -> bool:
    """Whether ``host`` has an address here (a host name that does not is not advertised:
    the runtime then keeps its single-host default)."""
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True


def master_port(job_id: str, incarnation: int = 0) -> int:
    """A stable port per job and gang incarnation for ``MASTER_PORT`` (29500..39499): a
    gang started again rendezvous where no process of the one before can answer."""
    key = job_id if incarnation == 0 else f"{job_id}/{incarnation}"
    return 29500 + zlib.crc32(key.encode()) % 10000


#: How long a replica placed on a node whose slots are all held waits for one of them to be
#: let go (by a change of another job that this agent has not applied yet). Once a rank here
#: is stopping, its exit is waited for however long its grace period is.
SLOT_WAIT_S = 30.0


class ReplicaOutdated(PhalanxError, ValueError):
    """A launch request names an older incarnation than the slot's last launched replica."""


@dataclasses.dataclass(frozen=True)
class Replaced:
    """What :meth:`RankSet.replace` did."""

    pid: int | None
    """The replica's process; None when it was launched before and has exited."""
    new: bool
    """Started now; False: it was launched here before (a repeated request)."""
    from_spare: bool = False
    """Started now from a warm spare of the job (:mod:`.spares`)."""
    no_spare: bool = False
    """Not started: asked for from a warm spare only, and none runs here."""


@dataclasses.dataclass
class Member:
    """One more process of a replica of several ranks: its rank in the group (1 …), and
    this node's slots it holds."""

    group_rank: int
    pid: int
    ticks: int | None
    node_slots: tuple[int, ...]
    process: ChildProcess | None = None  # None when adopted


@dataclasses.dataclass
class Rank:
    """A replica running here: its process (group rank 0 of a replica of several ranks,
    whose other processes are ``group``), and the node's slots it holds, all of them."""

    job_id: str
    rank: int
    world_size: int
    placement: tuple[str, ...]
    pid: int
    ticks: int | None
    grace_s: float
    slots: int
    replica_id: str
    process: ChildProcess | None = None  # None when adopted
    stop: StopReason | None = None  # why this agent stops it (None: it does not)
    watcher: asyncio.Task[None] | None = None
    node_slots: tuple[int, ...] = ()  # this node's slots it holds (its LOCAL_RANK, GPUs)
    from_spare: bool = False  # a warm spare handed its identity, not a new process
    fault: str = ""  # the GPU fault it was killed for (stop GPU_FAULT)
    fault_seen_at: float | None = None  # when the health poll saw that fault
    admission: int = 0  # the job's admission it was started for (JobRecord.admission)
    group: tuple[Member, ...] = ()  # a group's other processes (ranks 1 …); () for one

    @property
    def stopping(self) -> bool:
        return self.stop is not None

    def processes(self) -> list[tuple[int, int, int | None, ChildProcess | None]]:
        """Each process of the replica: its group rank, pid, start time and handle (None
        when adopted)."""
        return [(0, self.pid, self.ticks, self.process),
                *((m.group_rank, m.pid, m.ticks, m.process) for m in self.group)]

    def log_name(self, group_rank: int) -> str:
        """The name of the log of the replica's process ``group_rank``."""
        return member_log(self.replica_id, group_rank if self.group else None)


class RankSet:
    """The ranks this node runs.

    Args:
        node_id: this node.
        work_dir: where rank logs and the manifest live.
        nats_url: passed to ranks as ``PHALANX_NATS_URL``.
        host_of: node id -> host name, for ``MASTER_ADDR``.
        report: awaited with each RankStarted / RankExited to publish.
        capacity: the node's slots: a launch waits while ranks that are stopping
            (a cancelled job's, say) still hold the slots it needs.
        replacement_nice: how much nicer than the agent a replacement replica starts,
            until it reports ready (:mod:`phalanx.runtime.priority`); 0: not at all.
        advertise_host: this node's host as peers reach it, passed to ranks as
            ``PHALANX_ADVERTISE_HOST`` (where their rendezvous store is reached) when it
            resolves here; a job's own env may set another.
        bus_identity: job id -> the bus credential variables its ranks connect with
            (:func:`phalanx.services.auth.credentials.rank_env`). Raises ``OSError``
            when the job has none: its ranks then fail to start. None: ranks connect
            with no credentials. Either way a rank gets none of the agent's credentials
            or configuration (:func:`~phalanx.services.auth.credentials.rank_environment`).
        snapshot_dir: job id -> the directory of the node's snapshot store that its ranks
            read (``PHALANX_SNAPSHOT_DIR``, with the job's ``checkpoint`` policy).
        checkpoint_dir: where ranks persist durable checkpoints when the job's spec names
            no ``checkpoint.durable_url``.
        gpus: the GPU of each of this node's slots (``agent.gpus``); empty: CPU slots.
        found_gpus: the GPUs NVML described: a rank is pinned to its GPUs' CPUs.
        slot_cpus: each CPU slot's share of the agent's CPU set (``agent.cpus``,
            :func:`~.cpus.shares`), where its ranks are pinned; empty: not pinned.
        cordoned: the node's slots out of use now (a GPU fault's), as the registry holds
            them at the moment of a launch: no rank starts there. None: none ever are.
        launcher: starts the processes (:mod:`.zygote`); None: each one cold.
        identities: each job's user on this node and its private directories
            (:mod:`.identity`, ``agent.job_uids``); None: every process runs as the agent.
        cgroups: where each process of a job that sets ``memory_per_rank`` is confined
            (:mod:`.cgroups`); None: nowhere, and ``no_cgroups`` says why (its ranks' logs
            say so).
        store_key: the cluster's key, from which each job's rendezvous secret is derived
            (:func:`~phalanx.schemas.environment.derive_store_secret`): its replicas' stores
            then answer its own members alone. None: they answer anyone.
    """

    def __init__(self, node_id: str, work_dir: Path, nats_url: str,
                 host_of: Callable[[str], Awaitable[str]],
                 report: Callable[[RankStarted | RankExited], Awaitable[None]],
                 capacity: int | None = None, replacement_nice: int = 0,
                 advertise_host: str | None = None,
                 bus_identity: Callable[[str], Mapping[str, str]] | None = None,
                 snapshot_dir: Callable[[str], Path] | None = None,
                 checkpoint_dir: Path | None = None, gpus: tuple[int, ...] = (),
                 found_gpus: Sequence[GpuInfo] = (),
                 slot_cpus: Sequence[Sequence[int]] = (),
                 cordoned: Callable[[], Awaitable[Collection[int]]] | None = None,
                 launcher: Launcher | None = None,
                 identities: JobIdentities | None = None,
                 store_key: bytes | None = None, cgroups: MemoryCgroups | None = None,
                 no_cgroups: str = "") -> None:
        self.node_id = node_id
        self.cgroups = cgroups
        self.no_cgroups = no_cgroups
        self.identities = identities
        self.store_key = store_key
        self.launcher = launcher or Launcher(work_dir, zygotes=False)
        self.gpus = gpus
        self.found_gpus = found_gpus
        self.slot_cpus = slot_cpus
        self.cordoned = cordoned
        self.snapshot_dir = snapshot_dir
        self.checkpoint_dir = checkpoint_dir
        self.advertise_host = advertise_host if advertise_host and resolves(advertise_host) \
            else None
        self.capacity = capacity
        self.nice = priority.current()  # the agent's: what a replica returns to when ready
        # Lowered only where the replica may raise it back: left low, it would straggle.
        self.replacement_nice = min(19, self.nice + replacement_nice) \
            if replacement_nice and priority.can_restore(self.nice) else None
        self._exit_seen = asyncio.Event()
        self.work_dir = work_dir
        self.nats_url = nats_url
        self.bus_identity = bus_identity
        self.host_of = host_of
        self.report = report
        self.ranks: dict[tuple[str, int], Rank] = {}
        # (job, slot) -> the replica last launched there, running or not: a slot's first
        # replica is launched once per placement, any replica at most once.
        self.launched: dict[tuple[str, int], core.Launch] = {}
        self._leaving: set[asyncio.Task[None]] = set()  # ranks given time to leave
        self._job_slots: dict[str, int] = {}  # job -> its slots per replica, as last seen
        #: The node's warm spares (:mod:`.spares`), which a replacement is taken from.
        self.spares: SpareSet | None = None
        work_dir.mkdir(parents=True, exist_ok=True)

    @property
    def slots_used(self) -> int:
        return sum(r.slots for r in self.ranks.values())

    def slots_placed(self) -> int:
        """The node's slots that admitted replicas are placed on, running or not (a dead
        rank's slot is its replacement's), or that ranks still stopping hold."""
        keys = set(self.launched) | set(self.ranks)
        return sum(self.ranks[k].slots if k in self.ranks else self._job_slots.get(k[0], 1)
                   for k in keys)

    def jobs(self) -> set[str]:
        """The jobs with a rank running here or a replica launched here."""
        return {job for job, _ in self.ranks} | {job for job, _ in self.launched}

    # --- desired state ------------------------------------------------------------------

    async def reconcile(self, record: JobRecord, *, elastic: bool = False) -> None:
        """Make this node run exactly the ranks ``record`` places here
        (:func:`~.core.reconcile`).

        ``elastic``: the job's membership is managed by elasticity, so a rank keeps
        running as long as its slot stays here, whatever else the placement does;
        otherwise (a torchrun-style job) a changed placement restarts the job's ranks
        with the new world.
        """
        job_id = record.job_id
        self._job_slots[job_id] = record.spec.slots_per_group
        await self._carry_out(record, core.reconcile(
            record, self.node_id, self._running(job_id), self._launched(job_id),
            elastic=elastic, capacity=self.capacity))

    async def replace(self, record: JobRecord, slot: int, replica_id: str,
                      warm_only: bool = False, gang: bool = False) -> Replaced:
        """Run ``replica_id`` in ``slot``, stopping what runs there first: a warm spare of
        the job told who it is (:mod:`.spares`) if one runs here, else a new process
        (``warm_only``: else nothing, and the replica id stays unused). ``gang``: the slot's
        part of a restart of the job's whole torchrun gang, a new process with the gang's
        variables.

        A replica launched here before, running or exited, is not started again
        (:func:`~.core.replacement`).

        Raises:
            LookupError: the job is not admitted with that slot on this node.
            ReplicaOutdated: a newer incarnation was launched in the slot already.
            OSError: the command cannot start.
        """
        key = (record.job_id, slot)
        running = self.ranks.get(key)
        decisions = core.replacement(
            record, self.node_id, slot, replica_id, self._running(record.job_id).get(slot),
            self.launched.get(key), gang=gang, warm_only=warm_only)
        match decisions:
            case [core.Refuse(reason=core.Refusal.OUTDATED, message=message)]:
                raise ReplicaOutdated(message)
            case [core.Refuse(message=message)]:
                raise LookupError(message)
            case [core.Keep(running=still)]:
                return Replaced(running.pid if still and running is not None else None,
                                new=False)
            case [*_, core.Start(warm_only=True)] if self.spares is None \
                    or self.spares.placeable(record.job_id,
                                             await self.unusable_slots(but=running)) is None:
                return Replaced(None, new=False, no_spare=True)
        (entry,) = await self._carry_out(record, decisions)
        if entry is None:
            raise OSError(f"cannot start {replica_id}: see the agent's log")
        return Replaced(entry.pid, new=True, from_spare=entry.from_spare)

    async def stop_replica(self, job_id: str, slot: int, replica_id: str) -> int | None:
        """Stop ``replica_id`` if it is what runs in ``slot``; returns its pid if it ran."""
        running = self.ranks.get((job_id, slot))
        decisions = core.stop_request(slot, replica_id, self._running(job_id).get(slot))
        await self._carry_out(job_id, decisions)
        return running.pid if decisions and running is not None else None

    async def drop(self, job_id: str) -> None:
        """Stop every rank of a job that is gone, and forget its launches
        (:func:`~.core.drop`)."""
        await self._carry_out(job_id, core.drop(self._running(job_id), self._launched(job_id)))

    def _running(self, job_id: str) -> dict[int, core.Launch]:
        """The job's ranks here (running or stopping), by slot, in the order they started."""
        return {slot: core.Launch(r.replica_id, r.placement)
                for (job, slot), r in self.ranks.items() if job == job_id}

    def _launched(self, job_id: str) -> dict[int, core.Launch]:
        """The replica last launched in each of the job's slots here."""
        return {slot: launch for (job, slot), launch in self.launched.items() if job == job_id}

    async def _carry_out(self, job: JobRecord | str,
                         decisions: Sequence[core.Decision]) -> list[Rank | None]:
        """Do what ``decisions`` say for ``job`` (its record, where they start a rank), in
        order; returns what each :class:`~.core.Start` started (None: it could not)."""
        job_id = job if isinstance(job, str) else job.job_id
        started: list[Rank | None] = []
        for decision in decisions:
            match decision:
                case core.Stop(slot=slot) | core.Leave(slot=slot):
                    entry = self.ranks.get((job_id, slot))
                    if entry is None or entry.replica_id != decision.replica_id:
                        continue  # exited while an earlier one was stopped
                    if isinstance(decision, core.Leave):
                        self._leave(entry, decision.timeout_s)
                    else:
                        await self.stop(entry)
                case core.Forget(slots=slots):
                    for slot in slots:
                        del self.launched[(job_id, slot)]
                    self._save()
                case core.Start():
                    assert isinstance(job, JobRecord), "a start needs the job's record"
                    started.append(await self._launch(
                        job, decision.slot, decision.placement, decision.replica_id,
                        nice=self.replacement_nice if decision.elastic else None,
                        elastic=decision.elastic))
                case core.Refuse(reason=core.Refusal.TOO_LARGE):
                    log.warning("refused a placement larger than this node: %s",
                                decision.message, extra={"job": job_id})
                case _:
                    raise TypeError(f"{decision!r} is not carried out by the rank set")
        return started

    def job_environment(self, record: JobRecord) -> dict[str, str]:
        """What every process of ``record``'s job starts with here, rank or spare: the
        agent's environment, then the job's, then what the runtime reads about the job
        (bus, node, backend, checkpoint policy) and its bus credentials.

        Raises:
            OSError: the job has no bus identity (``bus_identity``).
        """
        spec = record.spec
        checkpoint = None
        if self.snapshot_dir is not None and spec.checkpoint.memory_every_steps:
            policy = spec.checkpoint
            checkpoint = environment.CheckpointEnvironment(
                snapshot_dir=str(self.snapshot_dir(record.job_id)),
                memory_every=policy.memory_every_steps, memory_keep=policy.memory_keep,
                memory_overhead=policy.memory_overhead,
                memory_max_every=policy.memory_max_every_steps,
                durable_every=policy.durable_every_steps, durable_keep=policy.durable_keep,
                durable_url=policy.durable_url or str(self.checkpoint_dir),
                resume_from=policy.resume_from)
        job = environment.RankEnvironment(
            nats_url=self.nats_url, job_id=record.job_id, node_id=self.node_id,
            hang_timeout_s=spec.hang_timeout_s, backend=spec.backend.value,
            checkpoint=checkpoint)
        # The agent's own environment, then the job's, may name another host.
        advertised = environment.RankEnvironment(advertise_host=self.advertise_host)
        # A job of its own user gets its own HOME and TMPDIR (its env may name others), and
        # its own folder of the agent's durable directory where it names no place of its own.
        private = {} if self.identities is None else self.identities.prepare(
            record.job_id, None if spec.checkpoint.durable_url else self.checkpoint_dir)
        if self.identities is None:
            self.exit_statuses(record.job_id).mkdir(parents=True, exist_ok=True)
            private[environment.EXIT_STATUS_DIR] = str(self.exit_statuses(record.job_id))
        # Ranks run in the agent's environment, as torchrun's workers do.
        env = zygote.with_interpreter_path(
            {**advertised.to_env(), **os.environ, **private, **spec.env, **job.to_env()},
            sys.executable)
        env.pop(environment.STORE_SECRET, None)  # never the agent's, nor one a job names
        if self.store_key is not None:
            env[environment.STORE_SECRET] = environment.derive_store_secret(
                self.store_key, record.job_id)
        return rank_environment(env, self.bus_identity(record.job_id)
                                if self.bus_identity is not None else {})

    def exit_statuses(self, job_id: str) -> Path:
        """Where ``job_id``'s processes write their exit status
        (:data:`~phalanx.schemas.environment.EXIT_STATUS_DIR`)."""
        if self.identities is not None:
            return self.identities.exit_statuses(job_id)
        return self.work_dir / EXIT_STATUSES / job_id

    def recorded_end(self, job_id: str, group_rank: int, pid: int) -> core.ProcessEnd:
        """How process ``pid`` of ``job_id`` ended by its own word (the status it wrote as
        it ended), for one this agent did not see end; not known where it wrote none."""
        try:
            text = (self.exit_statuses(job_id) / str(pid)).read_text()
            return core.ProcessEnd(group_rank, int(text))
        except (OSError, ValueError):
            return core.ProcessEnd(group_rank, None, known=False)

    def forget_status(self, job_id: str, pid: int) -> None:
        """Remove the status ``pid`` of ``job_id`` wrote (its exit is reported, or the pid is
        a new process's)."""
        with contextlib.suppress(OSError):
            (self.exit_statuses(job_id) / str(pid)).unlink()

    def job_user(self, job_id: str) -> JobUser | None:
        """The user ``job_id``'s processes run as here (None: the agent's own).

        Raises:
            JobUidsExhausted: every uid of ``agent.job_uids`` is held.
        """
        return None if self.identities is None else self.identities.user(job_id)

    async def _identity(self, record: JobRecord, rank: int, placement: tuple[str, ...],
                        replica_id: str, slots: tuple[int, ...], nice: int | None,
                        elastic: bool, group_rank: int = 0,
                        group_port: int = 0) -> dict[str, str]:
        """The variables that make a process of the job replica ``replica_id`` in slot
        ``rank``, holding this node's ``slots``: what a warm spare is handed. ``elastic``:
        the job has a generation. Then, or when its spec declares a ``session``,
        torchrun's variables make the process a world of its own
        (:data:`~phalanx.schemas.environment.WORLD_OF_ONE`), not one of a gang. In a
        replica of several ranks they describe its group, whatever the job
        (:func:`~.core.group_variables`: rank ``group_rank`` of it, the group meeting on
        ``group_port``)."""
        ranks = record.spec.ranks_per_replica
        if ranks > 1:
            gang: Mapping[str, str] = core.group_variables(self.gpus, slots, group_rank, ranks,
                                                           group_port)
        elif elastic or record.spec.session:
            gang = environment.WORLD_OF_ONE
        else:
            local = sorted(s for s, node in record.placement().items() if node == self.node_id)
            gang = {
                "RANK": str(rank),
                "WORLD_SIZE": str(len(placement)), "LOCAL_WORLD_SIZE": str(len(local)),
                "GROUP_RANK": str(sorted(set(placement), key=placement.index)
                                  .index(self.node_id)),
                "MASTER_ADDR": await self.host_of(placement[0]),
                "MASTER_PORT": str(master_port(record.job_id, incarnation(replica_id) or 0))}
        replica = environment.RankEnvironment(
            rank=rank, replica_id=replica_id, world_size=len(placement),
            ranks_per_replica=ranks if ranks > 1 else None,
            group_rank=group_rank if ranks > 1 else None,
            admission=record.admission, nice_when_ready=None if nice is None else self.nice)
        return {
            **replica.to_env(),
            # The node's slots it runs in: its LOCAL_RANK and, on a GPU node, its GPUs alone.
            **rank_devices(self.gpus, slots),
            **gang,  # a world of one's LOCAL_RANK is 0: it sees its slots' GPUs alone
        }

    async def _launch(self, record: JobRecord, rank: int, placement: tuple[str, ...],
                      replica_id: str, nice: int | None = None,
                      elastic: bool = False) -> Rank | None:
        """Start ``replica_id`` in slot ``rank``: for a job that has a generation
        (``elastic``), a warm spare of the job told who it is if one runs here, else a new
        process."""
        # A slot never holds two ranks: until the replica has usable slots, it waits for the
        # next exit here (and reads the cordons once a try).
        deadline: float | None = None  # the end of SLOT_WAIT_S, from the first bounded wait
        while True:
            cordoned = await self._cordoned()
            held = self.held_slots()
            found = core.slots_for(record.spec.slots_per_group, held, cordoned,
                                   self.capacity, any(r.stopping for r in self.ranks.values()))
            if isinstance(found, tuple):
                slots = found
                break
            self._exit_seen.clear()
            if found is core.SlotWait.EXIT:
                # Admission frees a stopped job's slots at once; its ranks may take their
                # grace period to exit.
                await self._exit_seen.wait()
                continue
            if found is core.SlotWait.CORDONED:
                log.warning("no usable slot for a replica: the node's free slots are "
                            "cordoned", extra={"job": record.job_id, "rank": rank,
                                               "replica": replica_id,
                                               "cordoned": sorted(cordoned)})
                return None
            # SlotWait.MOVED: each job's records are applied on their own, so the ones that
            # stop those ranks may come after this one.
            if deadline is None:
                deadline = time.monotonic() + SLOT_WAIT_S
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("no free slot for a replica: the node's ranks did not make way "
                            f"within {SLOT_WAIT_S:g} s", extra={
                                "job": record.job_id, "rank": rank, "replica": replica_id})
                return None
            await wait_set(self._exit_seen, left)
        taken = self.spares.take(record.job_id, held | cordoned) \
            if elastic and self.spares is not None else None
        spare = None if taken is None else taken[0]
        if taken is not None and taken[1]:
            slots = taken[1]  # free slots on the GPUs the spare's processes already see
        self.launched[(record.job_id, rank)] = core.Launch(replica_id, placement)
        if spare is not None:
            entry = await self._hand_over(record, rank, placement, replica_id, slots, nice,
                                          elastic, spare)
            if entry is not None:
                return await self._started(record, entry, spare_taken=True)
        # No spare, or it died: new processes.
        if record.spec.ranks_per_replica > 1:
            return await self._launch_group(record, rank, placement, replica_id, slots, nice,
                                            elastic, spare_taken=spare is not None)
        identity = await self._identity(record, rank, placement, replica_id, slots, nice,
                                        elastic)
        log_path = self.log_path(record.job_id, replica_id)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        process = await self._start(record, rank, replica_id, identity, log_path)
        if process is None:
            return None
        self.pin(process.pid, slots)
        if nice is not None:
            with contextlib.suppress(ProcessLookupError):  # it may have died already
                priority.lower(process.pid, nice)
        self._record(record, rank, placement, replica_id, process, slots, from_spare=False)
        process.release()
        return await self._started(record, self.ranks[(record.job_id, rank)],
                                   spare_taken=spare is not None)

    async def _hand_over(self, record: JobRecord, rank: int, placement: tuple[str, ...],
                         replica_id: str, slots: tuple[int, ...], nice: int | None,
                         elastic: bool, spare: Spare) -> Rank | None:
        """Make the warm spare ``spare`` (taken) replica ``replica_id`` in slot ``rank``:
        in a spare group, rank s of it is told it is rank s of the replica, on its share of
        ``slots``, keeping the group variables it met with (its ``MASTER_PORT``). On the
        manifest before it learns who it is, as a new process is before it runs; None (and
        off the manifest) when one of its processes is gone."""
        ranks = record.spec.ranks_per_replica
        shares = core.group_slots(slots, ranks)
        identities = [await self._identity(record, rank, placement, replica_id, share, nice,
                                           elastic, group_rank=g, group_port=spare.group_port)
                      for g, share in enumerate(shares)]
        log_paths = [self.log_path(record.job_id, member_log(replica_id, g if ranks > 1
                                                             else None))
                     for g in range(ranks)]
        log_paths[0].parent.mkdir(parents=True, exist_ok=True)
        first, *rest = spare.processes
        self._record(record, rank, placement, replica_id, first, slots, from_spare=True,
                     group=tuple(Member(g, p.pid, start_ticks(p.pid), shares[g], p)
                                 for g, p in enumerate(rest, start=1)))
        if await spare.hand_over(identities, log_paths) is None:
            del self.ranks[(record.job_id, rank)]
            return None
        for process, share in zip(spare.processes, shares, strict=True):
            self.pin(process.pid, share)  # on the agent's CPUs until it held its slots
        return self.ranks[(record.job_id, rank)]

    async def _launch_group(self, record: JobRecord, rank: int, placement: tuple[str, ...],
                            replica_id: str, slots: tuple[int, ...], nice: int | None,
                            elastic: bool, *, spare_taken: bool) -> Rank | None:
        """Start ``replica_id`` in slot ``rank`` as a group of the spec's
        ``ranks_per_replica`` new processes on ``slots``, each on its share
        (:func:`~.core.group_slots`): every one held until all are on the manifest, then
        released together. None when one cannot start (reported as the replica's launch
        failure; the others, held, never run)."""
        shares = core.group_slots(slots, record.spec.ranks_per_replica)
        # The group's rendezvous, new for each incarnation.
        port = group_master_port(f"{record.job_id}/{replica_id}")
        started: list[ChildProcess] = []
        for group_rank, share in enumerate(shares):
            identity = await self._identity(record, rank, placement, replica_id, share, nice,
                                            elastic, group_rank=group_rank, group_port=port)
            log_path = self.log_path(record.job_id, member_log(replica_id, group_rank))
            log_path.parent.mkdir(parents=True, exist_ok=True)
            process = await self._start(record, rank, replica_id, identity, log_path)
            if process is None:
                for held in started:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(held.pid, signal.SIGKILL)
                    await held.wait()
                return None
            self.pin(process.pid, share)
            if nice is not None:
                with contextlib.suppress(ProcessLookupError):  # it may have died already
                    priority.lower(process.pid, nice)
            started.append(process)
        group = tuple(Member(g, process.pid, start_ticks(process.pid), shares[g], process)
                      for g, process in enumerate(started) if g)
        self._record(record, rank, placement, replica_id, started[0], slots,
                     from_spare=False, group=group)
        for process in started:
            process.release()
        return await self._started(record, self.ranks[(record.job_id, rank)],
                                   spare_taken=spare_taken)

    async def _started(self, record: JobRecord, entry: Rank, *, spare_taken: bool) -> Rank:
        """Watch ``entry``, just started (released), and report its start."""
        entry.watcher = asyncio.create_task(self._watch(entry))
        log.info("rank started", extra={
            "job": record.job_id, "rank": entry.rank, "pid": entry.pid,
            "replica": entry.replica_id, "from_spare": entry.from_spare,
            "group_pids": [m.pid for m in entry.group]})
        await self.report(RankStarted(job_id=record.job_id, rank=entry.rank,
                                      world_size=entry.world_size, node_id=self.node_id,
                                      pid=entry.pid, started_at=time.time(),
                                      replica_id=entry.replica_id, from_spare=entry.from_spare,
                                      admission=record.admission))
        if spare_taken and self.spares is not None:
            self.spares.replenish(record.job_id)  # the spare taken is replaced, later
        return entry

    def _record(self, record: JobRecord, rank: int, placement: tuple[str, ...],
                replica_id: str, process: ChildProcess, slots: tuple[int, ...], *,
                from_spare: bool, group: tuple[Member, ...] = ()) -> None:
        """Put ``process`` (and a group's other processes, ``group``) on the manifest as
        ``replica_id`` in slot ``rank``, holding ``slots``: before it runs any of the job's
        code, so an agent restarted after a crash adopts every rank that runs (a held
        process whose agent died first never runs)."""
        spec = record.spec
        self.ranks[(record.job_id, rank)] = Rank(
            record.job_id, rank, len(placement), placement, process.pid,
            start_ticks(process.pid), spec.grace_period_s, spec.slots_per_group,
            replica_id, process, node_slots=slots, from_spare=from_spare,
            admission=record.admission, group=group)
        self._save()

    async def _start(self, record: JobRecord, rank: int, replica_id: str,
                     identity: Mapping[str, str], log_path: Path) -> ChildProcess | None:
        """A new process of the job's command with ``identity``, held until released;
        None when it cannot start (reported to health as a launch failure)."""
        spec = record.spec
        with log_path.open("ab") as log_file:
            log_file.write(f"=== phalanx: {replica_id} of {record.job_id} starting on "
                           f"{self.node_id} at {utc_now()}: {_one_line(spec.command)}\n"
                           .encode())
            log_file.flush()
            try:
                env = {**self.job_environment(record), **identity}
                process = await self.launcher.start(spec.command, env, log_file, hold=True,
                                                    user=self.job_user(record.job_id))
                self.forget_status(record.job_id, process.pid)  # an earlier process's
                self.confine(record, process.pid, log_file)  # held: none of its code ran
                return process
            except OSError as exc:
                # The command cannot start (missing binary, bad path, no permission): the
                # application's failure, told to health with the reason and written where
                # the user looks (phalanx logs). It was launched all the same: a repeated
                # request must not try again.
                error = f"cannot start {_one_line(spec.command)}: {exc}"
                log_file.write(f"=== phalanx: {error}\n".encode())
                self._save()
                log.warning("cannot start rank %d of %s: %s", rank, record.job_id, exc)
                await self.report(RankExited(
                    job_id=record.job_id, rank=rank, node_id=self.node_id, pid=1,
                    cause=ExitCause.LAUNCH_FAILED, exited_at=time.time(),
                    replica_id=replica_id, detail=error[-DETAIL_CHARS:],
                    admission=record.admission))
                return None

    # --- exits --------------------------------------------------------------------------

    async def _watch(self, entry: Rank) -> None:
        """Report ``entry``'s end once all its processes are gone
        (:func:`~.core.group_exit`'s, in a group)."""
        end = core.group_exit(await self._ends(entry))
        pids = [pid for _, pid, _, _ in entry.processes()]
        oom = any(self._oom_killed(entry.job_id, pid) for pid in pids)
        self.unconfine(entry.job_id, pids)
        await self._exited(entry, exit_code=end.exit_code, signame=end.signal,
                           cause=exit_cause(entry.stop, status_known=end.known, oom=oom),
                           group_rank=end.group_rank)

    async def _ends(self, entry: Rank) -> list[core.ProcessEnd]:
        """How each of ``entry``'s processes ended, in the order seen, once all have. In a
        group the first to end takes the others down (:func:`~.core.siblings_wait_s`:
        after a clean exit they are given the grace period to end by themselves first)."""
        waits = {asyncio.create_task(self._end(entry.job_id, g, pid, ticks, process)):
                 (pid, ticks) for g, pid, ticks, process in entry.processes()}
        ends: list[core.ProcessEnd] = []

        async def seen(timeout_s: float | None = None, first: bool = False) -> None:
            done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=(
                asyncio.FIRST_COMPLETED if first else asyncio.ALL_COMPLETED))
            ends.extend(sorted((t.result() for t in done), key=lambda end: end.group_rank))
            for task in done:
                del waits[task]

        try:
            await seen(first=True)
            if waits and core.siblings_wait_s(ends[0], entry.grace_s) > 0:
                await seen(core.siblings_wait_s(ends[0], entry.grace_s))
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if not waits:
                    break
                log.info("stopping the rest of a group", extra={
                    "job": entry.job_id, "rank": entry.rank, "replica": entry.replica_id,
                    "signal": sig.name, "first": ends[0].group_rank})
                for pid, ticks in waits.values():
                    _signal_process(pid, ticks, sig)
                await seen(entry.grace_s if sig is signal.SIGTERM else None)
            return ends
        finally:
            for task in waits:  # cancelled itself: nothing is left waiting
                task.cancel()

    async def _end(self, job_id: str, group_rank: int, pid: int, ticks: int | None,
                   process: ChildProcess | None) -> core.ProcessEnd:
        """How a rank process ended (:func:`_end`); where this agent could not see its
        status, the status the process wrote as it ended, if it did."""
        end = await _end(group_rank, pid, ticks, process)
        return end if end.known else self.recorded_end(job_id, group_rank, pid)

    async def _exited(self, entry: Rank, *, exit_code: int | None, signame: str | None,
                      cause: ExitCause | None = None, group_rank: int = 0) -> None:
        if self.ranks.get((entry.job_id, entry.rank)) is entry:
            del self.ranks[(entry.job_id, entry.rank)]
            self._save()
        for _, pid, _, _ in entry.processes():
            self.forget_status(entry.job_id, pid)
        self._exit_seen.set()
        cause = cause or exit_cause(entry.stop)
        log.info("rank exited", extra={"job": entry.job_id, "rank": entry.rank,
                                       "exit_code": exit_code, "signal": signame,
                                       "cause": cause.value})
        pid = dict((g, p) for g, p, _, _ in entry.processes())[group_rank]
        exited = RankExited(job_id=entry.job_id, rank=entry.rank, node_id=self.node_id,
                            pid=pid, cause=cause, exited_at=time.time(),
                            exit_code=exit_code, signal=signame, replica_id=entry.replica_id,
                            with_agent=entry.stop is StopReason.AGENT, admission=entry.admission,
                            fault_seen_at=entry.fault_seen_at
                            if cause is ExitCause.GPU_FAULT else None)
        if exited.failed:  # its last output says why (an exception's traceback)
            output = self.last_output(entry.job_id, entry.log_name(group_rank))
            if cause is ExitCause.GPU_FAULT:  # the fault first, then what the rank said
                output = entry.fault + "\n" + output[-(DETAIL_CHARS - len(entry.fault) - 1):]
            exited = msgspec.structs.replace(exited, detail=output.rstrip())
        await self.report(exited)

    def log_path(self, job_id: str, log_name: str) -> Path:
        """The file a replica (a group's process: :func:`member_log`) writes its output to
        (``phalanx logs`` reads it)."""
        return replica_log(self.work_dir, job_id, log_name)

    def last_output(self, job_id: str, log_name: str, lines: int = 12) -> str:
        """The last ``lines`` lines of a replica's output (an exception's traceback ends
        there), at most :data:`DETAIL_CHARS` characters; empty if unreadable."""
        try:
            with self.log_path(job_id, log_name).open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4 * DETAIL_CHARS))
                tail = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(tail.rstrip().splitlines()[-lines:])[-DETAIL_CHARS:]

    # --- stopping and signals -----------------------------------------------------------

    def _leave(self, entry: Rank, timeout_s: float) -> None:
        """Let ``entry`` exit by itself within ``timeout_s``, then stop it (in the background:
        the job's other records are not held up, other jobs' launches wait for its slots)."""
        if entry.stopping:
            return  # leaving or stopping already
        entry.stop = StopReason.JOB

        async def leave() -> None:
            assert entry.watcher is not None
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(entry.watcher)
            except TimeoutError:
                log.warning("rank did not leave in time: stopping it",
                            extra={"job": entry.job_id, "rank": entry.rank,
                                   "replica": entry.replica_id, "timeout_s": timeout_s})
                await self.stop(entry)

        task = asyncio.create_task(leave())
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    async def stop(self, entry: Rank, reason: StopReason = StopReason.JOB) -> None:
        """SIGTERM the rank's process group, SIGKILL after its grace period; wait for exit.
        ``reason`` decides what its exit is reported as (:func:`~.core.exit_cause`)."""
        if entry.stop is None or reason is StopReason.AGENT:
            entry.stop = reason
        self._signal_group(entry, signal.SIGTERM)
        if entry.watcher is not None:
            try:
                async with asyncio.timeout(entry.grace_s):
                    await asyncio.shield(entry.watcher)
            except TimeoutError:
                self._signal_group(entry, signal.SIGKILL)
                await entry.watcher

    async def stop_all(self) -> None:
        """Stop every rank because this agent is shutting down: their jobs still want
        them, so their exits are reported lost (:func:`~.core.exit_cause`)."""
        await asyncio.gather(*(self.stop(r, StopReason.AGENT)
                               for r in list(self.ranks.values())))

    def _signal_group(self, entry: Rank, sig: signal.Signals) -> None:
        """Send ``sig`` to the process group of each of ``entry``'s processes."""
        for _, pid, ticks, _ in entry.processes():
            _signal_process(pid, ticks, sig)

    # --- confined memory ------------------------------------------------------------------

    def confine(self, record: JobRecord, pid: int, log_file: BinaryIO | None = None) -> None:
        """Put process ``pid`` of ``record``'s job in a memory cgroup of its own, limited to
        the spec's ``memory_per_rank`` (:mod:`.cgroups`); nothing when the spec sets none.
        Where that cannot be done, it runs unconfined, and ``log_file`` (its log) says so."""
        limit = record.spec.memory_limit
        if limit is None:
            return
        why = self.no_cgroups
        if self.cgroups is not None:
            path = self.cgroups.path(self.node_id, f"{record.job_id}-{pid}")
            try:
                self.cgroups.create(path, limit)
                self.cgroups.join(path, pid)
                return
            except OSError as exc:
                why = f"cannot confine it in {path}: {exc}"
                with contextlib.suppress(OSError):
                    self.cgroups.remove(path)
        log.warning("memory_per_rank not enforced: %s", why, extra={
            "job": record.job_id, "pid": pid})
        if log_file is not None:
            log_file.write(f"=== phalanx: memory_per_rank not enforced on {self.node_id}: "
                           f"{why}\n".encode())
            log_file.flush()

    def _oom_killed(self, job_id: str, pid: int) -> bool:
        """Whether the OOM killer ended a process in ``pid``'s cgroup (none: False)."""
        return self.cgroups is not None and self.cgroups.oom_killed(
            self.cgroups.path(self.node_id, f"{job_id}-{pid}"))

    def unconfine(self, job_id: str, pids: Collection[int]) -> None:
        """Remove the cgroups of ``job_id``'s processes ``pids``, which have ended."""
        if self.cgroups is None:
            return
        for pid in pids:
            try:
                self.cgroups.remove(self.cgroups.path(self.node_id, f"{job_id}-{pid}"))
            except OSError as exc:
                log.warning("cannot remove a rank's cgroup: %s", exc, extra={"job": job_id})

    async def _cordoned(self) -> set[int]:
        return set(await self.cordoned()) if self.cordoned is not None else set()

    def held_slots(self, but: Rank | None = None) -> set[int]:
        """The node's slots that ranks hold now (running or stopping), by index, except
        ``but``'s."""
        return {s for r in self.ranks.values() if r is not but for s in r.node_slots}

    async def unusable_slots(self, but: Rank | None = None) -> set[int]:
        """The node's slots no new process may use now: held (except ``but``'s, about to
        be stopped for its replacement) or cordoned."""
        return self.held_slots(but) | await self._cordoned()

    def gpu_fault(self, slots: Collection[int], fault: str, seen_at: float) -> list[Rank]:
        """The GPU of ``slots`` failed (``fault`` says how, seen at ``seen_at``): SIGKILL
        every rank holding one of them now, with no grace period (a step on a failed GPU
        cannot finish, and its job recovers the faster); each exit is reported
        ``gpu_fault`` by its watcher. Returns the ranks killed."""
        hit = [r for r in self.ranks.values() if set(r.node_slots) & set(slots)]
        for entry in hit:
            if entry.stop is None:  # one the job is letting go of is reported as before
                entry.stop = StopReason.GPU_FAULT
                entry.fault, entry.fault_seen_at = fault, seen_at
            self._signal_group(entry, signal.SIGKILL)
        return hit

    def fence(self) -> list[Rank]:
        """This node is cut off from the bus (:mod:`.fence`): SIGKILL every rank now, with
        no grace period (its job may be training on without it, and nothing it does now
        is kept). Each exit is reported lost by its watcher once the bus takes it; one the
        job was letting go of anyway is reported as before. Returns the ranks killed."""
        hit = list(self.ranks.values())
        for entry in hit:
            if entry.stop is None:
                entry.stop = StopReason.FENCED
            self._signal_group(entry, signal.SIGKILL)
        return hit

    def pin(self, pid: int, slots: tuple[int, ...]) -> None:
        """Pin a rank to its CPUs (:func:`~.core.rank_cpus`: its GPUs' or its CPU slots'
        share, those this agent may use), every thread it has; threads it starts later
        inherit them."""
        cpus = rank_cpus(self.gpus, self.found_gpus, slots, self.slot_cpus) \
            & os.sched_getaffinity(0)
        if cpus:
            pin_cpus(pid, cpus)

    def signal(self, job_id: str, rank: int, sig: signal.Signals) -> int:
        """Send ``sig`` to one rank process (chaos); returns its pid.

        Raises:
            KeyError: no such rank on this node.
        """
        entry = self.ranks[(job_id, rank)]
        os.kill(entry.pid, sig)
        return entry.pid

    # --- the manifest and adoption ------------------------------------------------------

    def _save(self) -> None:
        ranks = [{"job_id": r.job_id, "rank": r.rank, "world_size": r.world_size,
                  "placement": list(r.placement), "pid": r.pid, "ticks": r.ticks,
                  "grace_s": r.grace_s, "slots": r.slots, "replica_id": r.replica_id,
                  "node_slots": list(r.node_slots), "admission": r.admission,
                  "group": [{"group_rank": m.group_rank, "pid": m.pid, "ticks": m.ticks,
                             "node_slots": list(m.node_slots)} for m in r.group]}
                 for r in self.ranks.values()]
        launched = [{"job_id": job, "slot": slot, "placement": list(launch.placement),
                     "replica_id": launch.replica_id}
                    for (job, slot), launch in self.launched.items()]
        tmp = self.work_dir / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"ranks": ranks, "launched": launched}))
        tmp.replace(self.work_dir / MANIFEST)

    async def adopt(self) -> None:
        """Find the ranks a previous agent left: adopt the living, report the dead as lost;
        and remember what it launched."""
        try:
            recorded = json.loads((self.work_dir / MANIFEST).read_text())
        except (OSError, ValueError):
            return
        if isinstance(recorded, list):  # an agent of before the launches were kept
            recorded = {"ranks": recorded, "launched": []}
        for item in recorded["launched"]:
            self.launched[(item["job_id"], item["slot"])] = core.Launch(
                item["replica_id"], tuple(item["placement"]))
        for item in recorded["ranks"]:
            entry = Rank(item["job_id"], item["rank"], item["world_size"],
                         tuple(item["placement"]), item["pid"], item["ticks"], item["grace_s"],
                         item["slots"], item.get("replica_id", core.first_replica(item["rank"])),
                         node_slots=tuple(item.get("node_slots", ())),
                         admission=item.get("admission", 0),
                         group=tuple(Member(m["group_rank"], m["pid"], m["ticks"],
                                            tuple(m["node_slots"]))
                                     for m in item.get("group", ())))
            self.launched.setdefault((entry.job_id, entry.rank),
                                     core.Launch(entry.replica_id, entry.placement))
            if any(ticks is not None and start_ticks(pid) == ticks
                   for _, pid, ticks, _ in entry.processes()):
                # A group with one process gone is ended by its watcher: the rest stopped,
                # its end reported lost once.
                self.ranks[(entry.job_id, entry.rank)] = entry
                entry.watcher = asyncio.create_task(self._watch(entry))
                log.info("rank adopted", extra={"job": entry.job_id, "rank": entry.rank,
                                                "pid": entry.pid})
            else:  # ended while no agent watched: by its own word, or lost
                pids = [pid for _, pid, _, _ in entry.processes()]
                oom = any(self._oom_killed(entry.job_id, pid) for pid in pids)
                self.unconfine(entry.job_id, pids)
                end = core.group_exit([self.recorded_end(entry.job_id, g, pid)
                                       for g, pid, _, _ in entry.processes()])
                await self._exited(entry, exit_code=end.exit_code, signame=end.signal,
                                   cause=exit_cause(entry.stop, status_known=end.known,
                                                    oom=oom),
                                   group_rank=end.group_rank)
        self._save()


def _signal_process(pid: int, ticks: int | None, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group of rank process ``pid`` (started at ``ticks``)."""
    if start_ticks(pid) != ticks:
        return  # already gone (or the pid is someone else's now)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    if sig in (signal.SIGTERM, signal.SIGKILL):
        # A stopped (SIGSTOP) rank must run to act on SIGTERM.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGCONT)


async def _end(group_rank: int, pid: int, ticks: int | None,
               process: ChildProcess | None) -> core.ProcessEnd:
    """How a rank process ends, once it has: its status, or not known (adopted, watched
    through a pidfd; or its zygote died before it)."""
    if process is None:
        if ticks is not None and start_ticks(pid) == ticks:
            await pidfd.ended(pid)
        return core.ProcessEnd(group_rank, None, known=False)
    code = await process.wait()
    if isinstance(process, ForkedProcess) and process.status_lost:
        return core.ProcessEnd(group_rank, None, known=False)
    signame = None
    if code < 0:
        with contextlib.suppress(ValueError):
            signame = signal.Signals(-code).name
    return core.ProcessEnd(group_rank, None if code < 0 else code, signame)


def _one_line(command: list[str], limit: int = 200) -> str:
    """A command as a shell would read it, on one line and cut to ``limit`` characters."""
    line = shlex.join(command).replace("\n", "\\n")
    return line if len(line) <= limit else line[:limit - 1] + "…"
