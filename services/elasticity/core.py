"""Membership of running jobs as generations: the elasticity service's rules. Pure.

A running job's membership is a sequence of *generations*: an ordered member
list (rank = position), the world size, a fresh rendezvous namespace, the step
to resume at, and why it changed (start, fault, join). A job runs in *slots*
(admission's placement: slot ``i`` on ``nodes[i]``); the replica in a slot is
``r<slot>-<incarnation>``, so a replacement in the same slot is a new replica.

* **Admission.** :class:`JobAdmitted` carries admission's current placement
  each time a job record is seen (at start-up, on every change, after a
  reconnection): it is level-triggered, so seeing the same record twice
  changes nothing. A job is *managed* only from its first ready replica on:
  jobs that do not use the runtime never get generations or replacements.
* **A gang before that.** Until then the job's processes are a torchrun gang
  (the agents give them the gang's ``RANK``, ``WORLD_SIZE`` and rendezvous),
  unless its spec declares a ``session`` (:attr:`JobAdmitted.session`): a
  process that fails leaves the others waiting for it in their
  ``init_process_group`` or failing with it. So a failed replica restarts the
  whole gang, as torchrun restarts its workers: every slot gets its next
  incarnation, all alike (``r<s>-1`` in every slot, then ``r<s>-2`` …), launched
  as a gang (:attr:`LaunchReplacement.gang`: the agent stops what runs in the
  slot and gives the new process the gang's variables and a rendezvous port of
  that incarnation's own), and a failure or readiness of an earlier
  incarnation changes nothing. Health's restart budget decides how often:
  past it the job fails before its fault reaches here. A declared session's
  processes are worlds of their own: its faults are kept and applied when it
  becomes managed (the replica alone is replaced).
* **Early events.** A job's record and its events travel apart (a KV watch
  and a stream), so a replica's ready report (or a fault) can come before the
  admitted record: it is kept and applied when the record comes (within
  ``EARLY_TTL_S`` and bounds), else a replica ready before its record was
  seen held generation 0 back for ever. Events about a job that ended are old
  news until it is admitted again.
* **Start.** Admission's placement launches ``r<i>-0`` in every slot.
  Generation 0 is formed once every launched replica has reported *ready*
  (torch imported, model built) or failed, from the ready ones in slot order,
  if at least ``min``.
* **Placement changes.** A record with other slots than the managed job's:
  new slots get ``r<s>-0`` (admission grew the job). Slots gone get no more
  replacements, and replicas there that are not members are stopped at once.
  The members there *leave*, whatever the reason admission took the slots
  (preemption, reclaim, a pin, or a node lost: a shrink to an allowed size
  also gives back slots on healthy nodes, and a node judged lost may still
  run its ranks); as soon as no change is in flight, a ``leave`` generation
  without them is published. A leaver that cannot take part (its node is
  gone) is failed by health's node-lost fault, which health raises for it
  even after its slot was taken, and its fault supersedes the leave.
  Leavers are told by the leave generation, take part in the step in flight, and every
  member switches after the same step (the runtime's step boundary), the
  leavers then exiting 0. A leaver that exits any other way first (its agent
  stopped it after ``graceful_shutdown_timeout_s``) is a fault: as a member, it
  is dropped like a failed one; once the leave is published and not yet applied,
  the same members get a new (fault) generation, since the others may be stuck
  in a step with it. A fault before the leave is published drops the leavers
  with the failed.
* **Faults.** A failed member is dropped in the next generation if at least
  ``min`` members remain; survivors keep their relative order (and so, in
  order, their ranks). A failure *supersedes* a change still in flight: the
  members cannot finish building a process group with a dead peer, so the
  next generation is decided at once.
* **Replacements.** A failed replica's slot gets a new replica (unless its
  node is lost, or the job's ``max_replacements`` are used up: that many
  without the job committing a step beyond its high water between them, as
  health's restart guard counts; progress gives the budget back, so a long
  job that trains through faults is never starved of replacements) as soon as the
  survivors have applied the generation that dropped it (the runtime reports
  that after its first step in it), so its start-up (importing torch) does
  not compete with their recovery; at once if the job
  is below ``min`` (then nothing trains anyway). Meanwhile it is asked of a
  warm spare only (``warm_only``), which costs their recovery nothing. When no
  survivor holds the state, the next generation waits for every replacement
  launched (at most ``GATHER_S``): the tiers give the state back from each
  node's memory, and the first few ready may not see every shard. Below ``min`` the job
  *waits*: survivors keep their state in memory, and a job still short after
  ``wait_timeout_s`` is handed back to admission (requeued).
* **Joins.** A replica becomes a member only once it reports ready, so
  survivors never wait for a process to start; joiners are appended (highest
  ranks), in slot order, up to ``max`` and only as many as make an allowed
  size (the job's scaling rules, :attr:`JobAdmitted.sizes`): with sizes
  ``[2, 4]`` a third replica ready waits for the fourth.
* **One change at a time.** A generation is *in flight* until every member
  has applied it. Joins arriving meanwhile are folded into the next
  generation, decided the moment the current one completes. A warm spare's
  replacement is the exception: ready while the fault's generation is in
  flight, it joins at once, superseding it. The survivors then rebuild once
  more, now with it, instead of training a step short-handed and pausing for
  it a step later (the join then waited for their first step in the fault's
  generation, and they took it in only at the end of the step after: two
  steps between a spare being ready and its first step).
* **Given up.** Members that cannot form a generation (its rank 0's store timed
  out under load) give it up and wait for a newer one, none of them dead, so no
  fault would ever supersede it. A member that gives up the job's current
  generation while it is in flight says so (:class:`GenerationGivenUpSeen`), and
  it is decided again at once like a fault's (the same members, minus any that
  failed meanwhile, with joiners ready then; a fresh rendezvous namespace). Only
  a report of the current generation by one of its members counts, so repeated
  or late reports re-form it at most once.
* **Completion.** When a member exits 0 the training is over: replicas
  still starting or waiting to join are stopped, and nothing is launched or
  published for the job any more.
* **Resume step.** The highest step a surviving member reported committed,
  and never less than the highest any member ever reported (every member
  that applied a generation holds that far); the members agree on the exact
  value when they apply the generation (a report can lag behind a commit),
  members behind it copy state from a peer that has it, and if none has it
  they refuse the generation instead of training again from scratch.
* **History.** Every generation decided is kept in the job's history (the
  latest ``HISTORY_LIMIT``) with when it was decided, the resume step this
  core estimated then, the step its members actually resumed after (the
  first ``GenerationAppliedSeen.resume_step`` reported, a member of a superseded
  generation's included), and the pause it cost the survivors: the longest
  any member reported applying it (``GenerationAppliedSeen.pause_s``). The shell stores what
  :meth:`ElasticityCore.take_histories` returns (each job whose history, or
  count of replacements launched, changed) where users read it
  (``phalanx job``).

Events carry the ``event_id`` of what caused them; decisions carry it as
``cause``. ``now`` is passed in; the core reads no clock and does no I/O.

**Restarts.** :func:`snapshot` encodes one job's whole state and
:meth:`ElasticityCore.restore` takes it back: a core restored from the
snapshots taken after event *k* and fed events *k+1…* decides exactly what a
core that never stopped decides (property-tested). The service stores a job's
snapshot after acting on each of its events, with the stream position of that
event, so a new leader reads on from there and loses nothing.
"""

