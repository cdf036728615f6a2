"""Every message that crosses the bus, as typed, versioned structs.

A message type is a frozen ``msgspec.Struct`` whose wire name carries its
schema version (``phalanx.node_heartbeat.v1``) in the ``type`` field of the
MessagePack map. Decoding (see :mod:`phalanx.schemas.codec`) checks that name,
every field's type and range, rejects unknown fields, and runs each struct's
``__post_init__`` cross-field checks, so a handler only ever sees a valid
message. Changing a field's meaning or type means a new version name; adding
an optional field with a default does not.

Nested parts (``ReplicaRange``, ``Member`` …) are untagged: they travel only
inside a message and are versioned with it.
"""

from __future__ import annotations

import enum
import re
import sys
from typing import Annotated, Literal

import msgspec

#: A non-empty identifier usable as one subject token (see :mod:`.subjects`).
Ident = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+\Z")]
#: The largest integer a count, id or sequence may hold: a peer's value plus a little
#: arithmetic must still encode (MessagePack integers end at 2**64 - 1).
MAX_INT = 2**63 - 1
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
PosInt = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)]
#: A node's slots, a gang's replicas or a replica's slots: admission places a gang replica
#: by replica, so a bound keeps one pass finite (a node claiming 2**63 slots and a gang
#: wanting as many replicas kept it growing for good).
SlotCount = Annotated[int, msgspec.Meta(ge=1, le=65_536)]
#: The most replicas one job may have. Every per-job message and stored state (its
#: record, a generation, the health and elasticity leaders' snapshots) lists its replicas;
#: one whose encoding passes one NATS payload is stored in chunks and travels as a
#: :class:`Spilled` pointer to them (:mod:`phalanx.bus.spill`), up to
#: ``MAX_SPILLED_BYTES`` (tests/unit/services/test_job_size.py builds each at this size
#: with 128-character ids).
MAX_REPLICAS = 16_384
ReplicaCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS)]
#: The largest float: bounding by it refuses infinity (a timeout or time that never comes).
MAX_FLOAT = sys.float_info.max
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_FLOAT)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_FLOAT)]
Labels = Annotated[dict[str, str], msgspec.Meta(max_length=64)]
#: What an exec accepts: no NUL byte anywhere (an argument or value with one cannot be
#: passed to a process at all).
ExecString = Annotated[str, msgspec.Meta(pattern=r"^[^\x00]*\Z")]
#: A process environment a job adds: POSIX variable names, values an exec accepts.
Environment = Annotated[dict[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*\Z")],
                             ExecString], msgspec.Meta(max_length=64)]
#: The most of an error or of a process's last output a message carries.
DETAIL_CHARS = 4096
#: The most of why a generation formed (``Generation.cause``): it travels to every member.
CAUSE_CHARS = 2048
Cause = Annotated[str, msgspec.Meta(max_length=CAUSE_CHARS)]
#: ``host:port`` of a TCP listener (empty: not known).
Endpoint = Annotated[str, msgspec.Meta(
    max_length=300, pattern=r"^(|[A-Za-z0-9_.\-:\[\]]+:[0-9]{1,5})\Z")]


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
              tag_field="type"):
    """Base of every top-level message; subclasses set ``tag`` to their wire name.

    Subclasses (of this and of :class:`Part`) repeat ``frozen=True``: msgspec inherits it
    at run time, but type checkers read each class's own keywords (PEP 681).
    """

    @classmethod
    def wire_name(cls) -> str:
        tag = cls.__struct_config__.tag
        if not isinstance(tag, str):
            raise TypeError(f"{cls.__name__} has no wire name (set tag= on the class)")
        return tag


