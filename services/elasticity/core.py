"""Membership of running jobs as generations: the elasticity service's rules. Pure.

:class:`ElasticityCore` is the entry point: it keeps one :class:`~.model.JobMembership`
per admitted job and hands each event to the rules of the job's phase
(:class:`~.phase.Phase`): :mod:`.gang` before its first ready replica,
:mod:`.generations` after. It also keeps the events that come before their job's
admitted record, requeues jobs left below ``min``, and hands the shell the histories to
store. Events carry the ``event_id`` of what caused them and decisions carry it as
``cause`` (:mod:`.events`); ``now`` is passed in, and the core does no I/O. What a new
leader restores is :mod:`.stored`'s.
"""

from __future__ import annotations

from phalanx.schemas.messages import JobHistory
from phalanx.schemas.replicas import another_admission
from phalanx.services.elasticity import gang, generations, stored
from phalanx.services.elasticity.events import (
    Decision,
    Event,
    GenerationAppliedSeen,
    GenerationGivenUpSeen,
    JobAdmitted,
    JobStopped,
    LaunchReplacement,
    MemberFailed,
    MemberFinished,
    PublishGeneration,
    ReplicaExited,
    ReplicaReadySeen,
    Requeue,
    RetireReplica,
)
from phalanx.services.elasticity.generations import GATHER_S
from phalanx.services.elasticity.model import JobMembership, Replica, slot_of
from phalanx.services.elasticity.phase import TRANSITIONS, Phase
from phalanx.services.elasticity.stored import snapshot

# The names the core has always offered, wherever they are defined now.
__all__ = [
    "EARLY_JOBS", "EARLY_PER_JOB", "EARLY_TTL_S", "GATHER_S", "TRANSITIONS", "Decision",
    "ElasticityCore", "Event", "GenerationAppliedSeen", "GenerationGivenUpSeen",
    "JobAdmitted", "JobMembership", "JobStopped", "LaunchReplacement", "MemberFailed",
    "MemberFinished", "Phase", "PublishGeneration", "Replica", "ReplicaExited",
    "ReplicaReadySeen", "Requeue", "RetireReplica", "slot_of", "snapshot",
]

#: How long events about a job not admitted yet (or ended) are kept, and how many at most.
EARLY_TTL_S = 120.0
EARLY_PER_JOB = 256
EARLY_JOBS = 1024