from __future__ import annotations

import dataclasses

import msgspec

from phalanx.schemas.errors import StoredStateError
from phalanx.schemas.messages import (
    CAUSE_CHARS,
    HISTORY_LIMIT,
    Generation,
    GenerationReason,
    GenerationRecord,
    JobHistory,
    Member,
    StateSource,
)
from phalanx.schemas.replicas import another_admission, incarnation, replica_id
from phalanx.services.elasticity.history import within_budget

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
    """A member could not form ``generation`` (its rendezvous failed) and waits for a newer
    one; ``reason`` is what the rendezvous failed with."""

    job_id: str
    generation: int
    replica_id: str
    reason: str = ""
    event_id: str = ""
    admission: int = 0  # the job's admission the member was started for (0: not known)


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

# --- state ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Replica:
    replica_id: str
    slot: int
    node_id: str
    endpoint: str = ""


#: How long events about a job not admitted yet (or ended) are kept, and how many at most.
EARLY_TTL_S = 120.0
#: How long a job whose state no survivor holds waits for every replacement launched.
GATHER_S = 30.0
EARLY_PER_JOB = 256
EARLY_JOBS = 1024


@dataclasses.dataclass
class JobMembership:
    job_id: str
    min_members: int
    max_members: int
    slots: dict[int, str]  # slot -> node
    replacements_left: int
    admission: int = 0  # which admission of the job this membership is (0: not known)
    current: Generation | None = None  # None until generation 0 forms
    replacement_budget: int | None = None  # replacements_left again after progress
    replicas: dict[str, Replica] = dataclasses.field(default_factory=dict)  # members + ready
    launched: dict[str, int] = dataclasses.field(default_factory=dict)  # not yet ready: slot
    forming: set[str] = dataclasses.field(default_factory=set)  # generation 0 waits for these
    incarnation: dict[int, int] = dataclasses.field(default_factory=dict)  # slot -> latest
    applied: set[str] = dataclasses.field(default_factory=set)  # members done with current
    committed: dict[str, int] = dataclasses.field(default_factory=dict)  # replica -> step
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # folded: replica -> why
    ready: list[str] = dataclasses.field(default_factory=list)  # folded joiners, in order
    waiting_since: float | None = None  # below min since
    complete: bool = False  # a member finished the training
    to_launch: list[LaunchReplacement] = dataclasses.field(default_factory=list)
    high_water: int = 0  # the highest step any member ever reported committed
    managed: bool = False  # a replica reported ready: the job uses the runtime
    early_faults: list[MemberFailed] = dataclasses.field(default_factory=list)  # before that
    leaving: list[str] = dataclasses.field(default_factory=list)  # members whose slot is gone
    departing: list[str] = dataclasses.field(default_factory=list)  # left in current, unapplied
    sizes: list[int] = dataclasses.field(default_factory=list)  # allowed sizes (empty: all)
    history: list[GenerationRecord] = dataclasses.field(default_factory=list)  # latest last
    # Ready replacements that came from a warm spare: they join without waiting for the
    # change in flight (only a spare can be ready while one is: cold launches wait).
    warm_ready: list[str] = dataclasses.field(default_factory=list)
    gather_since: float | None = None  # no survivor holds the state: replacements awaited
    replaced: int = 0  # replacements launched
    # Why a member gave the current generation up ("": none did); it is decided again.
    given_up: str = ""
    session: bool = False  # the spec declares a session: never a torchrun gang
    gang_round: int = 0  # not managed yet: the incarnation the gang runs in every slot

    @property
    def members(self) -> list[str]:
        return [] if self.current is None else [m.replica_id for m in self.current.members]

    @property
    def in_flight(self) -> bool:
        return not set(self.members) <= self.applied


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
        """The histories of the jobs whose history changed since the last call, to store."""
        changed, self._histories = self._histories, {}
        return [JobHistory(job_id=job.job_id, generations=list(job.history),
                           replacements=job.replaced, updated_at=at)
                for job_id, at in changed.items() if (job := self.jobs.get(job_id))]

    def handle(self, event: Event, now: float) -> list[Decision]:
        """Apply one event.

        Raises:
            TypeError: not one of this module's events.
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
        if job.complete:
            return []
        if not job.managed:
            return self._unmanaged(job, event, now)
        told = _history_mark(job)
        decisions = self._managed(job, event, now)
        if _history_mark(job) != told:
            self._histories[job.job_id] = now
        return decisions

    def _managed(self, job: JobMembership, event: Event, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        match event:
            case MemberFinished():
                return self._finished(job, event)
            case JobAdmitted():
                if event.slots == job.slots:
                    return []  # the same record seen again
                # Grown: admission never reuses a slot number within an admission, so a
                # number seen before is not a new slot (nothing is launched for it).
                for slot in sorted(set(event.slots) - set(job.incarnation)):
                    job.launched[replica_id(slot, 0)] = slot
                    job.incarnation[slot] = 0
                decisions += self._slots_taken(job, set(job.slots) - set(event.slots),
                                               event.event_id)
                job.slots = dict(event.slots)
            case ReplicaExited():
                decisions += self._left_uncleanly(job, event, now)
            case MemberFailed() if event.replica_id in job.departing:
                why = f"{event.replica_id} failed while leaving ({_brief(event.detail)})"
                decisions += self._leaver_failed(job, why, event.event_id, now)
            case MemberFailed():
                decisions += self._failed(job, event)
            case ReplicaReadySeen():
                self._ready(job, event)
            case GenerationGivenUpSeen():
                self._given_up(job, event)
            case GenerationAppliedSeen():
                _record_resumed(job, event)
                if job.current is not None and event.generation == job.current.generation \
                        and event.replica_id in job.members:
                    job.applied.add(event.replica_id)
                    job.committed[event.replica_id] = max(
                        event.committed_step, job.committed.get(event.replica_id, 0))
                    if event.committed_step > job.high_water:
                        job.high_water = event.committed_step
                        if job.replacement_budget is not None:
                            job.replacements_left = job.replacement_budget
                    if not job.in_flight:
                        job.departing.clear()  # the leave is done: the leavers are gone
                        job.given_up = ""  # formed after all: nothing to decide again
                    last = job.history[-1] if job.history else None
                    if event.pause_s is not None and last is not None \
                            and last.generation == event.generation \
                            and (last.pause_s is None or event.pause_s > last.pause_s):
                        job.history[-1] = msgspec.structs.replace(last, pause_s=event.pause_s)
        decisions += self._advance(job, now, event.event_id)
        return decisions + _launches(job)

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
                decisions += self._advance(job, now, "gather-timeout") + _launches(job)
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
        try:
            job = _SNAPSHOT_DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise StoredStateError(f"not an elasticity job snapshot: {exc}") from None
        self.jobs[job.job_id] = job
        return job.job_id

    # --- rules ----------------------------------------------------------------------------

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
        self.jobs[event.job_id] = JobMembership(event.job_id, event.min_members,
                                                event.max_members, dict(event.slots),
                                                budget, replacement_budget=budget,
                                                sizes=list(event.sizes),
                                                admission=event.admission,
                                                high_water=event.reached
                                                if event.admission > 1 else 0,
                                                session=event.session)

    def _unmanaged(self, job: JobMembership, event: Event, now: float) -> list[Decision]:
        """Before the first ready replica: follow the placement; a gang restarts whole, a
        declared session's faults are kept for later."""
        match event:
            case JobAdmitted():
                if event.slots != job.slots:
                    # Re-placed: the agents start the gang again, r<s>-0 in the new world.
                    job.slots, job.gang_round, job.launched = dict(event.slots), 0, {}
            case MemberFailed() if job.session:
                job.early_faults.append(event)
            case MemberFailed():
                return _restart_gang(job, event)
            case ReplicaReadySeen() if incarnation(event.replica_id) == job.gang_round:
                job.managed = True  # the job uses the runtime: the gang's replicas expected
                for slot in sorted(job.slots):
                    job.launched[replica_id(slot, job.gang_round)] = slot
                    job.incarnation[slot] = job.gang_round
                job.forming = set(job.launched)
                early, job.early_faults = job.early_faults, []
                decisions: list[Decision] = []
                for fault in early:
                    decisions += self.handle(fault, now)
                return decisions + self.handle(event, now)
        return []

    def _failed(self, job: JobMembership, event: MemberFailed) -> list[Decision]:
        replica = event.replica_id
        job.forming.discard(replica)
        if replica in job.members:
            if replica in job.failed:
                return []
            job.failed[replica] = _brief(event.detail)
            job.applied.discard(replica)
            slot = job.replicas[replica].slot
        elif replica in job.launched:
            slot = job.launched.pop(replica)
        elif replica in job.replicas:  # ready, not yet a member
            slot = job.replicas.pop(replica).slot
            job.ready.remove(replica)
        else:
            return []  # an old incarnation, or never ours
        if not event.replaceable or job.replacements_left == 0 or slot not in job.slots \
                or job.incarnation.get(slot, 0) != slot_of(replica)[1]:
            return []
        job.replacements_left -= 1
        job.replaced += 1
        job.incarnation[slot] += 1
        new = replica_id(slot, job.incarnation[slot])
        job.launched[new] = slot
        job.to_launch.append(LaunchReplacement(job.job_id, slot, job.slots[slot], new,
                                               event.event_id))
        return []

    def _slots_taken(self, job: JobMembership, slots: set[int], cause: str) -> list[Decision]:
        """Admission took ``slots``: their members leave; replicas there that are not
        members are stopped now."""
        stops: list[Decision] = []
        for replica in [r for r in job.members if job.replicas[r].slot in slots]:
            if replica not in job.failed and replica not in job.leaving:
                job.leaving.append(replica)
        for replica in [r for r in job.ready if job.replicas[r].slot in slots]:
            job.ready.remove(replica)
            slot = job.replicas.pop(replica).slot
            stops.append(RetireReplica(job.job_id, slot, job.slots[slot], replica, cause))
        for replica, slot in [(r, s) for r, s in job.launched.items() if s in slots]:
            del job.launched[replica]
            job.forming.discard(replica)
            stops.append(RetireReplica(job.job_id, slot, job.slots[slot], replica, cause))
        job.to_launch = [d for d in job.to_launch if d.slot not in slots]
        return stops

    def _left_uncleanly(self, job: JobMembership,
                        event: ReplicaExited, now: float) -> list[Decision]:
        """A leaver that did not leave by the step boundary: handled as a fault."""
        replica = event.replica_id
        why = f"{replica} did not leave cleanly ({_brief(event.detail, 'stopped')})"
        if replica in job.leaving:
            job.leaving.remove(replica)
            if replica not in job.failed:
                job.failed[replica] = why
                job.applied.discard(replica)
            return []
        if replica in job.departing:
            return self._leaver_failed(job, why, event.event_id, now)
        return []

    def _leaver_failed(self, job: JobMembership, why: str, cause: str,
                       now: float) -> list[Decision]:
        """A member of the previous generation that a leave dropped failed (stopped after
        overstaying, or its node lost) while the leave is in flight: the others may be
        blocked in a step with it, so the same members start over."""
        if not job.in_flight:
            return []  # the leave is done: it is gone already
        job.departing.clear()
        job.failed.clear()
        return self._next(job, job.members, [], GenerationReason.FAULT, why, cause, now)

    def _finished(self, job: JobMembership, event: MemberFinished) -> list[Decision]:
        if event.replica_id not in job.members:
            return []
        job.complete = True
        # Never asked for: nothing to stop (one asked of a spare may run).
        unlaunched = {d.replica_id for d in job.to_launch if not d.warm_only}
        # A member of the generation in flight that never trained (a joiner taken in as
        # the training ended) cannot form it without the member that finished, nor end
        # by itself: it would wait for a newer generation, and its job for it, for ever.
        joined = {r: job.replicas[r].slot for r in job.members
                  if r not in job.committed and r != event.replica_id and r in job.replicas}
        waiting = {r: job.replicas[r].slot for r in job.ready} | joined | {
            r: slot for r, slot in job.launched.items() if r not in unlaunched}
        job.ready.clear()
        job.launched.clear()
        job.forming.clear()
        job.to_launch.clear()
        job.waiting_since = None
        return [RetireReplica(job.job_id, slot, job.slots[slot], replica, event.event_id)
                for replica, slot in sorted(waiting.items()) if slot in job.slots]

    @staticmethod
    def _given_up(job: JobMembership, event: GenerationGivenUpSeen) -> None:
        """A member gave up forming the generation in flight: it is decided again (in
        :meth:`_advance`). A report of an older generation (decided again already, or
        superseded) or by a replica that is not a member changes nothing."""
        if job.current is None or event.generation != job.current.generation \
                or event.replica_id not in job.members or not job.in_flight \
                or job.given_up:
            return
        job.given_up = f"{event.replica_id} gave up generation {event.generation} " \
            f"({_brief(event.reason, 'rendezvous failed')})"

    def _ready(self, job: JobMembership, event: ReplicaReadySeen) -> None:
        replica = event.replica_id
        if replica in job.members or replica in job.replicas:
            return  # repeated
        if job.launched.get(replica) != event.slot:
            return  # superseded by a newer incarnation, or unknown
        del job.launched[replica]
        job.forming.discard(replica)
        job.replicas[replica] = Replica(replica, event.slot, event.node_id, event.endpoint)
        job.ready.append(replica)
        if any(d.replica_id == replica and d.warm_only for d in job.to_launch):
            job.warm_ready.append(replica)

    def _advance(self, job: JobMembership, now: float, cause: str) -> list[Decision]:
        """Decide the next generation if one is due."""
        if job.current is None:
            if job.forming or len(job.ready) < job.min_members:
                return self._wait(job, now, len(job.ready))
            joiners = _allowed(job, 0, sorted(job.ready, key=lambda r: job.replicas[r].slot))
            return self._next(job, [], joiners, GenerationReason.START, "admitted", cause,
                              now)
        survivors = [r for r in job.members if r not in job.failed and r not in job.leaving]
        job.warm_ready = [r for r in job.warm_ready if r in job.ready]
        # A fault, or members that gave the generation in flight up: it cannot complete,
        # so the next one is decided now.
        restart = bool(job.failed) or bool(job.given_up)
        if job.in_flight and not restart and not job.warm_ready:
            return []  # joins and leaves wait for the change in flight (but a spare's)
        if job.leaving and not restart and len(survivors) >= job.min_members:
            left, job.departing, job.leaving = list(job.leaving), list(job.leaving), []
            for replica in left:
                job.committed.pop(replica, None)
                job.replicas.pop(replica, None)
            return self._next(job, survivors, [], GenerationReason.LEAVE,
                              "left: " + _listing(left), cause, now)
        if not restart and not job.ready:
            return []
        joiners = _allowed(job, len(survivors), job.ready)
        if len(survivors) + len(joiners) < job.min_members:
            return self._wait(job, now, len(survivors) + len(joiners))
        if not restart and not joiners:
            return []  # at max: ready replicas wait for room
        if self._gathering(job, survivors, now):
            return []
        if restart:
            reasons = [job.given_up] if job.given_up else []
            if job.failed:
                reasons.append("dropped " + _listing([f"{r} ({d})"
                                                      for r, d in sorted(job.failed.items())]))
            why = "; ".join(reasons)
            if job.leaving:  # a fault starts over anyway: the leavers go with it
                why += "; left " + _listing(job.leaving)
                for replica in job.leaving:
                    job.committed.pop(replica, None)
                    job.replicas.pop(replica, None)
                job.leaving.clear()
            if joiners:
                why += "; joined " + _listing(joiners)
            return self._next(job, survivors, joiners, GenerationReason.FAULT, why, cause,
                              now)
        return self._next(job, survivors, joiners, GenerationReason.JOIN,
                          "joined " + _listing(joiners), cause, now)

    @staticmethod
    def _gathering(job: JobMembership, survivors: list[str], now: float) -> bool:
        """Whether the next generation waits for more replacements.

        When no survivor holds the job's state (every member died, or those left are
        replacements that never applied a generation), it comes back from the checkpoint
        tiers, each node's memory holding its own ranks' shards: a generation of the first
        replacements ready might see only some nodes' shards and start over while the
        others hold the step. So it waits until every replacement launched is ready, at
        most GATHER_S (one whose node died must not hold the job for ever).
        """
        if job.high_water == 0 or not job.launched \
                or any(r in job.committed for r in survivors):
            job.gather_since = None
            return False
        if job.gather_since is None:
            job.gather_since = now
        return now - job.gather_since < GATHER_S

    def _wait(self, job: JobMembership, now: float, have: int) -> list[Decision]:
        """Below ``min``: survivors keep their state; the timeout starts."""
        if have < job.min_members and job.waiting_since is None and not job.forming:
            job.waiting_since = now
        return []

    def _next(self, job: JobMembership, survivors: list[str], joiners: list[str],
              reason: GenerationReason, why: str, cause: str,
              now: float) -> list[Decision]:
        for replica in job.failed:
            job.committed.pop(replica, None)
            job.replicas.pop(replica, None)
        for replica in joiners:
            job.ready.remove(replica)
        job.warm_ready = [r for r in job.warm_ready if r in job.ready]
        # Every member that applied a generation holds at least the high-water mark, so a
        # generation whose members cannot provide it has lost the job's state: the runtime
        # refuses it rather than train from scratch (the checkpoint tier's case).
        resume = max([job.committed.get(r, 0) for r in survivors] + [job.high_water])
        number = 0 if job.current is None else job.current.generation + 1
        members = [job.replicas[r] for r in survivors + joiners]
        why = _clip(why, CAUSE_CHARS)
        job.current = Generation(
            job_id=job.job_id, generation=number,
            members=[Member(replica_id=r.replica_id, rank=i, node_id=r.node_id,
                            endpoint=r.endpoint) for i, r in enumerate(members)],
            world_size=len(members), rendezvous=f"{job.job_id}-g{number}", resume_step=resume,
            reason=reason, cause=why)
        job.history = within_budget([*job.history[-(HISTORY_LIMIT - 1):], GenerationRecord(
            generation=number, reason=reason, world_size=len(members),
            members=[r.replica_id for r in members], resume_step=resume, decided_at=now,
            cause=why)])
        job.failed.clear()
        job.applied.clear()
        job.given_up = ""
        job.waiting_since = job.gather_since = None
        return [PublishGeneration(job.current, cause)]

    def check_invariants(self) -> None:
        for job in self.jobs.values():
            members = job.members
            assert len(set(members)) == len(members), "a replica is a member twice"
            assert not set(job.ready) & set(members), "a member is also waiting to join"
            assert not set(job.launched) & set(job.replicas), "launched and ready at once"
            assert job.complete or set(job.ready) | set(members) == set(job.replicas), \
                "replica bookkeeping"
            assert len(members) <= job.max_members, "above max"
            assert set(job.leaving) <= set(members), "a leaver that is not a member"
            assert not set(job.departing) & set(members), "a departed replica is a member"
            assert not job.given_up or job.in_flight, "a formed generation waits to be re-formed"
            live = [r for r in members if r not in job.failed] + job.ready
            slots = [job.replicas[r].slot for r in live] + list(job.launched.values())
            assert len(slots) == len(set(slots)), "two replicas in one slot"
            if job.current is not None:
                assert job.current.world_size == len(members)
                assert len(members) >= job.min_members or job.current.generation == 0, \
                    "a generation below min"