class Part(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of structs that only travel nested inside a :class:`Message`."""


# --- nodes ---------------------------------------------------------------------------------


#: The most GPUs one node reports (NVML numbers a host's devices from 0).
MAX_GPUS = 256
GpuIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_GPUS)]
#: Why a slot is cordoned, or a GPU fault's text: one line, bounded.
SlotReason = Annotated[str, msgspec.Meta(max_length=500)]


class GpuInfo(Part, frozen=True):
    """One GPU as the node's agent found it through NVML at start."""

    index: GpuIndex  # NVML's index, the CUDA device index when CUDA_DEVICE_ORDER=PCI_BUS_ID
    uuid: Annotated[str, msgspec.Meta(max_length=128)]
    name: Annotated[str, msgspec.Meta(max_length=128)] = ""
    memory_bytes: NonNegInt = 0
    pci_bus_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    numa_node: NonNegInt | None = None  # None: NVML does not say (one socket, an old driver)
    #: The CPUs close to it (NVML's CPU affinity); its ranks are pinned to them.
    cpus: Annotated[list[NonNegInt], msgspec.Meta(max_length=4096)] = []


class NodeInfo(Part, frozen=True):
    """What an agent registers about its machine."""

    node_id: Ident
    #: Where peers reach the node: the agent's ``address`` where it has one, else its host
    #: name.
    host: str
    slots: SlotCount
    failure_domain: Ident
    labels: Labels = {}
    agent_pid: NonNegInt = 0
    agent_version: str = ""
    started_at: NonNegFloat = 0.0
    #: TCP port of the agent's snapshot replication listener on ``host`` (0: none).
    replica_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    #: The GPUs NVML showed the agent (none: NVML absent, a CPU node).
    gpus: Annotated[list[GpuInfo], msgspec.Meta(max_length=MAX_GPUS)] = []


class NodeRecord(Message, tag="phalanx.node_record.v1", frozen=True):
    """The node registry's entry for one node (KV bucket ``phalanx_nodes``, key = node id).

    ``heartbeat_at`` is the agent's wall clock at its last heartbeat; readers
    compare it with their own clock, so hosts need roughly synchronised clocks
    (NTP-level skew is far below the default node timeout).
    """

    node: NodeInfo
    heartbeat_seq: NonNegInt = 0
    heartbeat_at: NonNegFloat = 0.0
    slots_used: NonNegInt = 0
    cordoned: bool = False
    #: Bytes of snapshot buffers the agent holds in shared memory, and its bound.
    snapshot_bytes: NonNegInt = 0
    snapshot_limit_bytes: NonNegInt = 0
    #: Why the agent last refused a snapshot reservation ("" while it refused none).
    snapshot_refused: Annotated[str, msgspec.Meta(max_length=DETAIL_CHARS)] = ""
    #: The node's slots taken out of use, each with why (its GPU failed): local slot ->
    #: reason. The agent adds them; an operator removes them (``phalanx node uncordon
    #: --slot``). The rest of the node stays usable.
    cordoned_slots: dict[NonNegInt, SlotReason] = {}

    def __post_init__(self) -> None:
        if self.slots_used > self.node.slots:
            raise ValueError(
                f"slots_used {self.slots_used} exceeds the node's {self.node.slots} slots"
            )
        beyond = sorted(s for s in self.cordoned_slots if s >= self.node.slots)
        if beyond:
            raise ValueError(f"cordoned_slots {beyond} are beyond the node's "
                             f"{self.node.slots} slots (0..{self.node.slots - 1})")

    @property
    def usable_slots(self) -> int:
        """The slots new work may be placed on, cordoned node aside: all but the
        cordoned ones."""
        return self.node.slots - len(self.cordoned_slots)


class NodeHeartbeat(Message, tag="phalanx.node_heartbeat.v1", frozen=True):
    """An agent's periodic sign of life, published on ``phalanx.node.<node>.heartbeat``."""

    node_id: Ident
    seq: NonNegInt
    sent_at: NonNegFloat
    slots_used: NonNegInt = 0


class NodeStatusRequest(Message, tag="phalanx.node_status_request.v1", frozen=True):
    """Asks an agent for its current :class:`NodeRecord` (no fields)."""


# --- jobs ----------------------------------------------------------------------------------


class ReplicaRange(Part, frozen=True):
    """Data-parallel replica counts; ``min == max`` is a rigid gang."""

    min: ReplicaCount
    max: ReplicaCount

    def __post_init__(self) -> None:
        if self.min > self.max:
            raise ValueError(f"replicas.min {self.min} is greater than replicas.max {self.max}")


class Placement(Part, frozen=True):
    """Where a job's replicas may go."""

    node_labels: Labels = {}
    spread_failure_domains: bool = False


class RestartPolicy(Part, frozen=True):
    """How many failures a job survives before it ends ``failed``: restarts count only \
while they repeat with no committed step between them (see :mod:`~phalanx.\
services.health.policy`).

    Restarts fail a job only when they repeat without a committed step between
    them (a crash loop): ``max_restarts`` is how many restart rounds a job
    survives in a row with no step committed, however far apart, and
    ``max_restarts_in_window`` how many of those within any ``window_s``. A
    committed step ends the streak, so a job that trains between faults is never
    failed by them. (Before, both counted every replica replaced over the
    admission.) Ranks failing together — a node's ranks, every rank killed at
    once — are one round. An *application* failure (the script exits non-zero
    by itself, or cannot be started) is replaced at most ``max_app_failures``
    times over the admission: the one after fails the job, since running the
    same code again fails the same way.
    """

    max_restarts: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 16
    max_app_failures: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1
    max_restarts_in_window: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 8
    window_s: PosFloat = 300.0


class ScalingPolicy(Part, frozen=True):
    """How an elastic job's size may change (see :mod:`~phalanx.schemas.scaling`).

    Sizes are counts of replicas within ``replicas.min..max``. With
    ``replica_increment_step`` k the allowed sizes are ``min, min + k, min + 2k, ...``
    (up to ``max``); with ``replica_discrete_values`` exactly the listed sizes (each
    within ``min..max``; the smallest is then the size a gang is admitted at); the two
    are mutually exclusive, and neither means every size.
    Growth comes no sooner than ``scale_up_cooldown_s`` after the job's last size
    change. A replica leaving in a planned shrink has ``graceful_shutdown_timeout_s``
    to finish its step and exit before it is stopped and handled as a fault; a planned
    change not complete after ``scaling_timeout_s`` is abandoned and reported.
    """

    replica_increment_step: ReplicaCount | None = None
    replica_discrete_values: Annotated[list[ReplicaCount], msgspec.Meta(min_length=1,
                                                                     max_length=1024)] | None = None
    scale_up_cooldown_s: NonNegFloat = 0.0
    graceful_shutdown_timeout_s: PosFloat = 30.0
    scaling_timeout_s: PosFloat = 600.0

    def __post_init__(self) -> None:
        if self.replica_increment_step is not None and self.replica_discrete_values is not None:
            raise ValueError("scaling: give replica_increment_step or replica_discrete_values, "
                             "not both")
        values = self.replica_discrete_values
        if values is not None and sorted(set(values)) != values:
            raise ValueError(f"scaling.replica_discrete_values must be distinct and ascending, "
                             f"got {values}")


class CheckpointPolicy(Part, frozen=True):
    """When a job's state is snapshotted (docs/checkpoints.md).

    Every ``memory_every_steps`` committed steps (0: never) each rank copies its share
    of the state into its node agent's shared memory, in a ring of ``memory_keep``
    buffers per share (2: double-buffered; the newest commit is never overwritten).
    ``"auto"`` (the default) adapts the interval to the measured cost: the ranks agree
    after every step on the smallest interval at which a snapshot's cost in the training
    thread stays within ``memory_overhead`` of the training time, at most
    ``memory_max_every_steps`` (:mod:`phalanx.runtime.snapshot_interval`).

    Every ``durable_every_steps`` committed steps (0: never; a multiple of a fixed
    ``memory_every_steps``; under ``"auto"`` those steps are always snapshotted) each
    rank also persists its share to ``durable_url`` in
    PyTorch Distributed Checkpoint format (a directory, shared for multi-node, or any
    fsspec URL; empty: the agent's ``checkpoint_dir``), keeping the newest
    ``durable_keep`` steps. ``resume_from`` names an earlier job whose newest durable
    step this job starts from (``phalanx submit --resume JOB``).
    """

    memory_every_steps: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | Literal[
        "auto"] = "auto"
    memory_keep: Annotated[int, msgspec.Meta(ge=2, le=16)] = 2
    memory_overhead: Annotated[float, msgspec.Meta(gt=0.0, le=0.5)] = 0.02
    memory_max_every_steps: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 100
    durable_every_steps: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    durable_keep: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 2
    durable_url: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    resume_from: Ident | None = None

    def __post_init__(self) -> None:
        every = self.memory_every_steps
        if self.durable_every_steps and isinstance(every, int) and (
                not every or self.durable_every_steps % every):
            raise ValueError(f"checkpoint.durable_every_steps ({self.durable_every_steps}) "
                             "must be a multiple of checkpoint.memory_every_steps "
                             f"({self.memory_every_steps}): a durable step is persisted "
                             "from its memory snapshot")


class CollectiveBackend(enum.StrEnum):
    """Which process group a job's runtime builds each generation (docs/gpu.md)."""

    AUTO = "auto"  # NCCL on a rank that has a GPU, gloo on one that has none
    NCCL = "nccl"  # GPU ranks only: each rank needs a GPU of its own
    GLOO = "gloo"  # CPU tensors, or CUDA tensors of ranks that share a GPU


#: The least ``memory_per_rank`` a job may set.
MIN_RANK_MEMORY = 64 << 20
_MEMORY_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                 "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}
#: An amount of memory with a unit, as Kubernetes writes it (``512Mi``, ``4Gi``, ``2G``).
MEMORY_PATTERN = r"^([0-9]{1,15}(?:\.[0-9]{1,6})?)([KMGT]i?)?$"
_MEMORY = re.compile(MEMORY_PATTERN)


def memory_bytes(value: int | str) -> int:
    """``value`` in bytes: a whole number of bytes, or a number with a unit as Kubernetes
    writes it (``512Mi``, ``4Gi``, ``2G``, ``1.5Gi``).

    Raises:
        ValueError: ``value`` is no amount of memory.
    """
    if isinstance(value, int):
        return value
    match = _MEMORY.match(value)
    if match is None:
        raise ValueError(f"memory_per_rank {value!r} is no amount of memory: give bytes, "
                         "or a number with a unit (512Mi, 4Gi, 2G)")
    return int(float(match[1]) * _MEMORY_UNITS[(match[2] or "").upper()])


class JobSpec(Message, tag="phalanx.job_spec.v1", frozen=True):
    """A job as submitted: a gang of data-parallel replicas and how to run them.

    ``backend`` picks the collectives' process group: ``auto`` is NCCL on a rank that
    has a GPU (its agent lists GPUs: ``agent.gpus``) and gloo on one that has none, so
    the same spec runs on CPU and GPU nodes; ranks sharing one GPU need ``gloo``.

    ``spares`` is how many warm spare processes of the job each of its nodes keeps
    while it has a free slot for them (:mod:`phalanx.services.agent.spares`): a
    replacement is then a spare told its replica id instead of a cold start. 0 keeps
    none. Unset (the default): one, once the job's ranks have shown that they run a
    phalanx session (the job has a generation), and none before; a spare of a command
    that never starts a session would run the whole command beside its ranks.

    ``ranks_per_replica`` makes a replica a *group* of that many rank processes, each
    with ``slots_per_replica`` slots of its own, placed together on one node: a model
    sharded inside the group (FSDP2, tensor or pipeline parallel: the script's business)
    and replicated across groups by phalanx (docs/hsdp.md). The group is the unit of
    ``replicas``, of failure and of spares. 1 (the default): a replica is one process.

    ``session`` says that the ranks run a phalanx session (``ElasticSession``), which
    is otherwise known only once the job has a generation. From then on torchrun's
    variables make each process a world of its own, so that a ported DDP script's own
    ``init_process_group`` never waits for a peer; before it they describe the gang, as
    torchrun's would, and a replica that dies between its start and DDP's constructor
    holds the others there. ``session: true`` gives the world of one from the first
    start, and spares (unless ``spares`` says otherwise) too.

    ``memory_per_rank`` bounds each rank process's memory (bytes, or a number with a unit:
    ``"512Mi"``, ``"4Gi"``, ``"2G"``): its agent runs it in a memory cgroup of its own
    with that limit (:mod:`phalanx.services.agent.cgroups`), so a rank that allocates
    past it is killed alone, reported with cause ``oom``, and replaced as a crash is
    (an application failure: :class:`RestartPolicy`). Unset: no limit of its own.
    """

    name: Ident
    team: Ident
    priority_class: Ident
    replicas: ReplicaRange
    command: Annotated[list[ExecString], msgspec.Meta(min_length=1)]
    slots_per_replica: SlotCount = 1
    ranks_per_replica: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    placement: Placement = Placement()
    env: Environment = {}
    schedule_timeout_s: PosFloat | None = None
    grace_period_s: NonNegFloat = 10.0
    hang_timeout_s: PosFloat = 2.0
    restart_policy: RestartPolicy = RestartPolicy()
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    scaling: ScalingPolicy = ScalingPolicy()
    backend: CollectiveBackend = CollectiveBackend.AUTO
    spares: Annotated[int, msgspec.Meta(ge=0, le=64)] | None = None
    session: bool = False
    memory_per_rank: Annotated[int, msgspec.Meta(ge=MIN_RANK_MEMORY, le=1 << 50)] | Annotated[
        str, msgspec.Meta(pattern=MEMORY_PATTERN, max_length=32)] | None = None

    @property
    def slots_per_group(self) -> int:
        """The slots one replica takes on its node: each of its ranks' slots."""
        return self.ranks_per_replica * self.slots_per_replica

    @property
    def memory_limit(self) -> int | None:
        """``memory_per_rank`` in bytes (None: unset)."""
        return None if self.memory_per_rank is None else memory_bytes(self.memory_per_rank)

    def __post_init__(self) -> None:
        limit = self.memory_limit  # raises on a value that is no amount of memory
        if limit is not None and limit < MIN_RANK_MEMORY:
            raise ValueError(f"memory_per_rank {self.memory_per_rank!r} is {limit} B: at "
                             f"least {MIN_RANK_MEMORY >> 20} MiB (a rank's interpreter "
                             "alone takes more)")
        values = self.scaling.replica_discrete_values
        if values is not None and (values[0] < self.replicas.min
                                   or values[-1] > self.replicas.max):
            raise ValueError(f"scaling.replica_discrete_values {values} must lie within "
                             f"replicas.min..max = {self.replicas.min}..{self.replicas.max}")


class JobState(enum.StrEnum):
    PENDING = "pending"
    ADMITTED = "admitted"
    FAILED = "failed"
    CANCELLED = "cancelled"
    FINISHED = "finished"

    @property
    def terminal(self) -> bool:
        return self in (JobState.FAILED, JobState.CANCELLED, JobState.FINISHED)


class ReasonCode(enum.StrEnum):
    """Why a job is in its state; every pending job has one."""

    QUEUED = "queued"
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    RESERVED = "reserved"
    QUOTA = "quota"
    UNSCHEDULABLE = "unschedulable"
    PREEMPTED = "preempted"
    NODE_LOST = "node_lost"
    MEMBERS_LOST = "members_lost"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    FINISHED = "finished"
    ADMITTED = "admitted"
    APP_FAILED = "app_failed"  # the script failed by itself more than max_app_failures times
    LAUNCH_FAILED = "launch_failed"  # the command could not be started
    RESTARTS_EXHAUSTED = "restarts_exhausted"  # over max_restarts rounds without progress
    RESTART_RATE = "restart_rate"  # over max_restarts_in_window of them within window_s
    SCALED = "scaled"  # an operator pinned its size, or a growth was abandoned at its deadline


class ScalingEventKind(enum.StrEnum):
    """What happened to an elastic job's size (:class:`ScalingEvent`)."""

    GROW = "grow"  # admission gave it replicas
    SHRINK = "shrink"  # admission took replicas (preemption, reclaim, a pin, a node lost)
    PIN = "pin"  # an operator pinned its size (phalanx scale --replicas)
    RELEASE = "release"  # an operator released the pin (phalanx scale --auto)
    DONE = "done"  # a planned change is complete: the runtime runs at its size
    TIMEOUT = "timeout"  # a planned change was not complete by its deadline: abandoned


class ScalingChange(Part, frozen=True):
    """A planned size change in progress (``JobRecord.scaling_change``): from
    ``from_replicas`` to ``to_replicas``, begun at ``started_at`` for ``reason``; abandoned
    if the job's runtime does not run at the new size by ``deadline``
    (``scaling.scaling_timeout_s`` later)."""

    kind: ScalingEventKind
    from_replicas: ReplicaCount
    to_replicas: ReplicaCount
    reason: str
    started_at: NonNegFloat
    deadline: NonNegFloat

    def __post_init__(self) -> None:
        if self.kind not in (ScalingEventKind.GROW, ScalingEventKind.SHRINK):
            raise ValueError(f"a scaling change grows or shrinks, not {self.kind.value!r}")


class JobRecord(Message, tag="phalanx.job_record.v1", frozen=True):
    """A job's admission state (KV bucket ``phalanx_jobs``, key = job id).

    Published on ``phalanx.job.<job>.state`` whenever it changes. ``nodes``
    holds one node id per admitted replica (a node repeats when it runs
    several); it is empty unless the job is admitted. ``slots`` names each
    entry's slot (empty: ``0..len(nodes)-1``): a slot keeps its number while
    the job runs, so shrinking a placement never renumbers the replicas that
    stay. ``next_slot`` is the lowest number this admission never used: a job
    growing back after a shrink gets new numbers, so a replica id (``r<slot>-<n>``)
    never names two processes. ``pinned_replicas`` is the size an operator pinned an
    elastic job to (``phalanx scale``); None: admission sizes it. ``scaling_change`` is
    the planned size change in progress, if any. ``trace`` is the W3C ``traceparent`` of
    the job's submission (empty when it was not traced): the job's trace, in which
    admission's decisions about it and its scaling events are spans. ``admission``
    counts the job's admissions: 1 from its first, one more each time it is admitted
    again after a requeue (0: never admitted). Its ranks carry it in their events, so
    that an earlier admission's, read late, is never taken for the current one's (the
    replica ids and generation numbers start again at each admission).
    """

    job_id: Ident
    spec: JobSpec
    state: JobState
    submitted_at: NonNegFloat
    updated_at: NonNegFloat
    reason_code: ReasonCode
    reason: str = ""
    nodes: list[Ident] = []
    slots: list[NonNegInt] = []
    next_slot: NonNegInt = 0
    pinned_replicas: ReplicaCount | None = None
    scaling_change: ScalingChange | None = None
    admission: NonNegInt = 0
    trace: Annotated[str, msgspec.Meta(
        pattern=r"^(00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})?\Z")] = ""

    def __post_init__(self) -> None:
        if self.state is JobState.ADMITTED and not self.nodes:
            raise ValueError("an admitted job must name the node of each replica")
        if len(self.nodes) > self.spec.replicas.max:
            # Every reader walks the placement (and an agent launches from it): bounded by
            # the job's own size, so a record cannot make any of them do unbounded work.
            raise ValueError(f"{len(self.nodes)} nodes entries place more replicas than the "
                             f"job's replicas.max ({self.spec.replicas.max})")
        if self.slots and (len(self.slots) != len(self.nodes)
                           or len(set(self.slots)) != len(self.slots)):
            raise ValueError(f"slots {self.slots} must name each of the {len(self.nodes)} "
                             "nodes entries once")
        if self.slots and self.next_slot and max(self.slots) >= self.next_slot:
            raise ValueError(f"next_slot {self.next_slot} must exceed every slot in use "
                             f"({max(self.slots)})")

    def placement(self) -> dict[int, str]:
        """Slot -> node of an admitted job (empty otherwise)."""
        if self.state is not JobState.ADMITTED:
            return {}
        return dict(zip(self.slots or range(len(self.nodes)), self.nodes, strict=True))


class SubmitRequest(Message, tag="phalanx.submit_request.v1", frozen=True):
    """Submit ``spec`` as ``job_id``; resubmitting the same pair is a no-op (safe to retry)."""

    job_id: Ident
    spec: JobSpec


class JobRequest(Message, tag="phalanx.job_request.v1", frozen=True):
    """Names one job (cancel, explain)."""

    job_id: Ident


class RequeueRequest(Message, tag="phalanx.requeue_request.v1", frozen=True):
    """Elasticity hands a running job back to the queue: too few members for too long."""

    job_id: Ident
    reason: str


class ScaleRequest(Message, tag="phalanx.scale_request.v1", frozen=True):
    """An operator pins an elastic job to ``replicas`` (``phalanx scale JOB --replicas N``):
    one of its allowed sizes; None releases the pin (``--auto``: admission sizes it)."""

    job_id: Ident
    replicas: ReplicaCount | None = None


class ScalingEvent(Message, tag="phalanx.scaling_event.v1", frozen=True):
    """A change of an elastic job's size, announced by the admission leader on
    ``phalanx.job.<job>.scaling`` once the job record says it.

    ``from_replicas``/``to_replicas`` are the placement's sizes before and after (for a
    pin, the size pinned; for a release, the size it runs at; for done and timeout,
    the planned change's). ``deadline`` is when a planned change is abandoned (None: the
    change is not tracked — a node lost, or a job whose runtime never reported a
    membership).
    """

    job_id: Ident
    kind: ScalingEventKind
    from_replicas: NonNegInt
    to_replicas: NonNegInt
    reason: str
    at: NonNegFloat
    deadline: NonNegFloat | None = None


class Explanation(Message, tag="phalanx.explanation.v1", frozen=True):
    """Why a job is where it is, as the admission leader sees it now."""

    job_id: Ident
    state: JobState
    reason_code: ReasonCode
    reason: str
    position: NonNegInt | None = None
    queue_length: NonNegInt = 0
    nodes: list[Ident] = []


class JobPlacement(Message, tag="phalanx.job_placement.v1", frozen=True):
    """One job's committed placement in admission's ledger (key ``job.<job id>``).

    What the job holds: one node id per replica. The slots are reserved first in
    each node's :class:`NodeClaims`, so a placement never names a slot its node's
    claims do not hold. Empty ``nodes``: the job holds nothing (a requeued job; a new
    leader writes it to fence off an older leader's commit).
    """

    team: Ident
    slots_per_replica: SlotCount
    nodes: list[Ident] = []
    updated_at: NonNegFloat = 0.0


class NodeClaims(Message, tag="phalanx.node_claims.v1", frozen=True):
    """The slots admission has reserved on one node (key ``node.<node id>``), by job.

    Every slot a job is given is claimed here first, compare-and-swapped on this
    record's revision, so two admission instances can never hand out the same slot
    twice: the record of a node is the only place its slots are given.
    """

    claims: dict[Ident, PosInt] = {}
    updated_at: NonNegFloat = 0.0


class Lease(Message, tag="phalanx.lease.v1", frozen=True):
    """Leadership of a service: ``holder`` leads while it renews. ``expires_at`` is when
    the lease runs out by the holder's clock, for people to read: a standby judges the
    lease by watching its revision go unrenewed by its own clock (``services/lease.py``)."""

    holder: Ident
    epoch: NonNegInt
    expires_at: NonNegFloat


class StreamCursor(Message, tag="phalanx.stream_cursor.v1", frozen=True):
    """How far a service has acted on the job-events stream (bucket ``phalanx_cursors``,
    key = service): every event up to ``seq`` has been acted on and its effect stored."""

    seq: NonNegInt
    updated_at: NonNegFloat = 0.0


class JobSnapshot(Message, tag="phalanx.job_snapshot.v1", frozen=True):
    """One running job's state in a leader-leased service (buckets ``phalanx_elasticity``
    and ``phalanx_health``, key = job id), for the instance that leads next.

    ``state`` is the service core's own encoding of the job (only that service
    reads it; ``format`` names the encoding); ``seq`` is the job-events stream
    sequence of the last event it reflects, so a new leader knows which events
    it has already seen.
    """

    job_id: Ident
    seq: NonNegInt
    format: PosInt
    state: bytes


# --- values larger than one payload ---------------------------------------------------------

#: The most bytes one value stored in chunks may take (a generation of ``MAX_REPLICAS``
#: members with 128-character ids and 300-character endpoints takes about 8 MiB).
MAX_SPILLED_BYTES = 64 << 20
#: A SHA-256 digest in hex.
Digest = Annotated[str, msgspec.Meta(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}\Z")]


class Spilled(Message, tag="phalanx.spilled.v1", frozen=True):
    """Stands for a value too large for one payload (:mod:`phalanx.bus.spill`): stored
    under key ``key`` of KV bucket ``bucket`` (and published on its subject) in its
    place, while the value's encoding is held in ``chunks`` pieces in bucket
    ``phalanx_chunks``, keys ``<bucket>.<key>.<digest>.<i>``.

    The chunks are written before this pointer, never changed, and removed only once a
    newer value has replaced it: a reader that finds one missing reads the key again (a
    newer value), and one whose bytes do not hash to ``digest`` refuses them, so no
    reader ever decodes half a value. ``of`` is the wire name of the message stored.
    """

    bucket: Ident
    key: Annotated[str, msgspec.Meta(min_length=1, max_length=512,
                                     pattern=r"^[-/_=.a-zA-Z0-9]+\Z")]
    of: Annotated[str, msgspec.Meta(max_length=128, pattern=r"^phalanx\.[a-z_]+\.v[0-9]+\Z")]
    digest: Digest
    size: Annotated[int, msgspec.Meta(ge=1, le=MAX_SPILLED_BYTES)]
    chunks: Annotated[int, msgspec.Meta(ge=1, le=1024)]


# --- membership ----------------------------------------------------------------------------


class GenerationReason(enum.StrEnum):
    START = "start"
    FAULT = "fault"
    JOIN = "join"
    LEAVE = "leave"


class Member(Part, frozen=True):
    """One replica's place in a generation."""

    replica_id: Ident
    rank: NonNegInt
    node_id: Ident
    endpoint: Endpoint = ""  # the replica's rendezvous store, host:port


class Generation(Message, tag="phalanx.generation.v1", frozen=True):
    """One membership of a running job, published on ``phalanx.job.<job>.generation``.

    Members are ordered by rank (0..world_size-1). ``rendezvous`` is a fresh
    namespace per generation so no process group state leaks across changes.
    """

    job_id: Ident
    generation: NonNegInt
    members: list[Member]
    world_size: PosInt
    rendezvous: Ident
    resume_step: NonNegInt
    reason: GenerationReason
    cause: Cause = ""

    def __post_init__(self) -> None:
        if len(self.members) != self.world_size:
            raise ValueError(
                f"world_size {self.world_size} but {len(self.members)} members listed"
            )
        ranks = [m.rank for m in self.members]
        if ranks != list(range(self.world_size)):
            raise ValueError(f"member ranks must be 0..{self.world_size - 1} in order, got {ranks}")
        replicas = [m.replica_id for m in self.members]
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"a replica is listed twice in {replicas}")

    def member(self, replica_id: str) -> Member | None:
        """This generation's entry for ``replica_id``, or None if it is not a member."""
        return next((m for m in self.members if m.replica_id == replica_id), None)


class ReplicaReady(Message, tag="phalanx.replica_ready.v1", frozen=True):
    """A replica can join (``phalanx.job.<job>.ready``): torch imported, model built.

    ``slot`` is the job's placement slot the replica runs in; ``endpoint`` is
    its rendezvous store, used when it is rank 0 of a generation.
    ``committed_step`` is the last step whose state it holds (0 when fresh).
    ``admission`` is the job's admission it was started for (:class:`JobRecord`;
    0: not known, a sender that predates the field or a rank started by hand).
    """

    job_id: Ident
    replica_id: Ident
    slot: NonNegInt
    node_id: Ident
    endpoint: Endpoint
    committed_step: NonNegInt = 0
    sent_at: NonNegFloat = 0.0
    admission: NonNegInt = 0


class StateSource(enum.StrEnum):
    """Where the members of a generation took the state they resumed from."""

    MEMBERS = "members"  # a member held the step the job had reached (a peer copy at most)
    MEMORY = "memory"  # the nodes' own snapshots
    BUDDY = "buddy"  # snapshots, some shards from the replicas on buddy nodes
    DURABLE = "durable"  # a committed durable step
    OLDER = "older"  # nothing held the step the job had reached: the newest any member held
    START = "start"  # nothing held any trained step: from the initial state


class GenerationApplied(Message, tag="phalanx.generation_applied.v1", frozen=True):
    """A member switched to a generation and committed its first step in it
    (``phalanx.job.<job>.applied``).

    ``resume_step`` is the step the members agreed to resume after (the
    highest any of them committed); the durations break the switch down.
    ``pause_s`` is what the change cost this member: how much longer than its
    last step before the change it went without committing (None for a replica
    that had not committed before: a joiner, or generation 0).
    """

    job_id: Ident
    generation: NonNegInt
    replica_id: Ident
    committed_step: NonNegInt
    resume_step: NonNegInt
    rebuild_s: NonNegFloat = 0.0
    state_copy_s: NonNegFloat = 0.0
    state_bytes: NonNegInt = 0
    pause_s: NonNegFloat | None = None
    #: Where the state came from (None: a sender that predates the field).
    restored_from: StateSource | None = None
    #: The job's admission the member was started for (:class:`ReplicaReady`).
    admission: NonNegInt = 0


class GenerationGivenUp(Message, tag="phalanx.generation_given_up.v1", frozen=True):
    """A member gave up a generation that is still the job's newest
    (``phalanx.job.<job>.given_up``): its rendezvous failed (rank 0's store or a
    peer could not be reached in time), or its collectives did, with no member known
    to have died.

    It waits for a newer generation, repeating this report (stored once per
    duplicate window) until one comes; elasticity decides that generation
    again with the same members, since nothing else would replace it, or without
    the ``unreachable`` ones. ``reason`` is what the rendezvous or the collective
    failed with.
    """

    job_id: Ident
    generation: NonNegInt
    replica_id: Ident
    reason: Annotated[str, msgspec.Meta(max_length=DETAIL_CHARS)] = ""
    sent_at: NonNegFloat = 0.0
    #: The job's admission the member was started for (:class:`ReplicaReady`).
    admission: NonNegInt = 0
    #: The members whose node did not answer this member (a TCP connect to their
    #: rendezvous store unanswered) after a collective made no progress for the
    #: runtime's ``unreachable_after_s``: a link between them is cut.
    unreachable: Annotated[list[Ident], msgspec.Meta(max_length=MAX_REPLICAS)] = []


class GenerationRecord(Part, frozen=True):
    """One generation in a job's history (:class:`JobHistory`)."""

    generation: NonNegInt
    reason: GenerationReason
    world_size: PosInt
    members: list[Ident]  # replica ids, by rank
    resume_step: NonNegInt
    decided_at: NonNegFloat
    cause: Cause = ""
    pause_s: NonNegFloat | None = None  # the longest a survivor reported (GenerationApplied)
    #: The step its members resumed after, as the first to apply it reported
    #: (``GenerationApplied.resume_step``; they agree on it); None until one reports.
    #: ``resume_step`` is elasticity's estimate when it decided, which can lag behind.
    applied_resume_step: NonNegInt | None = None
    #: Where the members' state came from, as the first to apply it reported.
    restored_from: StateSource | None = None


#: The most generations a :class:`JobHistory` keeps (the latest), and about the most
#: bytes their records may take: a big job's records are big (each lists the members),
#: and the history is stored whole, in its own record and in elasticity's snapshot.
HISTORY_LIMIT = 256
HISTORY_BYTES = 128 * 1024


class JobHistory(Message, tag="phalanx.job_history.v1", frozen=True):
    """A running job's generations so far, as the elasticity service decided them (bucket
    ``phalanx_history``, key = job id; kept after the job ends). ``generations`` holds the
    latest ``HISTORY_LIMIT`` of its current admission's, oldest first, and ``earlier``
    those of the admissions before it (a requeue, then admission again), each starting
    with its generation 0; ``replacements`` counts the replicas launched to replace failed
    ones in the current admission."""

    job_id: Ident
    generations: Annotated[list[GenerationRecord],
                           msgspec.Meta(max_length=HISTORY_LIMIT)] = []
    earlier: Annotated[list[GenerationRecord], msgspec.Meta(max_length=HISTORY_LIMIT)] = []
    replacements: NonNegInt = 0
    updated_at: NonNegFloat = 0.0


class LaunchReplica(Message, tag="phalanx.launch_replica.v1", frozen=True):
    """Asks an agent (``phalanx.agent.<node>.launch``) to run ``replica_id`` in a job's slot.

    Whatever still runs in that slot (a hung or dropped replica) is stopped
    first: a slot never runs two replicas. ``warm_only``: only from a warm spare
    of the job on this node; with none, nothing is started (and the replica id is
    not used up: the same launch may follow without it). ``gang``: one slot of a
    restart of the job's whole torchrun gang (before any replica was ready): the
    replica gets the gang's ``RANK``, ``WORLD_SIZE`` and a ``MASTER_PORT`` of its
    incarnation, never a warm spare.
    """

    job_id: Ident
    slot: NonNegInt
    replica_id: Ident
    warm_only: bool = False
    gang: bool = False


class StopReplica(Message, tag="phalanx.stop_replica.v1", frozen=True):
    """Asks an agent (``phalanx.agent.<node>.stop``) to stop ``replica_id`` if it still runs.

    Its exit is reported with cause ``stopped``: not a fault.
    """

    job_id: Ident
    slot: NonNegInt
    replica_id: Ident


class ReplicaReply(Message, tag="phalanx.replica_reply.v1", frozen=True):
    """What the agent did with a :class:`LaunchReplica` or :class:`StopReplica`.

    ``spare``: the replica launched is a warm spare that was handed its identity, not a
    cold start.
    """

    node_id: Ident
    replica_id: Ident
    pid: PosInt | None = None
    detail: str = ""
    spare: bool = False


# --- health --------------------------------------------------------------------------------


class FaultKind(enum.StrEnum):
    """What health detected. What each kind means to a job is read from its properties,
    by elasticity and by the ranks alike, so a new kind is decided here once."""

    CRASH = "crash"
    HANG = "hang"
    STRAGGLER = "straggler"
    NODE_LOST = "node_lost"

    @property
    def removes_member(self) -> bool:
        """Whether the rank is out of its generation (a straggler is slow, not gone: it is
        only reported)."""
        return self is not FaultKind.STRAGGLER

    @property
    def replaceable(self) -> bool:
        """Whether a replacement may start in the rank's slot (not when its node is gone)."""
        return self is not FaultKind.NODE_LOST


class Fault(Message, tag="phalanx.fault.v1", frozen=True):
    """A detected failure of one rank or node, published on ``phalanx.job.<job>.fault``."""

    fault_id: Ident
    job_id: Ident
    kind: FaultKind
    node_id: Ident
    detected_at: NonNegFloat
    rank: NonNegInt | None = None
    replica_id: Ident | None = None
    exit_code: int | None = None
    signal: str | None = None
    detail: str = ""
    application: bool = False  # the script failed by itself (see RestartPolicy)
    #: The job's admission the rank was started for (JobRecord.admission; 0: not known).
    admission: NonNegInt = 0

    @property
    def removes_member(self) -> bool:
        """Whether this fault takes a member out of its generation: a replica's, of a kind
        that does (:attr:`FaultKind.removes_member`)."""
        return self.replica_id is not None and self.kind.removes_member


class ExitCause(enum.StrEnum):
    EXITED = "exited"  # the process ended by itself (or by a signal someone else sent)
    STOPPED = "stopped"  # the agent stopped it (cancel, preemption, eviction)
    LOST = "lost"  # found dead by a restarted agent; its exit status is unknown
    LAUNCH_FAILED = "launch_failed"  # never ran: the command could not be started
    GPU_FAULT = "gpu_fault"  # its agent SIGKILLed it: the GPU of its slot failed (detail)
    OOM = "oom"  # the kernel's OOM killer ended it: it passed its job's memory_per_rank


class RankStarted(Message, tag="phalanx.rank_started.v1", frozen=True):
    """An agent started one rank process (``phalanx.job.<job>.started``).

    ``from_spare``: the process is a warm spare of the job that was handed this rank's
    identity (its imports and model build done before), not a cold start.
    """

    job_id: Ident
    rank: NonNegInt
    world_size: PosInt
    node_id: Ident
    pid: PosInt
    started_at: NonNegFloat
    replica_id: Ident | None = None
    from_spare: bool = False
    #: The job's admission it was started for (JobRecord.admission; 0: not known).
    admission: NonNegInt = 0


class RankExited(Message, tag="phalanx.rank_exited.v1", frozen=True):
    """A rank process ended (``phalanx.job.<job>.exited``), published the moment its agent sees it.

    ``exit_code`` is set when it exited, ``signal`` (e.g. ``SIGKILL``) when a
    signal ended it; both are None when its status is unknown (cause ``lost``).
    ``detail`` is the start error of a rank that could not be started, else the
    last lines of a failed rank's output (its exception). ``with_agent``: its
    agent stopped it because the agent itself was shutting down (a cluster
    restart): lost to its job, but no evidence against the node.
    """

    job_id: Ident
    rank: NonNegInt
    node_id: Ident
    pid: PosInt
    cause: ExitCause
    exited_at: NonNegFloat
    exit_code: int | None = None
    signal: str | None = None
    replica_id: Ident | None = None
    detail: Annotated[str, msgspec.Meta(max_length=DETAIL_CHARS)] = ""
    with_agent: bool = False
    #: Cause ``gpu_fault``: when the agent's health poll saw the fault (its wall clock).
    fault_seen_at: NonNegFloat | None = None
    #: The job's admission it was started for (JobRecord.admission; 0: not known).
    admission: NonNegInt = 0

    @property
    def failed(self) -> bool:
        """A crash: any end other than exit code 0 that the agent did not cause."""
        return self.cause is not ExitCause.STOPPED and self.exit_code != 0


class ChaosAction(enum.StrEnum):
    KILL_RANK = "kill_rank"
    KILL_AGENT = "kill_agent"
    PAUSE_AGENT = "pause_agent"
    GPU_FAULT = "gpu_fault"  # a GPU fault, injected at the agent's NVML boundary


class GpuFaultKind(enum.StrEnum):
    """What the agent's health poll of a GPU saw (``services/agent/nvml.py``)."""

    XID = "xid"  # an Xid critical error event (``code``: the Xid)
    ECC = "ecc"  # its volatile uncorrectable ECC error count rose
    RETIRED_PAGES = "retired_pages"  # pages wait to be retired (a reset is due)
    ROW_REMAP = "row_remap"  # row remapping failed
    LOST = "lost"  # NVML says the GPU is lost (fallen off the bus)
    THROTTLE = "throttle"  # clocks held down (thermal, power, HW slowdown): reported only


class ChaosRequest(Message, tag="phalanx.chaos_request.v1", frozen=True):
    """Fault injection through an agent (``phalanx.agent.<node>.chaos``), as a user would.

    ``gpu_fault``: the fault ``gpu_fault`` (Xid ``code``) on GPU ``gpu``, seen by the
    agent's next health poll of its GPUs; on a node without GPUs ``gpu`` is a slot index.
    """

    action: ChaosAction
    job_id: Ident | None = None
    rank: NonNegInt | None = None
    signal: Annotated[str, msgspec.Meta(pattern=r"^(KILL|STOP|TERM|CONT|INT)\Z")] = "KILL"
    duration_s: PosFloat = 5.0  # pause_agent: how long the agent stays stopped
    gpu: NonNegInt | None = None
    gpu_fault: GpuFaultKind = GpuFaultKind.XID
    code: NonNegInt | None = None  # the Xid of an ``xid`` fault (default 79)

    def __post_init__(self) -> None:
        if self.action is ChaosAction.KILL_RANK and (self.job_id is None or self.rank is None):
            raise ValueError("kill_rank needs job_id and rank")
        if self.action is ChaosAction.GPU_FAULT and self.gpu is None:
            raise ValueError("gpu_fault needs gpu (a GPU index, or a slot on a CPU node)")
        if self.code is not None and self.gpu_fault is not GpuFaultKind.XID:
            raise ValueError(f"code is an Xid: it goes with gpu_fault xid, "
                             f"not {self.gpu_fault.value}")


class ChaosReply(Message, tag="phalanx.chaos_reply.v1", frozen=True):
    """What the agent did."""

    node_id: Ident
    detail: str
    pid: NonNegInt | None = None


#: The most of a replica's log one :class:`LogReply` carries.
LOG_CHUNK_BYTES = 256 * 1024
#: The most logs one :class:`LogReply` lists (about 30 bytes each on the wire).
MAX_LISTED_LOGS = 16384


class LogRequest(Message, tag="phalanx.log_request.v1", frozen=True):
    """Reads a job's replica logs from the agent that ran them (``phalanx.agent.<node>.logs``):
    logs stay on their node, and ``phalanx logs`` asks each node for its part.

    Without ``replica_id``: which of the job's replicas left a log on the node, with each
    log's size. With it: up to ``max_bytes`` of that replica's log from byte ``offset``.
    """

    job_id: Ident
    replica_id: Ident | None = None
    offset: NonNegInt = 0
    max_bytes: Annotated[int, msgspec.Meta(ge=1, le=LOG_CHUNK_BYTES)] = LOG_CHUNK_BYTES


class ReplicaLog(Part, frozen=True):
    """One replica's log on a node, and its size in bytes."""

    replica_id: Ident
    size: NonNegInt


class LogReply(Message, tag="phalanx.log_reply.v1", frozen=True):
    """An agent's answer to a :class:`LogRequest`: the job's logs on the node (``logs``,
    in slot then incarnation order; beyond :data:`MAX_LISTED_LOGS`, the newest
    incarnations', ``unlisted`` saying how many are left out), or ``data``, the log's
    bytes from ``offset`` (empty at its end), and ``size``, the log's length when it
    was read."""

    node_id: Ident
    logs: Annotated[list[ReplicaLog], msgspec.Meta(max_length=MAX_LISTED_LOGS)] = []
    unlisted: NonNegInt = 0
    offset: NonNegInt = 0
    data: Annotated[bytes, msgspec.Meta(max_length=LOG_CHUNK_BYTES)] = b""
    size: NonNegInt = 0


class NodeCondition(enum.StrEnum):
    ALIVE = "alive"
    LOST = "lost"
    CORDONED = "cordoned"
    UNCORDONED = "uncordoned"
    CHAOS = "chaos"  # an operator injects a fault here (phalanx chaos): not the node's fault


class NodeConditionChanged(Message, tag="phalanx.node_condition.v1", frozen=True):
    """Health's verdict on a node changed (``phalanx.node.<node>.condition``)."""

    node_id: Ident
    condition: NodeCondition
    reason: str
    at: NonNegFloat
    until: NonNegFloat | None = None  # chaos: when the injected fault is over


class RankProgress(Message, tag="phalanx.rank_progress.v1", frozen=True):
    """A rank's step progress, published on ``phalanx.health.rank.<job>.<rank>`` each step."""

    job_id: Ident
    rank: NonNegInt
    replica_id: Ident
    generation: NonNegInt
    step: NonNegInt
    step_time_s: NonNegFloat
    sent_at: NonNegFloat
    final: bool = False  # the rank's last step: it is exiting, its silence is not a hang
    total_steps: PosInt | None = None  # the steps the training runs to, when the rank knows


class JobProgress(Message, tag="phalanx.job_progress.v1", frozen=True):
    """How far a job has trained, as the health service hears its ranks (bucket
    ``phalanx_progress``, key = job id; kept after the job ends).

    ``step`` is the most steps any rank reported committed since the job was
    admitted, ``total_steps`` the steps it trains to (when its runtime says),
    ``steps_per_s`` the rate over the last ``window_s`` (pauses included; None
    until two reports of different steps), ``restarts`` and ``app_failures``
    what the job has spent of its ``restart_policy``. ``reached`` is the most
    steps committed over every admission of the job: a job admitted again
    resumes there, or says how many steps it trains again.
    """

    job_id: Ident
    step: NonNegInt = 0
    total_steps: PosInt | None = None
    steps_per_s: NonNegFloat | None = None
    window_s: NonNegFloat = 0.0
    restarts: NonNegInt = 0
    app_failures: NonNegInt = 0
    updated_at: NonNegFloat = 0.0
    reached: NonNegInt = 0

    def reached_step(self) -> int:
        """The most steps committed over every admission (a record stored before
        ``reached`` existed has only its ``step``)."""
        return max(self.step, self.reached)


# --- checkpoints ---------------------------------------------------------------------------

#: A durable checkpoint's place: a directory path or an fsspec URL (``s3://bucket/...``).
Location = Annotated[str, msgspec.Meta(max_length=4096)]


class SnapshotTier(enum.StrEnum):
    LOCAL = "local"
    BUDDY = "buddy"
    DURABLE = "durable"


class SnapshotRecord(Message, tag="phalanx.snapshot_record.v1", frozen=True):
    """Where one shard of a job's state at one step is held (``phalanx.ckpt.<job>.snapshot``).

    A memory copy (tier ``local`` or ``buddy``) is held by node ``node_id``; a durable
    copy is at ``location`` (its step's directory, a path or an fsspec URL), and
    ``node_id`` names the node whose rank wrote or read it.
    """

    job_id: Ident
    step: NonNegInt
    shard: NonNegInt
    num_shards: PosInt
    node_id: Ident
    tier: SnapshotTier
    nbytes: NonNegInt
    checksum: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{8,128}\Z")]
    created_at: NonNegFloat
    generation: NonNegInt = 0
    #: Bytes of the whole state the shard is part of (every shard of a step names it).
    total_bytes: NonNegInt = 0
    #: The copy failed its checksum when read: never to be loaded (``detail`` says how).
    corrupt: bool = False
    detail: Annotated[str, msgspec.Meta(max_length=DETAIL_CHARS)] = ""
    #: Where a durable copy is (required for tier ``durable``, empty for the others).
    location: Location = ""
    #: A replica group's rank whose state the shard is of (its column; 0 with one rank
    #: per replica): each column of a job of groups is a state of its own.
    column: NonNegInt = 0
    columns: PosInt = 1  # S: the ranks of a replica group

    def __post_init__(self) -> None:
        if self.column >= self.columns:
            raise ValueError(f"column {self.column} out of range for {self.columns} columns")
        if self.shard >= self.num_shards:
            raise ValueError(f"shard {self.shard} out of range for {self.num_shards} shards")
        if (self.tier is SnapshotTier.DURABLE) != bool(self.location):
            raise ValueError("location is required for a durable copy and only for one "
                             f"(tier {self.tier.value}, location {self.location!r})")


class SnapshotReserve(Message, tag="phalanx.snapshot_reserve.v1", frozen=True):
    """A rank asks its node's agent for a ring of ``buffers`` snapshot buffers of
    ``nbytes`` each, for shard ``shard`` of ``shards`` of its job's state."""

    job_id: Ident
    replica_id: Ident
    shard: NonNegInt
    shards: PosInt
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 44)]
    buffers: Annotated[int, msgspec.Meta(ge=2, le=16)] = 2
    #: A replica group's rank whose state the shard is of (its column; 0 with one rank
    #: per replica): each column of a job of groups is a state of its own.
    column: NonNegInt = 0

    def __post_init__(self) -> None:
        if self.shard >= self.shards:
            raise ValueError(f"shard {self.shard} out of range for {self.shards} shards")


