"""The agent's rules, pure: registration, slots, exits, spares, and which ranks run here.

An agent may take a node id when no record holds it, when the record is its
own (same host and pid: a re-registration), when the holder ran on the same
host and its process is gone (a restarted agent takes its node back at once),
or when the agent watched the holder's record for ``lost_after_s`` by its own
clock and no heartbeat came (:func:`silent_holder`). The holder's stamps are
never compared with this agent's clock, so clocks may disagree by any amount.
Two live agents never share an id. Each heartbeat bumps the sequence and time
and keeps what others set on the record (``cordoned``, and ``cordoned_slots``,
which an operator's uncordon removes), adding the slots the agent cordoned since
(:func:`heartbeat`); a re-registration keeps both.

A node's slots are its GPUs or its CPUs (:func:`node_gpus`): the GPUs configured
(``agent.gpus``) win; else, when NVML found GPUs, one slot per GPU; else the slots
configured, or one per CPU. A GPU fault takes the slots on that GPU out of use
(:func:`gpu_slots`; on a node without GPUs an injected fault names a slot), and a
rank on a GPU runs on that GPU's CPUs, one on a CPU slot on its slot's share of the
agent's CPUs where it has a set (:func:`rank_cpus`).

Which of a job's ranks run here, which replica a slot may run and where a replica
starts are the rules of :mod:`.reconcile`, offered here too: the shell hands them what
runs and what was launched, and carries out the decisions they return. It keeps the
last launch of every slot on disk, so a replica is launched at most once per node
across agent restarts too.

Each job's processes may run as a user of their own (``agent.job_uids``, as slurmd runs
a job as its user): :func:`job_user` gives a job its uid, stable while anything of the
job is on the node, never shared by two jobs at once.

Why a rank ended (:func:`exit_cause`) is reported as what it means to its job:
a rank that ended by itself *exited*; one stopped because its job no longer
wants it there (cancel, preemption, a shrink, a replica not needed) was
*stopped*, which is no fault; but one stopped because this agent is shutting
down (``phalanx down``, a service restart) is *lost* with its agent, as one
found dead by a restarted agent is: its job still wants it, so health faults it
and elasticity replaces it. Reported as stopped, a cluster restart left every
member of a running job dead without a fault, and the job waited on them for
ever.

Warm spares (:mod:`.spares`) hold no slot, so they live in what the node has
free: :func:`spare_counts` gives each job the spares its spec asks for while
the slots no admitted replica is placed on still hold them, jobs served in the
order given. On a node that lists GPUs a spare is started on the GPUs of free
slots, and :func:`slots_on_gpus` finds it free slots on those GPUs again when it
is taken (or says it has none left, when ranks or cordons took them: it is
stopped). A spare that dies by itself is started again
after :func:`spare_restart_delay`: at once the first time, then backing off,
so a script that cannot start does not loop. A job whose replica is a group of
several ranks keeps spare groups: each one the group's processes, in a whole group's
free slots.

A replica of several ranks (``ranks_per_replica``: a *group*) is that many processes,
each on its own share of the replica's slots (:func:`group_slots`), with torchrun's
variables describing the group, on this node, not the job (:func:`group_variables`).
The group lives and dies together: once one of its processes ends, the others are
stopped, at once unless it exited 0 (a finished job, a planned leave: they are given
the grace period to end by themselves first, :func:`siblings_wait_s`), and the replica's
end is reported once (:func:`group_exit`): the first process's, or the first failure
if it exited 0 and another did not.
"""

from __future__ import annotations

import dataclasses
import enum
import zlib
from collections.abc import Collection, Mapping, Sequence

from phalanx.schemas import environment
from phalanx.schemas.errors import ConfigError, MustStop, PhalanxError
from phalanx.schemas.messages import ExitCause, GpuInfo, NodeInfo, NodeRecord
from phalanx.services.agent.reconcile import (
    Decision,
    Forget,
    Keep,
    Launch,
    LaunchVerdict,
    Leave,
    Refusal,
    Refuse,
    SlotWait,
    Start,
    Stop,
    drop,
    first_replica,
    launch_verdict,
    node_slots,
    reconcile,
    replacement,
    slots_for,
    stop_request,
)