#: The most of one replica's failure a generation's cause quotes (its first line), and of
#: each list in it (replicas dropped, left, joined) before "and N more". A generation
#: goes to every member and its cause into the history: a node's eight ranks failing
#: with their last output each must not make either too big to send or store.
WHY_CHARS = 200
LIST_CHARS = 400


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def _brief(detail: str, default: str = "failed") -> str:
    """A replica's failure as a cause quotes it: its first non-empty line, clipped."""
    first = next((line.strip() for line in detail.splitlines() if line.strip()), default)
    return _clip(first, WHY_CHARS)


def _listing(items: list[str]) -> str:
    """``items`` comma-separated within about ``LIST_CHARS`` ("..., and N more")."""
    shown: list[str] = []
    used = 0
    for item in items:
        if shown and used + len(item) > LIST_CHARS:
            return ", ".join(shown) + f" and {len(items) - len(shown)} more"
        shown.append(item)
        used += len(item) + 2
    return ", ".join(shown)



def _restart_gang(job: JobMembership, failed: MemberFailed) -> list[Decision]:
    """A replica of the job's current torchrun gang failed before any was ready: every
    slot's next incarnation, launched as a gang. A fault of an earlier incarnation (a
    member of the gang already restarted, failing with it) or of a node that is gone
    (admission re-places the job) restarts nothing."""
    if not failed.replaceable or incarnation(failed.replica_id) != job.gang_round \
            or slot_of(failed.replica_id)[0] not in job.slots:
        return []
    job.gang_round += 1
    job.launched = {replica_id(s, job.gang_round): s for s in job.slots}
    job.replaced += len(job.slots)
    return [LaunchReplacement(job.job_id, s, node, replica_id(s, job.gang_round),
                              failed.event_id, gang=True)
            for s, node in sorted(job.slots.items())]