class SnapshotReservation(Message, tag="phalanx.snapshot_reservation.v1", frozen=True):
    """The agent's answer: the buffer files (created and sized) the rank may write."""

    node_id: Ident
    paths: Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]],
                     msgspec.Meta(min_length=2, max_length=16)]
    detail: Annotated[str, msgspec.Meta(max_length=DETAIL_CHARS)] = ""


class ShardCopy(Part, frozen=True):
    """One copy of one shard of a step: where it is (node ``node_id``'s memory, or
    ``location`` for a durable copy) and what it must hash to."""

    shard: NonNegInt
    node_id: Ident
    tier: SnapshotTier
    nbytes: NonNegInt
    checksum: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{8,128}\Z")]
    generation: NonNegInt = 0
    corrupt: bool = False
    location: Location = ""
    #: A replica group's rank whose state the shard is of (its column; 0 with one rank
    #: per replica): each column of a job of groups is a state of its own.
    column: NonNegInt = 0


class CatalogStep(Part, frozen=True):
    """What the catalog knows of one step: its shard count and every copy seen; a job
    of replica groups has ``shards`` shards of each of its ``columns``."""

    step: NonNegInt
    shards: PosInt
    total_bytes: NonNegInt = 0  # of the first column announced
    copies: list[ShardCopy] = []
    columns: PosInt = 1


