"""The agent's configuration: which node it is and how often it heartbeats."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.schemas import settings
from phalanx.schemas.errors import ConfigError
from phalanx.schemas.registry import DEFAULT_LOST_AFTER_S
from phalanx.schemas.subjects import token
from phalanx.services.agent.cpus import parse_cpu_list


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    node_id: str = dataclasses.field(default_factory=lambda: default_node_id())
    """Unique node id (a subject token); defaults to the short host name."""
    slots: int | None = None
    """Rank slots this node offers. None: one per GPU (``gpus``, else each GPU NVML
    finds at start), else one per CPU (:func:`~.core.node_gpus`)."""
    gpus: tuple[int, ...] = ()
    """The GPU of each slot: slot ``i`` of this node runs on CUDA device ``gpus[i]``,
    which its rank sees alone (``CUDA_VISIBLE_DEVICES``). An index may repeat: slots then
    share that GPU (their jobs need ``backend: gloo``). Empty: the GPUs NVML finds, one
    slot each (``discover_gpus``); with none, CPU slots, and ranks get the agent's
    ``CUDA_VISIBLE_DEVICES`` unchanged."""
    cpus: tuple[int, ...] = ()
    """The CPUs this agent runs on (``"0-7,16-23"``, the kernel's list format; they must
    be among those it was started with), each CPU slot's ranks pinned to a share of them
    of their own: whole physical cores, split evenly among the slots (:mod:`.cpus`).
    Without ``slots``, one slot per CPU of the set. Empty: the agent's CPUs as it was
    started, and its CPU slots' ranks not pinned (the kernel places them). A rank on a
    GPU slot is pinned to its GPU's CPUs either way (within this set, where there is one).
    """
    discover_gpus: bool = True
    """Ask NVML for the node's GPUs at start (:mod:`.nvml`), report them in the node record
    and watch their health. Off: no NVML at all, and without ``gpus`` CPU slots (a local
    cluster's agents, which share one machine's GPUs)."""
    gpu_poll_interval_s: float = 1.0
    """Time between two health polls of the node's GPUs (Xid and ECC errors, retired pages,
    a GPU lost, throttling); a poll costs well under a millisecond per GPU."""
    failure_domain: str = "default"
    """Label of what fails together (rack, zone); buddies are placed across domains."""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    """Node labels placement constraints match against."""
    heartbeat_interval_s: float = 0.5
    """Time between heartbeats (registry refresh and heartbeat event)."""
    lost_after_s: float = DEFAULT_LOST_AFTER_S
    """A registered node whose heartbeat is older than this is lost (and its id may be reused)."""
    fence_after_s: float | None = None
    """Once the bus has answered none of the agent's round trips for this long, the agent
    SIGKILLs every rank it runs (:mod:`.fence`: a node cut off must not train on as a
    second line of its jobs). None: ``lost_after_s``, the node timeout; 0: never."""
    shutdown_timeout_s: float = 5.0
    """How long in-flight work gets on SIGTERM."""
    stop_is_restart: bool = False
    """A clean stop means the node is coming back (``phalanx down`` of a local cluster,
    whose ``phalanx up`` starts it again): the node keeps its registry entry, so admission
    keeps the placements on it and judges it by its heartbeats, and keeps this node's
    snapshot store, so its jobs' replacements restore from it. Its ranks are stopped and
    reported lost either way. False: a clean stop deregisters and frees the store."""
    launch: bool = True
    """Run the ranks of admitted jobs here. Off, the node only offers capacity (an
    external launcher runs the ranks, or a benchmark measures admission alone)."""
    zygote: bool = True
    """Fork ranks and spares whose command is this agent's Python running a script (or
    ``-m`` a module) from a *zygote* that has imported torch and the rank runtime once
    (:mod:`phalanx.services.agent.zygote`), instead of starting each cold: a replacement
    skips 1.5 to 2.5 s of imports. Any other command starts cold either way; off
    (``PHALANX_AGENT_ZYGOTE=0``), every one does."""
    zygote_template: str | None = None
    """The Unix socket of this machine's zygote template
    (``python -m phalanx.runtime.zygote --template PATH``): the agent's zygotes are forked
    from it, so agents sharing a machine import torch once between them (``phalanx up``
    starts one for its agents). A template that is gone, or whose environment differs
    from a job's, is passed over for a zygote of the agent's own."""
    replacement_nice: int = 10
    """Nice value a replacement replica starts at, until it is ready (0: as the others).
    Applied only where the replica may lower it again (``CAP_SYS_NICE`` or
    ``RLIMIT_NICE``), see :mod:`phalanx.runtime.priority`."""
    work_dir: str | None = None
    """Rank logs and the rank manifest; default ``$PHALANX_DATA_DIR/agents/<node>``
    (``~/.local/state/phalanx/agents/<node>``)."""
    rank_keys_dir: str | None = None
    """On a bus with permissions: where the seeds of jobs' identities are (an auth
    directory's ``ranks/``, see docs/security.md); each rank connects as its job, and
    a job without a seed there does not start. None (and no ``rank_nkey``): ranks
    connect with no credentials (a bus without authentication). A rank never gets the
    agent's own credentials."""
    rank_nkey: str | None = None
    """On a bus with permissions and no per-job identities: the seed file of an identity
    every job's ranks share (``ranks``, allowed only ranks' subjects, docs/security.md)."""
    rank_token_key_file: str | None = None
    """On a bus with an auth callout (the Kubernetes base): the cluster's rank token key
    (hex, ``rank-token.key``). The agent mints a token for a rank's job each time it
    starts one (:mod:`~phalanx.services.auth.rank_token`), and the rank connects with it
    (``PHALANX_NATS_TOKEN``) as its job's ranks alone; the key itself stays with the
    agent."""
    rank_token_ttl_s: float = 30 * 24 * 3600.0
    """How long a minted rank token admits its rank (30 days): a rank running longer can
    no longer reconnect to the bus once its connection's lifetime ends."""

    job_uids: tuple[int, int] | None = None
    """Run each job's processes as a user of its own: the first and last uid of the range
    they are taken from (``PHALANX_AGENT_JOB_UIDS="20000-29999"``), one per job with
    anything on this node, its gid the same number (:mod:`.identity`). The agent must be
    able to change its ids and hand files over (root, or ``CAP_SETUID``, ``CAP_SETGID``,
    ``CAP_CHOWN``, ``CAP_DAC_OVERRIDE``, ``CAP_FOWNER`` and ``CAP_KILL``; docs/deploy.md),
    and the interpreter, the job's scripts and its data must be readable by those users.
    None (the default, or an empty value): every process runs as the agent does, and the
    ranks of different jobs on a node can read each other's environment, snapshots and
    the agent's keys (docs/security.md)."""

    confine_memory: bool = True
    """Run each process of a job whose spec sets ``memory_per_rank`` in a memory cgroup of
    its own with that limit (:mod:`.cgroups`: v1 or v2, under the agent's own cgroup), so
    that one over it is killed alone. Where no cgroup can be made (no hierarchy, not
    writable, v2 without the memory controller delegated), or off, ranks run
    unconfined and their logs say so."""

    snapshot_dir: str | None = None
    """Where ranks' in-memory snapshots are kept: a directory on a tmpfs. Default
    ``/dev/shm/phalanx-<uid>/<node>-<hash of work_dir>`` (:mod:`.snapshots`)."""
    snapshot_limit_bytes: int | None = None
    """The most snapshot memory this node holds; a reservation past it is refused.
    None: half the tmpfs."""
    address: str | None = None
    """The address peers reach this node at (``PHALANX_AGENT_ADDRESS``): registered as the
    node's host, so its ranks' rendezvous stores and gloo, ``MASTER_ADDR`` and its
    replication listener all use it. None: the node's host name, which is only right where
    it resolves to that address (a machine whose own name resolves to 127.0.1.1, as
    Debian's /etc/hosts has it, advertised its loopback to every peer)."""
    replica_host: str | None = None
    """Address the replication listener binds (:mod:`.replication`: buddies' snapshots
    arrive there). None: the address the node's host name resolves to, the one its peers
    connect to."""
    replica_key_file: str | None = None
    """The cluster's replication key (hex, :mod:`.replica_auth`; ``phalanx auth init``
    writes ``keys/replication.key``): buddies prove it to each other before any snapshot
    moves. None: replication unauthenticated (anyone reaching the port may send). Each
    job's rendezvous secret is derived from it too
    (:data:`~phalanx.schemas.environment.STORE_SECRET`): with it, the store a replica
    hosts answers its job's members alone (:mod:`phalanx.runtime.store`); without, anyone."""
    replica_tls_dir: str | None = None
    """A directory holding the cluster's replication certificate and key and its CA
    (``replication.pem``, ``replication-key.pem``, ``ca.pem``: the ``tls`` directory
    ``phalanx auth init`` makes): the replication stream is then mutual TLS 1.3,
    encrypted, every byte authenticated (:mod:`.replica_tls`). None: in the clear."""
    replica_port: int = 0
    """Port of the replication listener; 0: any free port (announced in the node record)."""
    replica_duty: float = 0.01
    """The most of its time the replication sender spends sending (0 < duty <= 1): after
    sending for t seconds it rests t * (1/duty - 1). The agent's CPU is the ranks' CPU, and
    the buddy's agent does about as much work receiving: a lower duty costs training
    less, and leaves the buddy further behind (about 100 x the send time at 0.01)."""
    tee_rank_output: bool = False
    """Each line a rank writes also goes to this agent's stdout, as ``<job>/<replica> |
    <line>`` (on Kubernetes, ``kubectl logs`` of the agent's pod shows its ranks')."""
    rank_log_max_bytes: int = 64 << 20
    """A rank's log file past this size is copied to ``<name>.log.1`` and emptied (0:
    never): :mod:`.rank_output`."""
    checkpoint_dir: str | None = None
    """Where ranks persist durable checkpoints of a job whose spec names no
    ``checkpoint.durable_url``. Default: ``checkpoints`` beside the ``agents`` directory
    the work dir is in (``<data dir>/checkpoints``, shared by a local cluster's agents);
    on several machines, a path every node shares."""

    def __post_init__(self) -> None:
        try:
            token(self.node_id, "agent.node_id")
            token(self.failure_domain, "agent.failure_domain")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.slots is not None and self.slots < 1:
            raise ConfigError(f"agent.slots must be >= 1, got {self.slots}")
        if self.gpus and self.slots is not None and len(self.gpus) != self.slots:
            raise ConfigError(f"agent.gpus lists {len(self.gpus)} GPUs for {self.slots} "
                              "slots: one GPU index per slot")
        if any(gpu < 0 for gpu in self.gpus):
            raise ConfigError(f"agent.gpus must be CUDA device indices (>= 0), "
                              f"got {list(self.gpus)}")
        if self.fence_after_s is not None and not (
                math.isfinite(self.fence_after_s) and self.fence_after_s >= 0):
            raise ConfigError(f"agent.fence_after_s must be >= 0 (0: never), "
                              f"got {self.fence_after_s}")
        for name in ("heartbeat_interval_s", "lost_after_s", "shutdown_timeout_s",
                     "gpu_poll_interval_s"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"agent.{name} must be a finite number, "
                                  f"got {getattr(self, name)}")
        if not 0 < self.replica_duty <= 1:
            raise ConfigError(f"agent.replica_duty must be within (0, 1], "
                              f"got {self.replica_duty}")
        if not 0 <= self.replica_port <= 65535:
            raise ConfigError(f"agent.replica_port must be within 0..65535, "
                              f"got {self.replica_port}")
        if not 0 <= self.replacement_nice <= 19:
            raise ConfigError(f"agent.replacement_nice must be within 0..19, "
                              f"got {self.replacement_nice}")
        if self.rank_log_max_bytes < 0:
            raise ConfigError(f"agent.rank_log_max_bytes must be >= 0 (0: no limit), "
                              f"got {self.rank_log_max_bytes}")
        if self.snapshot_limit_bytes is not None and self.snapshot_limit_bytes < 0:
            raise ConfigError(f"agent.snapshot_limit_bytes must be >= 0, "
                              f"got {self.snapshot_limit_bytes}")
        if self.heartbeat_interval_s <= 0:
            raise ConfigError(f"agent.heartbeat_interval_s must be > 0, "
                              f"got {self.heartbeat_interval_s}")
        if self.gpu_poll_interval_s <= 0:
            raise ConfigError(f"agent.gpu_poll_interval_s must be > 0, "
                              f"got {self.gpu_poll_interval_s}")
        ways = [name for name in ("rank_keys_dir", "rank_nkey", "rank_token_key_file")
                if getattr(self, name) is not None]
        if len(ways) > 1:
            raise ConfigError(f"agent.{' and agent.'.join(ways)} exclude each other: ranks "
                              "connect one way (a seed per job, one shared seed, or a token)")
        if not math.isfinite(self.rank_token_ttl_s) or self.rank_token_ttl_s < 60:
            raise ConfigError(f"agent.rank_token_ttl_s must be at least 60 s, "
                              f"got {self.rank_token_ttl_s}")
        if self.job_uids is not None:
            first, last = self.job_uids
            if not 0 < first <= last < 2**31 - 1:
                raise ConfigError(f"agent.job_uids must be a range FIRST-LAST of uids within "
                                  f"1..{2**31 - 2}, FIRST <= LAST, got {first}-{last}")
        if self.lost_after_s <= self.heartbeat_interval_s:
            raise ConfigError(f"agent.lost_after_s ({self.lost_after_s}) must exceed "
                              f"agent.heartbeat_interval_s ({self.heartbeat_interval_s})")

    def node_local_durable(self, default_dir: Path, env: Mapping[str, str]) -> str | None:
        """What to warn of when the durable tier's default (``checkpoint_dir`` unset:
        ``default_dir``, on this node) serves an agent in a Kubernetes pod, where that is
        the pod's own disk: lost with the pod and seen by no other node. None elsewhere
        (a local cluster's agents share their machine's disk)."""
        if self.checkpoint_dir or not env.get("KUBERNETES_SERVICE_HOST"):
            return None
        return (f"durable checkpoints of jobs that name no checkpoint.durable_url go to "
                f"{default_dir}, on this pod's disk: lost with the pod, and no other node "
                f"reads them. Give jobs a durable_url (s3://...), or set "
                f"{settings.AGENT('checkpoint_dir')} to a volume every node mounts "
                f"(docs/deploy.md \"Durable checkpoints off the nodes\")")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> AgentConfig:
        """Fields from ``PHALANX_AGENT_<FIELD>`` variables, then ``overrides`` (None ignored).

        Labels are given as ``key=value,key=value``, GPUs as ``0,1,2,3``; with GPUs and
        no slots, the node offers one slot per GPU.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(settings.AGENT(field.name))
            if raw is not None:
                values[field.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            if isinstance(values.get("labels"), str):
                values["labels"] = parse_labels(values["labels"])
            if isinstance(values.get("cpus"), str):
                values["cpus"] = parse_cpu_list(values["cpus"])
            if isinstance(values.get("gpus"), str):
                values["gpus"] = parse_gpus(values["gpus"])
            if isinstance(values.get("job_uids"), str):
                values["job_uids"] = parse_uid_range(values["job_uids"])
            if values.get("gpus"):
                values["gpus"] = tuple(values["gpus"])
                values.setdefault("slots", len(values["gpus"]))
            for name in ("slots", "replacement_nice", "snapshot_limit_bytes", "replica_port",
                         "rank_log_max_bytes"):
                if name in values:
                    values[name] = int(values[name])
            for name in ("heartbeat_interval_s", "lost_after_s", "shutdown_timeout_s",
                         "replica_duty", "gpu_poll_interval_s", "rank_token_ttl_s",
                         "fence_after_s"):
                if name in values:
                    values[name] = float(values[name])
            for name in ("stop_is_restart", "launch", "discover_gpus", "zygote",
                         "confine_memory", "tee_rank_output"):
                if isinstance(values.get(name), str):
                    values[name] = _flag(name, values[name])
        except ValueError as exc:
            raise ConfigError(f"agent config: {exc}") from None
        return cls(**values)


    @property
    def job_uid_range(self) -> range | None:
        """``job_uids`` as a range (None: jobs run as the agent)."""
        return None if self.job_uids is None else range(self.job_uids[0],
                                                        self.job_uids[1] + 1)

    @property
    def fence_s(self) -> float:
        """``fence_after_s``, its default resolved."""
        return self.lost_after_s if self.fence_after_s is None else self.fence_after_s


def _flag(name: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{settings.AGENT(name)} must be 1/0 (true/false, yes/no), "
                     f"got {raw!r}")


def default_node_id() -> str:
    """The host's short name with anything a subject token cannot hold replaced by '-'."""
    short = socket.gethostname().split(".")[0]
    return re.sub(r"[^A-Za-z0-9_\-]", "-", short) or "node"


def parse_gpus(text: str) -> tuple[int, ...]:
    """``"0,1,1"`` → ``(0, 1, 1)``; ``""`` → ``()`` (CPU slots)."""
    items = [p.strip() for p in text.split(",") if p.strip()]
    if not all(item.isdigit() for item in items):
        raise ValueError(f"gpus must be CUDA device indices separated by commas, got {text!r}")
    return tuple(int(item) for item in items)


def parse_uid_range(text: str) -> tuple[int, int] | None:
    """``"20000-29999"`` → ``(20000, 29999)``; ``"20000"`` → ``(20000, 20000)``; ``""`` →
    None (jobs run as the agent)."""
    text = text.strip()
    if not text:
        return None
    first, sep, last = text.partition("-")
    if not first.strip().isdigit() or (sep and not last.strip().isdigit()):
        raise ValueError(f"job_uids must be a range of uids FIRST-LAST (e.g. 20000-29999), "
                         f"got {text!r}")
    return int(first), int(last if sep else first)


def parse_labels(text: str) -> dict[str, str]:
    """``"gpu=a100,zone=b"`` → ``{"gpu": "a100", "zone": "b"}``."""
    labels = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"label {item!r} is not key=value")
        labels[key.strip()] = value.strip()
    return labels
