"""The environment a rank process starts with: variables its node agent sets and the
runtime inside the rank reads; and the one exit status the runtime gives a meaning.
Both sides name them from here, so neither imports the other (services never import
the runtime; the runtime never imports a service).

:class:`RankEnvironment` is the contract: the agent builds one for a job on its node
(bus, job, node, backend, checkpoint policy) and one for each replica (its slot, id,
admission), and writes them with :meth:`~RankEnvironment.to_env`; the runtime reads
them back with :meth:`~RankEnvironment.from_env`, which refuses a malformed value
naming the variable. A job's spec may set the fields the agent leaves alone (the record
dir, determinism, the micro-batch size, fault injection) in its ``env``. A variable
unset or empty is a field that is None (False for a flag): a script with no
:data:`JOB_ID` runs alone. Fault injection's values stay text here: what they mean
(which replica dies where) is the runtime's to parse (``phalanx.runtime.chaos``).

The variables that configure phalanx's own processes (the bus client's among them,
which a rank reads too) are in :mod:`phalanx.schemas.settings`.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Literal, TypeVar

import msgspec

from phalanx.schemas import settings
from phalanx.schemas.errors import ConfigError

#: The bus a rank connects to (the bus client's own variable).
NATS_URL = settings.NATS_URL
#: The job a rank is of; unset, the script runs alone.
JOB_ID = "PHALANX_JOB_ID"
#: The replica a process is (``r<slot>-<incarnation>``).
REPLICA_ID = "PHALANX_REPLICA_ID"
#: The replica's slot in the job.
RANK = "PHALANX_RANK"
#: The job's slots (replicas) when the rank was started.
WORLD_SIZE = "PHALANX_WORLD_SIZE"
#: The node the rank runs on.
NODE_ID = "PHALANX_NODE_ID"
#: The job spec's ``ranks_per_replica``: how many rank processes one replica (a group) is.
RANKS_PER_REPLICA = "PHALANX_RANKS_PER_REPLICA"
#: This process's rank in its replica's group (0 .. ranks_per_replica - 1). With more
#: than one rank per replica, torchrun's variables (``RANK``, ``WORLD_SIZE``,
#: ``MASTER_ADDR``, ``MASTER_PORT``) describe the group, which stays the same for the
#: group's life: the script's own ``init_process_group()`` and device mesh are the
#: group's, the replicas' world is the session's.
GROUP_RANK = "PHALANX_GROUP_RANK"
#: The job's admission a rank was started for (``JobRecord.admission``), which its events
#: carry so that elasticity tells them from an earlier admission's.
ADMISSION = "PHALANX_ADMISSION"
#: The job spec's ``backend`` (``auto``, ``nccl`` or ``gloo``).
BACKEND = "PHALANX_BACKEND"
#: The job spec's ``hang_timeout_s``.
HANG_TIMEOUT_S = "PHALANX_HANG_TIMEOUT_S"
#: The address peers reach the rank's rendezvous store at (its node's host).
ADVERTISE_HOST = "PHALANX_ADVERTISE_HOST"
#: The directory of the node's snapshot store the rank writes its in-memory snapshots
#: to; set with the job's ``checkpoint`` policy, the ``CHECKPOINT_*`` variables.
SNAPSHOT_DIR = "PHALANX_SNAPSHOT_DIR"
CHECKPOINT_MEMORY_EVERY = "PHALANX_CHECKPOINT_MEMORY_EVERY"
CHECKPOINT_MEMORY_KEEP = "PHALANX_CHECKPOINT_MEMORY_KEEP"
CHECKPOINT_MEMORY_OVERHEAD = "PHALANX_CHECKPOINT_MEMORY_OVERHEAD"
CHECKPOINT_MEMORY_MAX_EVERY = "PHALANX_CHECKPOINT_MEMORY_MAX_EVERY"
CHECKPOINT_DURABLE_EVERY = "PHALANX_CHECKPOINT_DURABLE_EVERY"
CHECKPOINT_DURABLE_KEEP = "PHALANX_CHECKPOINT_DURABLE_KEEP"
CHECKPOINT_DURABLE_URL = "PHALANX_CHECKPOINT_DURABLE_URL"
CHECKPOINT_RESUME_FROM = "PHALANX_CHECKPOINT_RESUME_FROM"
#: The nice value a replica started at low CPU priority returns to once it is ready.
NICE_WHEN_READY = "PHALANX_NICE_WHEN_READY"
#: Where every replica appends its record of what it did (``phalanx.runtime.record``).
RECORD_DIR = "PHALANX_RECORD_DIR"
#: ``1``: deterministic kernels and reductions.
DETERMINISTIC = "PHALANX_DETERMINISTIC"
#: ``1``: every replica checks its state against its peers' after a step.
STATE_CHECKSUM = "PHALANX_STATE_CHECKSUM"
#: The micro-batch size for a script that gives none.
MICRO_BATCH_SIZE = "PHALANX_MICRO_BATCH_SIZE"
#: Fault injection (``phalanx.runtime.chaos``): ``<replica>:<step>:<phase>[,...]``.
CHAOS_KILL = "PHALANX_CHAOS_KILL"
#: A slow start: ``<replica>:<path>``.
CHAOS_HOLD = "PHALANX_CHAOS_HOLD"
#: A slow job: ``<seconds>:<path>``.
CHAOS_PACE = "PHALANX_CHAOS_PACE"
#: ``cuda`` for a rank of a node that lists GPUs, ``cpu`` otherwise: set by the agent
#: with the rank's devices (``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES``), which
#: ``phalanx.runtime.placement`` reads.
DEVICE = "PHALANX_DEVICE"

#: Set (to the spare's id) on a warm spare: a process of a job's command that has no
#: replica identity yet and waits, in the session's ``from_env``, for the one its agent
#: writes to its standard input (one JSON object of variables, one line).
SPARE = "PHALANX_SPARE"
#: A job's own directory on shared memory (mode 0700, its user's), where the agent runs
#: each job as a user of its own (``agent.job_uids``).
SHM_DIR = "PHALANX_SHM_DIR"
#: Where a job's processes on a node write their exit status as they end, each in a
#: file named by its pid holding the status in decimal: an agent restarted while a rank
#: ran (its status then not the agent's to wait for) reads it there instead of
#: reporting the exit ``lost``. The job's own directory (its user's, with
#: ``agent.job_uids``); the agent removes a file when it reports its exit, and a stale one
#: of the same pid when it starts a process.
EXIT_STATUS_DIR = "PHALANX_EXIT_STATUS_DIR"
#: The job's rendezvous secret (hex): the stores its replicas host answer only
#: connections that prove it (:mod:`phalanx.runtime.store`). Its agents derive it from the
#: cluster's key (:func:`derive_store_secret`), so every node gives a job the same one and
#: no job can compute another's. Unset: the stores answer anyone (torch's ``TCPStore``).
STORE_SECRET = "PHALANX_STORE_SECRET"

#: The exit status of a rank that ended because its generation found the job's state
#: nowhere it could reach (``StateLost``): ``EX_TEMPFAIL``, a failure to retry. The
#: state may be reachable again later (a lost node's agent back with its memory), so
#: health counts it against the restart budget, which judges progress, not against the
#: application failures that end a job at the first few.
EXIT_STATE_LOST = 75

#: The exit status of a rank fenced out of its job (``Dropped``: the job moved to a
#: generation without it, its node cut off from the bus or judged failed): the job's
#: doing, not the script's, however many ranks end so. ``EX_PROTOCOL``.
EXIT_DROPPED = 76

#: torchrun's variables for a process that is a world of its own: what a rank of a job that
#: runs a session starts with (a job that does not declare it in its spec gets the gang's
#: until it has a generation). A DDP script's own ``dist.init_process_group(...)`` then
#: makes a group of one at once, with a store on a free port, and never waits for a peer
#: that died or left; the session, which knows the membership, takes torch's default group
#: over (``phalanx.runtime.default_group``).
#: ``PHALANX_WORLD_OF_ONE`` marks them: ``dist.get_rank()`` asked before the session is 0 in
#: every replica, and the runtime says so (``phalanx.runtime.default_group``).
WORLD_OF_ONE_MARK = "PHALANX_WORLD_OF_ONE"
WORLD_OF_ONE: Mapping[str, str] = MappingProxyType({
    "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
    "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
    WORLD_OF_ONE_MARK: "1"})

#: ``CheckpointEnvironment.memory_every``: the runtime picks the interval.
AUTO: Literal["auto"] = "auto"

_T = TypeVar("_T")
_WHOLE = re.compile(r"-?[0-9]+")


class CheckpointEnvironment(msgspec.Struct, frozen=True, kw_only=True):
    """A job's ``checkpoint`` policy as its ranks get it: all of it or none, with the
    snapshot dir (the spec's ``CheckpointPolicy`` documents each field)."""

    snapshot_dir: str
    """:data:`SNAPSHOT_DIR`: the node's snapshot store's directory for the job."""
    memory_every: int | Literal["auto"] = AUTO
    """:data:`CHECKPOINT_MEMORY_EVERY`: steps between snapshots; 0 never; auto."""
    memory_keep: int = 2
    """:data:`CHECKPOINT_MEMORY_KEEP`: snapshots kept in memory."""
    memory_overhead: float = 0.02
    """:data:`CHECKPOINT_MEMORY_OVERHEAD`: the training time snapshots may take (auto)."""
    memory_max_every: int = 100
    """:data:`CHECKPOINT_MEMORY_MAX_EVERY`: the longest interval auto picks."""
    durable_every: int = 0
    """:data:`CHECKPOINT_DURABLE_EVERY`: steps between durable checkpoints; 0 never."""
    durable_keep: int = 2
    """:data:`CHECKPOINT_DURABLE_KEEP`: durable steps kept."""
    durable_url: str = ""
    """:data:`CHECKPOINT_DURABLE_URL`: where durable checkpoints go (fsspec URL)."""
    resume_from: str | None = None
    """:data:`CHECKPOINT_RESUME_FROM`: an earlier job whose durable steps this one may
    start from."""

    def to_env(self) -> dict[str, str]:
        """Every variable of the policy (:data:`CHECKPOINT_RESUME_FROM` empty for none)."""
        return {SNAPSHOT_DIR: self.snapshot_dir,
                CHECKPOINT_MEMORY_EVERY: str(self.memory_every),
                CHECKPOINT_MEMORY_KEEP: str(self.memory_keep),
                CHECKPOINT_MEMORY_OVERHEAD: str(self.memory_overhead),
                CHECKPOINT_MEMORY_MAX_EVERY: str(self.memory_max_every),
                CHECKPOINT_DURABLE_EVERY: str(self.durable_every),
                CHECKPOINT_DURABLE_KEEP: str(self.durable_keep),
                CHECKPOINT_DURABLE_URL: self.durable_url,
                CHECKPOINT_RESUME_FROM: self.resume_from or ""}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> CheckpointEnvironment | None:
        """The policy in ``env``; None when :data:`SNAPSHOT_DIR` is unset or empty (the
        agent set none: the others are then not read).

        Raises:
            ConfigError: a malformed value, naming its variable.
        """
        snapshot_dir = env.get(SNAPSHOT_DIR)
        if not snapshot_dir:
            return None
        default = cls(snapshot_dir=snapshot_dir)
        every = _get(env, CHECKPOINT_MEMORY_EVERY, _every)
        return cls(
            snapshot_dir=snapshot_dir,
            memory_every=default.memory_every if every is None else every,
            memory_keep=_or(_get(env, CHECKPOINT_MEMORY_KEEP, _whole(1)),
                            default.memory_keep),
            memory_overhead=_or(_get(env, CHECKPOINT_MEMORY_OVERHEAD, _number),
                                default.memory_overhead),
            memory_max_every=_or(_get(env, CHECKPOINT_MEMORY_MAX_EVERY, _whole(1)),
                                 default.memory_max_every),
            durable_every=_or(_get(env, CHECKPOINT_DURABLE_EVERY, _whole(0)),
                              default.durable_every),
            durable_keep=_or(_get(env, CHECKPOINT_DURABLE_KEEP, _whole(1)),
                             default.durable_keep),
            durable_url=env.get(CHECKPOINT_DURABLE_URL, ""),
            resume_from=env.get(CHECKPOINT_RESUME_FROM) or None)


class RankEnvironment(msgspec.Struct, frozen=True, kw_only=True):
    """What the agent tells a rank through its environment, and the job's spec may add.

    Every field is optional (None or False: its variable unset), so the agent writes the
    job's part once (:meth:`to_env` of one with the job's fields) and each replica's on
    top of it (one with the replica's fields: what a warm spare is handed).
    """

    # The job's, on this node (the agent's RankSet.job_environment).
    nats_url: str | None = None
    """:data:`NATS_URL`."""
    job_id: str | None = None
    """:data:`JOB_ID`; None (or no :attr:`nats_url`): the script runs alone, outside
    phalanx."""
    node_id: str | None = None
    """:data:`NODE_ID`."""
    backend: str | None = None
    """:data:`BACKEND`: the spec's ``backend``, checked by the runtime (default auto)."""
    hang_timeout_s: float | None = None
    """:data:`HANG_TIMEOUT_S`."""
    advertise_host: str | None = None
    """:data:`ADVERTISE_HOST` (default ``127.0.0.1``)."""
    checkpoint: CheckpointEnvironment | None = None
    """:data:`SNAPSHOT_DIR` and the ``CHECKPOINT_*`` variables; None: no snapshots."""
    # The replica's (its identity).
    rank: int | None = None
    """:data:`RANK`: the slot (default 0)."""
    replica_id: str | None = None
    """:data:`REPLICA_ID` (default ``r<rank>-0``)."""
    world_size: int | None = None
    """:data:`WORLD_SIZE`."""
    ranks_per_replica: int | None = None
    """:data:`RANKS_PER_REPLICA` (default 1)."""
    group_rank: int | None = None
    """:data:`GROUP_RANK` (default 0)."""
    admission: int | None = None
    """:data:`ADMISSION` (default 0)."""
    nice_when_ready: int | None = None
    """:data:`NICE_WHEN_READY`: set on a replica started at a lower CPU priority."""
    # What a job's spec may set in its env.
    record_dir: str | None = None
    """:data:`RECORD_DIR`."""
    deterministic: bool = False
    """:data:`DETERMINISTIC` (``1`` or ``0``)."""
    checksum: bool = False
    """:data:`STATE_CHECKSUM` (``1`` or ``0``)."""
    micro_batch_size: int | None = None
    """:data:`MICRO_BATCH_SIZE`: a positive whole number of samples."""
    chaos_kill: str | None = None
    """:data:`CHAOS_KILL`, as written."""
    chaos_hold: str | None = None
    """:data:`CHAOS_HOLD`, as written."""
    chaos_pace: str | None = None
    """:data:`CHAOS_PACE`, as written."""

    @property
    def slot(self) -> int:
        """:attr:`rank`, 0 when unset."""
        return self.rank or 0

    @property
    def replica(self) -> str:
        """:attr:`replica_id`, ``r<slot>-0`` when unset."""
        return self.replica_id or f"r{self.slot}-0"

    def to_env(self) -> dict[str, str]:
        """The variables of the fields that are set (a flag: ``1`` when True)."""
        env: dict[str, str] = {}
        for name, var in _VARIABLES.items():
            value = getattr(self, name)
            if value is None or value is False:
                continue
            env[var] = "1" if value is True else str(value)
        if self.checkpoint is not None:
            env.update(self.checkpoint.to_env())
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RankEnvironment:
        """The fields ``env`` sets; a variable unset or empty leaves its field None.

        Raises:
            ConfigError: a malformed value, naming its variable and the value.
        """
        found = cls(
            nats_url=env.get(NATS_URL) or None,
            job_id=env.get(JOB_ID) or None,
            node_id=env.get(NODE_ID) or None,
            backend=env.get(BACKEND) or None,
            hang_timeout_s=_get(env, HANG_TIMEOUT_S, _number),
            advertise_host=env.get(ADVERTISE_HOST) or None,
            checkpoint=CheckpointEnvironment.from_env(env),
            rank=_get(env, RANK, _whole(0)),
            replica_id=env.get(REPLICA_ID) or None,
            world_size=_get(env, WORLD_SIZE, _whole(1)),
            ranks_per_replica=_get(env, RANKS_PER_REPLICA, _whole(1)),
            group_rank=_get(env, GROUP_RANK, _whole(0)),
            admission=_get(env, ADMISSION, _whole(0)),
            nice_when_ready=_get(env, NICE_WHEN_READY, _whole(-20)),
            record_dir=env.get(RECORD_DIR) or None,
            deterministic=bool(_get(env, DETERMINISTIC, _flag)),
            checksum=bool(_get(env, STATE_CHECKSUM, _flag)),
            micro_batch_size=_get(env, MICRO_BATCH_SIZE, _micro_batch_size),
            chaos_kill=env.get(CHAOS_KILL) or None,
            chaos_hold=env.get(CHAOS_HOLD) or None,
            chaos_pace=env.get(CHAOS_PACE) or None)
        if (found.group_rank or 0) >= (found.ranks_per_replica or 1):
            raise ConfigError(f"{GROUP_RANK}: {found.group_rank} is not below "
                              f"{RANKS_PER_REPLICA} = {found.ranks_per_replica or 1}")
        return found


#: :class:`RankEnvironment`'s fields and their variables (its checkpoint's are its own).
_VARIABLES = {
    "nats_url": NATS_URL, "job_id": JOB_ID, "node_id": NODE_ID, "backend": BACKEND,
    "hang_timeout_s": HANG_TIMEOUT_S, "advertise_host": ADVERTISE_HOST, "rank": RANK,
    "replica_id": REPLICA_ID, "world_size": WORLD_SIZE,
    "ranks_per_replica": RANKS_PER_REPLICA, "group_rank": GROUP_RANK, "admission": ADMISSION,
    "nice_when_ready": NICE_WHEN_READY, "record_dir": RECORD_DIR,
    "deterministic": DETERMINISTIC, "checksum": STATE_CHECKSUM,
    "micro_batch_size": MICRO_BATCH_SIZE, "chaos_kill": CHAOS_KILL,
    "chaos_hold": CHAOS_HOLD, "chaos_pace": CHAOS_PACE}


def _get(env: Mapping[str, str], var: str, parse: Callable[[str, str], _T]) -> _T | None:
    """``env[var]`` parsed; None when unset or empty."""
    raw = env.get(var)
    return parse(var, raw) if raw else None


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _whole(minimum: int) -> Callable[[str, str], int]:
    def parse(var: str, raw: str) -> int:
        if not _WHOLE.fullmatch(raw) or int(raw) < minimum:
            raise ConfigError(f"{var}: {raw!r} is not a whole number >= {minimum}")
        return int(raw)
    return parse


def _number(var: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(f"{var}: {raw!r} is not a number")
    return value


def _every(var: str, raw: str) -> int | Literal["auto"]:
    return AUTO if raw == AUTO else _whole(0)(var, raw)


def _flag(var: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ConfigError(f"{var}: {raw!r} is not 1 or 0")
    return raw == "1"


def _micro_batch_size(var: str, raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{var}: {raw!r} is not a positive whole number of samples")
    return int(raw)


def derive_store_secret(cluster_key: bytes, job_id: str) -> str:
    """The rendezvous secret of ``job_id`` (:data:`STORE_SECRET`), hex: an HMAC of the job
    id under the cluster's key, in a domain of its own (the key serves other ends too)."""
    return hmac.new(cluster_key, b"phalanx rendezvous v1\0" + job_id.encode(),
                    hashlib.sha256).hexdigest()


def store_secret(env: Mapping[str, str]) -> bytes | None:
    """The job's rendezvous secret in ``env`` (None: unset, or not hex)."""
    text = env.get(STORE_SECRET, "")
    try:
        return bytes.fromhex(text) or None
    except ValueError:
        return None