class CheckpointCatalog(Message, tag="phalanx.checkpoint_catalog.v1", frozen=True):
    """A job's snapshots (KV bucket ``phalanx_checkpoints``, key = job id), steps
    ascending; the checkpoint service's state for that job. ``keep`` and
    ``durable_keep`` are the job's ``checkpoint.memory_keep`` and ``durable_keep``:
    how many complete steps of each kind the catalog retains."""

    job_id: Ident
    keep: Annotated[int, msgspec.Meta(ge=1, le=16)] = 2
    steps: list[CatalogStep] = []
    durable_keep: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 2


class BuddyReason(enum.StrEnum):
    """Why a node has the buddy it has (or none)."""

    PLACED = "placed"  # it had none
    BUDDY_LOST = "buddy_lost"  # its buddy was lost or left
    SAME_DOMAIN = "same_domain"  # its buddy is (now) in its own failure domain
    NO_OTHER_DOMAIN = "no_other_domain"  # no live node outside its failure domain


class BuddyPlacement(Message, tag="phalanx.buddy_placement.v1", frozen=True):
    """Which agent holds replicas of a node's snapshots (KV bucket ``phalanx_buddies``,
    key = node id), placed by the checkpoint service in another failure domain.
    ``buddy_id`` is empty while no node qualifies (``reason`` says why)."""

    node_id: Ident
    failure_domain: Ident
    buddy_id: Annotated[str, msgspec.Meta(max_length=128, pattern=r"^[A-Za-z0-9_\-]*\Z")] = ""
    buddy_domain: Annotated[str, msgspec.Meta(max_length=128,
                                              pattern=r"^[A-Za-z0-9_\-]*\Z")] = ""
    reason: BuddyReason = BuddyReason.PLACED
    placed_at: NonNegFloat = 0.0

    def __post_init__(self) -> None:
        if self.buddy_id == self.node_id:
            raise ValueError(f"node {self.node_id} cannot be its own buddy")
        if (self.reason is BuddyReason.NO_OTHER_DOMAIN) != (not self.buddy_id):
            raise ValueError(f"a placement without a buddy has reason no_other_domain and "
                             f"only it (buddy {self.buddy_id!r}, reason {self.reason.value})")
        if self.buddy_id and self.buddy_domain == self.failure_domain:
            raise ValueError(f"buddy {self.buddy_id} is in {self.node_id}'s own failure "
                             f"domain {self.failure_domain}")