# The rules of which ranks run here, offered with the rest (they live in .reconcile).
__all__ = [
    "DEFAULT_SPARES", "SPARE_BACKOFF_MAX_S", "Decision", "Forget", "JobUidsExhausted",
    "JobUser", "Keep", "Launch", "LaunchVerdict", "Leave", "NodeIdTaken", "ProcessEnd",
    "Refusal", "Refuse", "SlotWait", "Start", "Stop", "StopReason", "drop", "exit_cause",
    "first_replica", "gpu_slots", "group_exit", "group_slots", "group_variables",
    "heartbeat", "job_user", "launch_verdict", "node_gpus", "node_slots", "rank_cpus",
    "rank_devices", "reconcile", "register", "replacement", "same_agent", "siblings_wait_s",
    "silent_holder", "slots_for", "slots_on_gpus", "spare_counts", "spare_restart_delay",
    "spares_wanted", "stop_request",
]


class NodeIdTaken(MustStop):
    """Another live agent holds this node id."""


# --- job identities on the node ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobUser:
    """The user and group a job's processes run as on this node (``agent.job_uids``)."""

    uid: int
    gid: int


class JobUidsExhausted(PhalanxError, OSError):
    """Every uid of ``agent.job_uids`` is held by a job with something on this node."""


def job_user(job_id: str, held: Mapping[str, int], uids: range) -> JobUser:
    """The user ``job_id`` runs as here: the uid it holds already (``held``: job -> uid,
    every job with processes, snapshots or private directories on this node), else the
    first free uid of ``uids`` from a point the job's id picks (so the same job mostly
    gets the same uid on every node and after the mapping is lost). Its group is the
    uid's number. Two jobs never share a uid while both hold it: the caller keeps
    ``held`` (on disk, so an agent restarted after a crash gives adopted ranks' jobs
    their uid again) and frees a job's uid only once nothing of it is left here.

    Raises:
        JobUidsExhausted: every uid of ``uids`` is held.
    """
    if job_id in held:
        return JobUser(held[job_id], held[job_id])
    taken = set(held.values())
    first = zlib.crc32(job_id.encode()) % len(uids)
    for i in range(len(uids)):
        uid = uids[(first + i) % len(uids)]
        if uid not in taken:
            return JobUser(uid, uid)
    raise JobUidsExhausted(f"all {len(uids)} uids of agent.job_uids ({uids.start}.."
                           f"{uids.stop - 1}) are held by jobs on this node")


def same_agent(held: NodeInfo, info: NodeInfo) -> bool:
    """Whether a registry entry's ``held`` is the agent of ``info``: the same process on
    the same host."""
    return held.host == info.host and held.agent_pid == info.agent_pid


def register(existing: NodeRecord | None, info: NodeInfo, now: float, *,
             holder_dead: bool = False, silent: NodeRecord | None = None) -> NodeRecord:
    """The record to store when ``info``'s agent registers at ``now``.

    Args:
        holder_dead: the holder ran on this host and its process is gone (the caller
            checked), so a restarted agent takes its node back at once.
        silent: the holder's record as the caller saw it before watching it for a
            timeout with no heartbeat coming (:func:`silent_holder`): taken over if it
            is still the record held.

    Raises:
        NodeIdTaken: a different agent holds the id and is not known to be gone.
    """
    if existing is not None:
        held = existing.node
        if (not same_agent(held, info) and not (holder_dead and held.host == info.host)
                and not silent_holder(silent, existing)):
            watched = "" if silent is None else ", and it beat while this agent watched"
            raise NodeIdTaken(
                f"node id {info.node_id!r} is held by a live agent (pid {held.agent_pid} "
                f"on {held.host}{watched}); pick another --node-id")
    cordoned = existing.cordoned if existing is not None else False
    slots = _within(existing.cordoned_slots if existing is not None else {}, info)
    return NodeRecord(node=info, heartbeat_seq=0, heartbeat_at=now, cordoned=cordoned,
                      cordoned_slots=slots)


def silent_holder(watched: NodeRecord | None, now_held: NodeRecord | None) -> bool:
    """Whether a holder's record seen at the start of a watch (``watched``) is the one
    held at its end (``now_held``): the same agent, with no newer heartbeat."""
    return (watched is not None and now_held is not None and watched.node == now_held.node
            and watched.heartbeat_at == now_held.heartbeat_at
            and watched.heartbeat_seq == now_held.heartbeat_seq)


