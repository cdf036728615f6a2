"""What the elasticity core hears and what it decides: its events and decisions. Pure.

Events are what the service saw (a job's admitted record, a fault, a replica's readiness,
a member's applied or given-up report, an exit), each a frozen dataclass carrying the
``event_id`` of what caused it; decisions are what the service is to do (publish a
generation, launch or stop a replica, requeue a job), carrying that id as ``cause``.
"""

from __future__ import annotations

import dataclasses

from phalanx.schemas.messages import Generation, StateSource

# --- events --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobAdmitted:
    """Admission's current placement of an admitted job: slot ``s`` on ``slots[s]``, where
    ``r<s>-0`` runs at first. Sent for every admitted record seen, changed or not."""

    job_id: str
    slots: dict[int, str]
    min_members: int
    max_members: int
    event_id: str = ""
    max_replacements: int | None = None  # the job's restart_policy.max_restarts
    sizes: tuple[int, ...] = ()  # the sizes its scaling rules allow (empty: every size)
    admission: int = 0  # which admission of the job the record is (0: not known)
    #: The most steps the job committed over its admissions (``JobProgress.reached``):
    #: a job admitted again resumes there, so its first generation's members know it.
    reached: int = 0
    #: The spec declares a session: each process is a world of its own from the start,
    #: never a torchrun gang, so a failure before the first ready replaces it alone.
    session: bool = False


@dataclasses.dataclass(frozen=True)
class MemberFailed:
    job_id: str
    replica_id: str
    detail: str = ""
    replaceable: bool = True  # False when its node is gone
    event_id: str = ""
    admission: int = 0  # the job's admission the replica was started for (0: not known)


@dataclasses.dataclass(frozen=True)
class ReplicaReadySeen:
    job_id: str
    replica_id: str
    node_id: str
    slot: int
    endpoint: str
    event_id: str = ""
    admission: int = 0  # the job's admission the replica was started for (0: not known)


@dataclasses.dataclass(frozen=True)
class GenerationAppliedSeen:
    job_id: str
    generation: int
    replica_id: str
    committed_step: int
    event_id: str = ""
    pause_s: float | None = None  # what the change cost this member (None: a joiner)
    resume_step: int | None = None  # the step the members agreed to resume after
    restored_from: StateSource | None = None  # where the members' state came from
    admission: int = 0  # the job's admission the member was started for (0: not known)


@dataclasses.dataclass(frozen=True)
class GenerationGivenUpSeen:
    """A member could not form ``generation`` (its rendezvous failed) or finish its
    collectives, and waits for a newer one; ``reason`` is what failed, ``unreachable``
    the members whose nodes it could not reach (a link cut)."""

    job_id: str
    generation: int
    replica_id: str
    reason: str = ""
    event_id: str = ""
    admission: int = 0  # the job's admission the member was started for (0: not known)
    unreachable: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class MemberFinished:
    """A replica exited 0: if it was a member, the training is complete."""

    job_id: str
    replica_id: str
    event_id: str = ""
    admission: int = 0  # the job's admission the replica was started for (0: not known)


@dataclasses.dataclass(frozen=True)
class ReplicaExited:
    """A replica ended other than with exit code 0 (a signal, a non-zero code, a stop)."""

    job_id: str
    replica_id: str
    detail: str = ""
    event_id: str = ""
    admission: int = 0  # the job's admission the replica was started for (0: not known)


@dataclasses.dataclass(frozen=True)
class JobStopped:
    """The job's record is not admitted (pending, requeued, ended), whether or not this
    core ran it: its events until it is admitted again are an earlier admission's."""

    job_id: str
    event_id: str = ""


Event = (JobAdmitted | MemberFailed | ReplicaReadySeen | GenerationAppliedSeen | MemberFinished
         | ReplicaExited | JobStopped | GenerationGivenUpSeen)

# --- decisions -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PublishGeneration:
    generation: Generation
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class LaunchReplacement:
    """Start ``replica_id`` in ``slot`` on ``node_id`` (stopping what still runs there).

    ``warm_only``: only from a warm spare of the job on that node; with none there, the
    agent starts nothing, and the same launch follows without it once the survivors have
    recovered (:meth:`ElasticityCore.handle`).
    """

    job_id: str
    slot: int
    node_id: str
    replica_id: str
    cause: str = ""
    warm_only: bool = False
    #: One slot of a restart of the whole torchrun gang, before the job is managed.
    gang: bool = False


@dataclasses.dataclass(frozen=True)
class RetireReplica:
    """Stop ``replica_id`` in ``slot`` on ``node_id``: the job no longer needs it."""

    job_id: str
    slot: int
    node_id: str
    replica_id: str
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Requeue:
    job_id: str
    reason: str
    cause: str = ""


Decision = PublishGeneration | LaunchReplacement | RetireReplica | Requeue
