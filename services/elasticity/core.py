"""Membership of running jobs as generations: the elasticity service's rules. Pure.

A running job's membership is a sequence of *generations*: an ordered member
list (rank = position), the world size, a fresh rendezvous namespace, the step
to resume at, and why it changed (start, fault, join, leave).

* **Start.** An admitted job's replicas form generation 0.
* **Faults.** A failed member is dropped in the next generation if at least
  ``min`` members remain; survivors keep their relative order (and so, in
  order, their ranks). Below ``min`` the job *waits*: survivors keep their
  state in memory, replacements are requested, and a job still short after
  ``wait_timeout_s`` is handed back to admission (requeued).
* **Joins.** A new replica becomes a member only once it reports *ready*
  (torch imported, model built), so survivors never wait for a process to
  start; joiners are appended (highest ranks), up to ``max``.
* **One change at a time.** A generation is *in flight* until every member
  has applied it. Faults and joins arriving meanwhile are folded into the next
  generation, decided the moment the current one completes. A member that
  fails while a change is in flight is not waited for.
* **Resume step.** The highest step any surviving member committed: members
  behind it copy state from a peer that has it.

Events carry the ``event_id`` of what caused them; decisions carry it as
``cause``. ``now`` is passed in; the core reads no clock and does no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from phalanx.schemas.messages import Generation, GenerationReason, Member

# --- events --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobStarted:
    job_id: str
    replicas: tuple[tuple[str, str], ...]  # (replica id, node id), in rank order
    min_members: int
    max_members: int
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class MemberFailed:
    job_id: str
    replica_id: str
    detail: str = ""
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class ReplicaReady:
    job_id: str
    replica_id: str
    node_id: str
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class GenerationApplied:
    job_id: str
    generation: int
    replica_id: str
    committed_step: int
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class JobStopped:
    job_id: str
    event_id: str = ""


Event = JobStarted | MemberFailed | ReplicaReady | GenerationApplied | JobStopped

# --- decisions -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PublishGeneration:
    generation: Generation
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class RequestReplacements:
    job_id: str
    count: int
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Requeue:
    job_id: str
    reason: str
    cause: str = ""


Decision = PublishGeneration | RequestReplacements | Requeue

# --- state ---------------------------------------------------------------------------------


@dataclasses.dataclass
class JobMembership:
    job_id: str
    min_members: int
    max_members: int
    current: Generation
    applied: set[str] = dataclasses.field(default_factory=set)  # members done with current
    committed: dict[str, int] = dataclasses.field(default_factory=dict)  # replica -> step
    nodes: dict[str, str] = dataclasses.field(default_factory=dict)  # replica -> node
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # folded: replica -> why
    ready: dict[str, str] = dataclasses.field(default_factory=dict)  # folded: replica -> node
    waiting_since: float | None = None  # below min since

    @property
    def members(self) -> list[str]:
        return [m.replica_id for m in self.current.members]

    @property
    def in_flight(self) -> bool:
        return not set(self.members) <= self.applied


class ElasticityCore:
    """Generations of every running job. Feed :meth:`handle`; call :meth:`tick` for waits."""

    def __init__(self, wait_timeout_s: float = 60.0) -> None:
        if not wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be > 0, got {wait_timeout_s}")
        self.wait_timeout_s = wait_timeout_s
        self.jobs: dict[str, JobMembership] = {}

    def handle(self, event: Event, now: float) -> list[Decision]:
        """Apply one event.

        Raises:
            TypeError: not one of this module's events.
        """
        match event:
            case JobStarted():
                return self._started(event)
            case JobStopped():
                self.jobs.pop(event.job_id, None)
                return []
        job = self.jobs.get(getattr(event, "job_id", ""))
        match event:
            case MemberFailed() if job is not None:
                if event.replica_id in job.members or event.replica_id in job.ready:
                    job.ready.pop(event.replica_id, None)
                    if event.replica_id in job.members:
                        job.failed[event.replica_id] = event.detail or "failed"
                        job.applied.discard(event.replica_id)
            case ReplicaReady() if job is not None:
                if event.replica_id not in job.members:
                    job.ready[event.replica_id] = event.node_id
            case GenerationApplied() if job is not None:
                if event.generation == job.current.generation \
                        and event.replica_id in job.members:
                    job.applied.add(event.replica_id)
                    job.committed[event.replica_id] = max(
                        event.committed_step, job.committed.get(event.replica_id, 0))
            case MemberFailed() | ReplicaReady() | GenerationApplied():
                return []  # a job this core does not run (any more)
            case _:
                raise TypeError(f"unknown event {event!r}")
        return self._advance(job, now, getattr(event, "event_id", ""))

    def tick(self, now: float) -> list[Decision]:
        """Requeue jobs that stayed below ``min`` for longer than ``wait_timeout_s``."""
        decisions: list[Decision] = []
        for job in list(self.jobs.values()):
            if job.waiting_since is not None and now - job.waiting_since > self.wait_timeout_s:
                del self.jobs[job.job_id]
                decisions.append(Requeue(job.job_id, (
                    f"below its minimum of {job.min_members} members for more than "
                    f"{self.wait_timeout_s:g} s"), "wait-timeout"))
        return decisions

    def _started(self, event: JobStarted) -> list[Decision]:
        if event.job_id in self.jobs:
            return []  # replayed
        if not 1 <= event.min_members <= event.max_members:
            raise ValueError(f"need 1 <= min <= max, got {event.min_members}..{event.max_members}")
        generation = _generation(event.job_id, 0, [r for r, _ in event.replicas],
                                 dict(event.replicas), 0, GenerationReason.START, "admitted")
        job = JobMembership(event.job_id, event.min_members, event.max_members, generation,
                            nodes=dict(event.replicas))
        self.jobs[event.job_id] = job
        return [PublishGeneration(generation, event.event_id)]

    def _advance(self, job: JobMembership, now: float, cause: str) -> list[Decision]:
        """Decide the next generation if none is in flight and something changed."""
        # A failed member cannot apply anything: don't wait for it.
        if job.in_flight and not (set(job.members) - job.applied - set(job.failed)):
            job.applied |= set(job.failed)
        if job.in_flight or not (job.failed or job.ready):
            return []
        survivors = [r for r in job.members if r not in job.failed]
        if len(survivors) < job.min_members:
            decisions: list[Decision] = []
            if job.waiting_since is None:
                job.waiting_since = now
                decisions.append(RequestReplacements(
                    job.job_id, job.min_members - len(survivors) - len(job.ready), cause))
            joiners = list(job.ready)[:job.max_members - len(survivors)]
            if len(survivors) + len(joiners) < job.min_members:
                return decisions  # wait: survivors keep their state in memory
            return decisions + self._next(job, survivors, joiners, cause)
        joiners = list(job.ready)[:max(0, job.max_members - len(survivors))]
        if not job.failed and not joiners:
            return []  # at max: ready replicas wait for room
        return self._next(job, survivors, joiners, cause)

    def _next(self, job: JobMembership, survivors: list[str], joiners: list[str],
              cause: str) -> list[Decision]:
        if job.failed:
            reason = GenerationReason.FAULT
            why = "dropped " + ", ".join(f"{r} ({d})" for r, d in sorted(job.failed.items()))
        else:
            reason = GenerationReason.JOIN
            why = "joined " + ", ".join(joiners)
        if job.failed and joiners:
            why += "; joined " + ", ".join(joiners)
        for replica in joiners:
            job.nodes[replica] = job.ready.pop(replica)
        for replica in job.failed:
            job.committed.pop(replica, None)
            job.nodes.pop(replica, None)
        resume = max((job.committed.get(r, 0) for r in survivors), default=0)
        job.current = _generation(job.job_id, job.current.generation + 1, survivors + joiners,
                                  job.nodes, resume, reason, why)
        job.failed.clear()
        job.applied.clear()
        job.waiting_since = None
        return [PublishGeneration(job.current, cause)]

    def check_invariants(self) -> None:
        for job in self.jobs.values():
            members = job.members
            assert len(set(members)) == len(members), "a replica is a member twice"
            assert job.current.world_size == len(members)
            assert not set(job.ready) & set(members), "a member is also waiting to join"
            assert len(members) <= job.max_members, "above max"
            assert len(members) >= job.min_members or job.current.generation == 0 \
                or job.waiting_since is not None or job.failed, "below min without waiting"


def _generation(job_id: str, number: int, replicas: Sequence[str], nodes: dict[str, str],
                resume_step: int, reason: GenerationReason, cause: str) -> Generation:
    return Generation(
        job_id=job_id, generation=number,
        members=[Member(replica_id=r, rank=i, node_id=nodes[r]) for i, r in enumerate(replicas)],
        world_size=len(replicas), rendezvous=f"{job_id}-g{number}", resume_step=resume_step,
        reason=reason, cause=cause)