class ResumeRequest(Message, tag="phalanx.resume_request.v1", frozen=True):
    """Where can ``job_id`` resume at ``world_size`` replicas?

    ``at_nodes``: the nodes that will restore (a generation's members'): a copy in their
    memory is nearer than any other. ``memory_only``: only copies in nodes' memory count
    (own or buddy), as when the members look for what to fetch before a restore.
    ``column``: the replica-group column asked about (each restores apart)."""

    job_id: Ident
    world_size: PosInt
    at_nodes: Annotated[list[Ident], msgspec.Meta(max_length=MAX_REPLICAS)] = []
    memory_only: bool = False
    column: NonNegInt = 0


class ResumeAnswer(Message, tag="phalanx.resume_answer.v1", frozen=True):
    """The newest step complete across all its shards (None: none is), and for each
    shard its nearest healthy copy (on ``at_nodes``, then own memory, buddy, durable),
    or why there is none. ``held_by``: per shard, every node whose memory holds a
    healthy copy, nearest first (on ``at_nodes``, then by node id)."""

    job_id: Ident
    step: NonNegInt | None = None
    shards: NonNegInt = 0
    sources: list[ShardCopy] = []
    held_by: list[list[Ident]] = []
    detail: Annotated[str, msgspec.Meta(max_length=DETAIL_CHARS)] = ""