def _launches(job: JobMembership) -> list[Decision]:
    """The replacements to ask for now.

    A cold start (Python, torch, the script's model build) would take the CPU from the
    survivors' repair, so it waits until they have applied the change in flight. A warm
    spare costs that repair nothing: while the change is in flight each replacement is
    asked for once from a spare (``warm_only``), and asked for again, cold, after it.
    The agent starts a replica id at most once, so whichever comes second is a no-op;
    one that became ready or was superseded meanwhile is not asked for again.
    """
    job.to_launch = [d for d in job.to_launch if job.launched.get(d.replica_id) == d.slot]
    if job.current is None or not job.in_flight or job.waiting_since is not None \
            or job.gather_since is not None:
        launches: list[Decision] = [dataclasses.replace(d, warm_only=False)
                                    for d in job.to_launch]
        job.to_launch = []
        return launches
    warm = [dataclasses.replace(d, warm_only=True) for d in job.to_launch if not d.warm_only]
    job.to_launch = [d for d in job.to_launch if d.warm_only] + warm
    return list(warm)


def snapshot(job: JobMembership) -> bytes:
    """One job's whole state, for :meth:`ElasticityCore.restore`."""
    return _SNAPSHOT_ENCODER.encode(job)


_SNAPSHOT_ENCODER = msgspec.msgpack.Encoder()
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(JobMembership)