class ElasticityCore:
    """Generations of every running job. Feed :meth:`handle`; call :meth:`tick` for waits.

    Args:
        wait_timeout_s: how long a job may stay below its minimum before it is requeued.
        max_replacements: replacements launched per job before giving up on a slot.
    """

    def __init__(self, wait_timeout_s: float = 60.0, max_replacements: int = 16) -> None:
        if not wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be > 0, got {wait_timeout_s}")
        if max_replacements < 0:
            raise ValueError(f"max_replacements must be >= 0, got {max_replacements}")
        self.wait_timeout_s = wait_timeout_s
        self.max_replacements = max_replacements
        self.jobs: dict[str, JobMembership] = {}
        self._histories: dict[str, float] = {}  # job -> when its history last changed
        # Events about a job whose admitted record has not been seen yet (the record and
        # the events travel apart): applied when it is, forgotten after EARLY_TTL_S.
        self._early: dict[str, list[tuple[float, Event]]] = {}
        self._ended: dict[str, float] = {}  # job -> when it ended: its late events are old

    def take_histories(self) -> list[JobHistory]:
        """The histories of the jobs whose history (or count of replacements launched)
        changed since the last call, for the shell to store where ``phalanx job`` reads
        them."""
        changed, self._histories = self._histories, {}
        return [JobHistory(job_id=job.job_id, generations=list(job.history),
                           replacements=job.replaced, updated_at=at)
                for job_id, at in changed.items() if (job := self.jobs.get(job_id))]

    def handle(self, event: Event, now: float) -> list[Decision]:
        """Apply one event.

        :class:`JobAdmitted` is level-triggered (sent for every admitted record seen, the
        same one seen twice changes nothing). An event of a job whose record has not been
        seen yet is kept and applied when it is (within ``EARLY_TTL_S`` and bounds); one
        of a job that ended, or of another admission than the job's, is old news.

        Raises:
            TypeError: not one of :mod:`.events`' events.
            ValueError: a JobAdmitted with an impossible size.
        """
        match event:
            case JobAdmitted():
                job = self.jobs.get(event.job_id)
                if job is not None and another_admission(job.admission, event.admission):
                    # Admitted again and this core never saw the requeue between: the
                    # earlier membership is over, whatever it was doing.
                    del self.jobs[event.job_id]
                    job = None
                if job is None:
                    self._admitted(event)
                    self._ended.pop(event.job_id, None)
                    decisions: list[Decision] = []
                    for _, early in self._early.pop(event.job_id, []):
                        decisions += self.handle(early, now)
                    return decisions
            case JobStopped():
                self.jobs.pop(event.job_id, None)
                self._early.pop(event.job_id, None)
                self._ended[event.job_id] = now
                return []
            case MemberFailed() | ReplicaReadySeen() | GenerationAppliedSeen() | MemberFinished() \
                    | ReplicaExited() | GenerationGivenUpSeen():
                job = self.jobs.get(event.job_id)
                if job is None and event.job_id not in self._ended:
                    self._keep_early(event, now)
                    return []
                if job is not None and another_admission(job.admission, event.admission):
                    return []  # an earlier admission's, read late: its replica ids recur
            case _:
                raise TypeError(f"unknown event {event!r}")
        if job is None:
            return []  # a job this core does not run any more
        match job.phase:
            case Phase.COMPLETE:
                return []
            case Phase.GANG:
                decisions, managed = gang.handle(job, event)
                for then in managed:
                    decisions += self.handle(then, now)
                return decisions
        told = _history_mark(job)
        decisions = generations.handle(job, event, now)
        if _history_mark(job) != told:
            self._histories[job.job_id] = now
        return decisions

    def tick(self, now: float) -> list[Decision]:
        """Requeue jobs that stayed below ``min`` for longer than ``wait_timeout_s``; decide
        the generation of a job that waited GATHER_S for its replacements; forget early
        events and ended jobs older than ``EARLY_TTL_S``."""
        for job_id in [j for j, kept in self._early.items() if now - kept[0][0] > EARLY_TTL_S]:
            del self._early[job_id]
        for job_id in [j for j, at in self._ended.items() if now - at > EARLY_TTL_S]:
            del self._ended[job_id]
        decisions: list[Decision] = []
        for job in list(self.jobs.values()):
            if job.gather_since is not None and now - job.gather_since >= GATHER_S:
                decisions += generations.decide(job, now, "gather-timeout")
            if job.waiting_since is not None and now - job.waiting_since > self.wait_timeout_s:
                del self.jobs[job.job_id]
                decisions.append(Requeue(job.job_id, (
                    f"below its minimum of {job.min_members} members for more than "
                    f"{self.wait_timeout_s:g} s"), "wait-timeout"))
        return decisions

    def awaits(self, launch: LaunchReplacement) -> bool:
        """Does this core still wait for ``launch``'s replica to start (its job runs, the
        replica is expected in that slot on that node and has not reported ready)? The
        shell repeats a launch request that got no answer until this is False: an agent
        restarting with the cluster answers only once it is up, and a replacement asked
        of it meanwhile must not be lost (agents launch a replica id at most once)."""
        job = self.jobs.get(launch.job_id)
        return job is not None and not job.complete \
            and job.launched.get(launch.replica_id) == launch.slot \
            and job.slots.get(launch.slot) == launch.node_id

    def restore(self, data: bytes) -> str:
        """Take back one job's state from its :func:`snapshot`; returns the job id.

        Raises:
            StoredStateError: ``data`` is not a snapshot this version can read.
        """
        job = stored.restore(data)
        self.jobs[job.job_id] = job
        return job.job_id

    def check_invariants(self) -> None:
        """Assert every job's membership is consistent (used by tests after every step)."""
        for job in self.jobs.values():
            job.check_invariants()

    def _keep_early(self, event: Event, now: float) -> None:
        """Keep an event that came before its job's admitted record, within bounds (events
        per job, jobs): past them the oldest go first."""
        kept = self._early.setdefault(event.job_id, [])
        if len(kept) >= EARLY_PER_JOB:
            del kept[0]
        kept.append((now, event))
        if len(self._early) > EARLY_JOBS:
            del self._early[next(iter(self._early))]  # the job first kept

    def _admitted(self, event: JobAdmitted) -> None:
        if not 1 <= event.min_members <= event.max_members:
            raise ValueError(f"need 1 <= min <= max, got {event.min_members}..{event.max_members}")
        budget = self.max_replacements if event.max_replacements is None \
            else event.max_replacements
        # Admitted again, it resumes where its earlier admissions left it (``reached``).
        self.jobs[event.job_id] = JobMembership(
            event.job_id, event.min_members, event.max_members, dict(event.slots), budget,
            replacement_budget=budget, sizes=list(event.sizes), admission=event.admission,
            high_water=event.reached if event.admission > 1 else 0, session=event.session)


def _history_mark(job: JobMembership) -> tuple[object, ...]:
    """What a stored history says, for telling whether it changed (a generation's
    resumed step can come after the next one is decided: each one's counts)."""
    last = job.history[-1] if job.history else None
    return (None if last is None else (last.generation, last.pause_s),
            tuple(g.applied_resume_step for g in job.history), job.replaced)