def heartbeat(record: NodeRecord | None, info: NodeInfo, now: float,
              slots_used: int = 0, cordons: Mapping[int, str] | None = None) -> NodeRecord:
    """``record`` after a heartbeat at ``now`` (re-created if someone removed it), with
    the slots this agent cordoned and has not seen stored yet (``cordons``) added; a
    slot cordoned already keeps its first reason.

    Raises:
        NodeIdTaken: another agent registered this id meanwhile (this one was
            taken for lost); the agent must stop rather than fight over the id.
    """
    slots = _within({**(cordons or {}),
                     **(record.cordoned_slots if record is not None else {})}, info)
    if record is None:
        return NodeRecord(node=info, heartbeat_at=now, slots_used=slots_used,
                          cordoned_slots=slots)
    if not same_agent(record.node, info):
        raise NodeIdTaken(
            f"node id {info.node_id!r} was taken over by pid {record.node.agent_pid} on "
            f"{record.node.host} while this agent's heartbeats were late"
        )
    return NodeRecord(node=info, heartbeat_seq=record.heartbeat_seq + 1, heartbeat_at=now,
                      slots_used=slots_used, cordoned=record.cordoned, cordoned_slots=slots)


def _within(cordoned: Mapping[int, str], info: NodeInfo) -> dict[int, str]:
    """The cordoned slots the node still has (it may have come back with fewer)."""
    return {slot: why for slot, why in sorted(cordoned.items()) if slot < info.slots}


def node_gpus(slots: int | None, gpus: tuple[int, ...], found: Sequence[GpuInfo] | None,
              cpus: int) -> tuple[int, tuple[int, ...]]:
    """The node's slot count and the GPU of each slot (empty: CPU slots).

    Args:
        slots: ``agent.slots`` (None: not configured).
        gpus: ``agent.gpus`` (empty: not configured).
        found: the GPUs NVML found at start (None: NVML absent, or not asked).
        cpus: the machine's CPU count.

    Raises:
        ConfigError: NVML found GPUs, none are configured, and a slot count other than
            their number is: which GPUs the slots would be is not known.
    """
    if gpus:
        return slots or len(gpus), gpus
    if found:
        if slots is not None and slots != len(found):
            raise ConfigError(
                f"agent.slots is {slots} but NVML found {len(found)} GPUs, one slot each: "
                f"set agent.gpus to the GPU of each slot (e.g. "
                f"{','.join(str(g.index) for g in found[:slots])}), or agent.discover_gpus "
                "to 0 for CPU slots")
        return len(found), tuple(g.index for g in found)
    return slots or cpus, ()


def gpu_slots(gpu: int, gpus: tuple[int, ...], slots: int) -> tuple[int, ...]:
    """The node's slots that run on GPU ``gpu`` (the slot ``gpu`` itself on a node of CPU
    slots, where an injected GPU fault names a slot; none if there is no such slot)."""
    if gpus:
        return tuple(s for s, g in enumerate(gpus) if g == gpu)
    return (gpu,) if gpu < slots else ()


def rank_cpus(gpus: tuple[int, ...], found: Sequence[GpuInfo], slots: tuple[int, ...],
              slot_cpus: Sequence[Sequence[int]] = ()) -> set[int]:
    """The CPUs a rank holding ``slots`` is pinned to: on GPU slots, those close to its
    GPUs (NVML's affinity); on CPU slots, its slots' shares of the agent's CPU set
    (``slot_cpus``, :func:`~.cpus.shares`). Empty (not pinned) where neither is known."""
    if gpus:
        by_index = {g.index: g for g in found}
        return {cpu for s in slots if s < len(gpus) and gpus[s] in by_index
                for cpu in by_index[gpus[s]].cpus}
    return {cpu for s in slots if s < len(slot_cpus) for cpu in slot_cpus[s]}