def _history_mark(job: JobMembership) -> tuple[object, ...]:
    """What a stored history says, for telling whether it changed (a generation's
    resumed step can come after the next one is decided: each one's counts)."""
    last = job.history[-1] if job.history else None
    return (None if last is None else (last.generation, last.pause_s),
            tuple(g.applied_resume_step for g in job.history), job.replaced)


def _record_resumed(job: JobMembership, event: GenerationAppliedSeen) -> None:
    """Keep in the history the step the members of ``event``'s generation resumed after,
    from the first report of it (they all agreed on it when they applied it)."""
    if event.resume_step is None:
        return
    for i in range(len(job.history) - 1, -1, -1):
        record = job.history[i]
        if record.generation == event.generation:
            if record.applied_resume_step is None:
                job.history[i] = msgspec.structs.replace(
                    record, applied_resume_step=event.resume_step,
                    restored_from=event.restored_from)
            return
        if record.generation < event.generation:
            return


def _allowed(job: JobMembership, members: int, ready: list[str]) -> list[str]:
    """The first of ``ready`` that join ``members`` members: up to ``max``, and as many as
    reach the largest allowed size (none if no allowed size above ``members`` is reached)."""
    reach = min(job.max_members, members + len(ready))
    if job.sizes:
        fits = [size for size in job.sizes if members < size <= reach]
        reach = fits[-1] if fits else members
    return ready[:max(0, reach - members)]


def slot_of(replica: str) -> tuple[int, int]:
    """``r<slot>-<incarnation>`` -> (slot, incarnation)."""
    slot, _, incarnation = replica.removeprefix("r").partition("-")
    return int(slot), int(incarnation)