class ReplicaFetch(Message, tag="phalanx.replica_fetch.v1", frozen=True):
    """A rank asks the agent of a node that is not a member's to send the copy it holds
    of shard ``shard`` of ``shards`` of ``job_id``'s snapshot of ``step`` to the
    replication listener of node ``to_node``, which keeps it as a replica."""

    job_id: Ident
    step: NonNegInt
    shard: NonNegInt
    shards: PosInt
    to_node: Ident
    #: A replica group's rank whose state the shard is of (its column; 0 with one rank
    #: per replica): each column of a job of groups is a state of its own.
    column: NonNegInt = 0

    def __post_init__(self) -> None:
        if self.shard >= self.shards:
            raise ValueError(f"shard {self.shard} out of range for {self.shards} shards")


class ReplicaFetched(Message, tag="phalanx.replica_fetched.v1", frozen=True):
    """The agent's answer: ``to_node`` took the copy, ``nbytes`` sent in ``seconds``
    (a copy that is not sent is answered with an error saying why)."""

    node_id: Ident
    nbytes: NonNegInt
    seconds: NonNegFloat


#: Every top-level message type, in reference order.
ALL_MESSAGES: tuple[type[Message], ...] = (
    NodeRecord,
    NodeHeartbeat,
    NodeStatusRequest,
    JobSpec,
    JobRecord,
    SubmitRequest,
    JobRequest,
    RequeueRequest,
    ScaleRequest,
    ScalingEvent,
    Explanation,
    JobPlacement,
    NodeClaims,
    Lease,
    StreamCursor,
    JobSnapshot,
    Spilled,
    Generation,
    ReplicaReady,
    GenerationApplied,
    GenerationGivenUp,
    JobHistory,
    LaunchReplica,
    StopReplica,
    ReplicaReply,
    Fault,
    RankStarted,
    RankExited,
    ChaosRequest,
    ChaosReply,
    LogRequest,
    LogReply,
    NodeConditionChanged,
    RankProgress,
    JobProgress,
    SnapshotRecord,
    SnapshotReserve,
    SnapshotReservation,
    CheckpointCatalog,
    BuddyPlacement,
    ResumeRequest,
    ResumeAnswer,
    ReplicaFetch,
    ReplicaFetched,
)