class StopReason(enum.Enum):
    """Why the agent stops a rank."""

    JOB = "job"
    """Its job no longer wants it here: the record ended or moved it, or elasticity
    stopped a replica it does not need (or replaced it)."""
    AGENT = "agent"
    """This agent is shutting down while the job still wants the rank."""
    GPU_FAULT = "gpu_fault"
    """The GPU of its slot failed: the rank cannot go on there."""
    FENCED = "fenced"
    """This node could not confirm the bus for ``fence_after_s`` (:mod:`.fence`): its jobs
    may have gone on without it, and still want the rank, so it is lost."""


def exit_cause(stop: StopReason | None, *, status_known: bool = True,
               oom: bool = False) -> ExitCause:
    """What a rank's end is reported as, given why this agent stopped it (None: it did
    not), whether its exit status is known (False: adopted after an agent restart) and
    whether the OOM killer ended a process of it in its memory cgroup (``oom``: it passed
    its job's ``memory_per_rank``, its own fault even where its status is not known)."""
    if stop is StopReason.JOB:
        return ExitCause.STOPPED
    if stop is StopReason.GPU_FAULT:
        return ExitCause.GPU_FAULT
    if stop in (StopReason.AGENT, StopReason.FENCED):
        return ExitCause.LOST
    if oom:
        return ExitCause.OOM
    if not status_known:
        return ExitCause.LOST
    return ExitCause.EXITED


def rank_devices(gpus: tuple[int, ...], slots: tuple[int, ...]) -> dict[str, str]:
    """The placement variables of a replica that holds this node's ``slots``: its
    ``LOCAL_RANK``, ``PHALANX_DEVICE`` (``cuda`` when the node lists ``gpus``, one per
    slot, else ``cpu``: :func:`phalanx.runtime.placement.device`) and, on a GPU node,
    ``CUDA_VISIBLE_DEVICES``: the slots' GPUs, which the rank then sees alone (as
    ``cuda:0`` onwards). ``LOCAL_RANK`` is the first slot's index on a CPU node and 0 on
    a GPU node, where a script's ``cuda:LOCAL_RANK`` must name the first GPU it sees.

    Raises:
        ValueError: a slot beyond the GPUs listed (the node offers one slot per GPU).
    """
    env = {"LOCAL_RANK": "0" if gpus else str(slots[0]),
           environment.DEVICE: "cuda" if gpus else "cpu"}
    if gpus:
        beyond = [s for s in slots if s >= len(gpus)]
        if beyond:
            raise ValueError(f"slots {beyond} have no GPU: the node lists {len(gpus)}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpus[s]) for s in slots)
    return env


#: How long the restarts of a job's spares that keep dying back off, at most.
SPARE_BACKOFF_MAX_S = 60.0


#: The warm spares a job whose spec leaves ``spares`` unset keeps on each of its nodes, once
#: its ranks run a phalanx session (:func:`spares_wanted`).
DEFAULT_SPARES = 1


def spares_wanted(asked: int | None, session: bool) -> int:
    """The spares a job keeps on a node with room for them: what its spec asks, else
    :data:`DEFAULT_SPARES` once its ranks are known to run a phalanx session (``session``:
    the job has a generation, or its spec declares a ``session``), else none. A spare
    runs the job's command and waits inside ``ElasticSession.from_env``; a command that
    never gets there would run to its end beside the ranks, so a default is only given
    to a job shown, or declared, to get there. A job whose replica is a group of several
    ranks counts spare *groups*: each is a whole group's processes."""
    if asked is not None:
        return asked
    return DEFAULT_SPARES if session else 0


def spare_counts(capacity: int | None, placed: int,
                 jobs: Sequence[tuple[str, int, int]]) -> dict[str, int]:
    """How many warm spares each job keeps on this node.

    Args:
        capacity: the node's slots (None: unbounded).
        placed: the slots admitted replicas are placed on here, running or not (a dead
            rank's slot is its replacement's).
        jobs: ``(job id, spares its spec asks for, slots per replica)`` of each elastic
            job running here, in the order they are served (a group's replica: all its
            ranks' slots, and each spare a whole group).

    Returns:
        job id -> spares to keep (every job of ``jobs``, 0 included).
    """
    free = None if capacity is None else max(0, capacity - placed)
    counts: dict[str, int] = {}
    for job_id, asked, slots_per_replica in jobs:
        count = asked if free is None else min(asked, free // slots_per_replica)
        if free is not None:
            free -= count * slots_per_replica
        counts[job_id] = count
    return counts


def slots_on_gpus(gpus: tuple[int, ...], unusable: Collection[int],
                  wanted: tuple[int, ...]) -> tuple[int, ...] | None:
    """Slots of this node, none of them ``unusable``, whose GPUs are ``wanted`` in that
    order (a spare's, which its process sees as ``cuda:0`` onwards); None if there are
    none. On a node of CPU slots (``gpus`` empty) a spare has no GPUs: ``()``.

    A spare's process fixed its GPUs when it started (CUDA reads ``CUDA_VISIBLE_DEVICES``
    once), so the replica it becomes must run in slots on those GPUs, lowest first.
    """
    chosen: list[int] = []
    for gpu in wanted:
        slot = next((s for s, g in enumerate(gpus)
                     if g == gpu and s not in unusable and s not in chosen), None)
        if slot is None:
            return None
        chosen.append(slot)
    return tuple(chosen)


def spare_restart_delay(failures: int) -> float:
    """How long to wait before starting a spare again after ``failures`` spares of its job
    died by themselves in a row: none after the first, then 1, 2, 4 … s, at most
    :data:`SPARE_BACKOFF_MAX_S`."""
    if failures <= 1:
        return 0.0
    return min(SPARE_BACKOFF_MAX_S, 2.0 ** (failures - 2))


# --- a replica of several ranks (a group) --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessEnd:
    """How one process of a replica ended: its rank in the replica's group (0 for a
    replica of one rank), its exit code or the signal that ended it, or neither when the
    status is not known (``known`` False: adopted after an agent restart, or its zygote
    died first)."""

    group_rank: int
    exit_code: int | None
    signal: str | None = None
    known: bool = True

    @property
    def clean(self) -> bool:
        """It exited 0 by itself."""
        return self.known and self.exit_code == 0


def group_slots(slots: tuple[int, ...], ranks: int) -> tuple[tuple[int, ...], ...]:
    """Each group rank's share of a replica's ``slots`` (:func:`slots_for`'s, lowest
    first): rank ``s`` holds the ``s``-th run of ``len(slots) // ranks``."""
    per = len(slots) // ranks
    return tuple(slots[s * per:(s + 1) * per] for s in range(ranks))


def group_variables(gpus: tuple[int, ...], slots: tuple[int, ...], group_rank: int,
                    ranks: int, master_port: int) -> dict[str, str]:
    """torchrun's variables of rank ``group_rank`` of a group of ``ranks`` processes on
    this node, holding this node's ``slots``: they describe the group, not the job
    (``RANK`` the group rank, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` the group's size,
    ``GROUP_RANK`` 0, ``MASTER_ADDR`` this host, ``MASTER_PORT`` the group's), so that a
    script's own ``init_process_group`` and device mesh are the group's; and its device
    variables (:func:`rank_devices`). ``LOCAL_RANK`` is the group rank on a node of CPU
    slots and 0 on a GPU node, where the process sees its slots' GPUs alone (as
    ``cuda:0`` onwards)."""
    # On CPU slots the group rank is all a process's placement says (a warm spare group's
    # processes, which hold no slots yet, get the same).
    env = rank_devices(gpus, slots) if gpus \
        else {"LOCAL_RANK": str(group_rank), environment.DEVICE: "cpu"}
    env.update({"RANK": str(group_rank), "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)})
    return env


def siblings_wait_s(first: ProcessEnd, grace_s: float) -> float:
    """How long the other processes of a group whose process ``first`` ended are left to
    end by themselves before they are stopped (SIGTERM, then SIGKILL after ``grace_s``):
    the grace period after a clean exit (the job finished, or the replica leaves: they
    exit 0 too, and a SIGTERM would cut their last writes), none after any other end,
    which is the group's failure."""
    return grace_s if first.clean else 0.0


def group_exit(ends: Sequence[ProcessEnd]) -> ProcessEnd:
    """What a group's replica is reported to have ended with, given its processes' ends
    in the order they were seen: the first; but a first that exited 0 while another did
    not is no clean end of the group, and the first failure is reported instead.

    Raises:
        ValueError: no end given.
    """
    if not ends:
        raise ValueError("a group ends with at least one process")
    return next((end for end in ends if not end.clean), ends[0])
