"""The elasticity service's shell: faults and readiness in, generations and replacements out.

Any number of instances run; the one holding the ``elasticity`` lease
(:mod:`phalanx.services.lease`) acts, the others stand by and take over within
the lease bound. The leader feeds the pure :class:`~.core.ElasticityCore` from

* job records, followed through the jobs bucket (every current record at the
  start of a term and again after each reconnection, then every change): an
  admitted record is admission's current placement, anything else ends the job;
* the job-events stream (:mod:`phalanx.bus.stream`): faults from health,
  ``ready``, ``applied`` and ``given_up`` (a member could not form the newest
  generation) from the runtime in every rank, and rank exits from agents (a
  member that exits 0 completes the training);

and carries out its decisions: a generation is stored in the
``phalanx_generations`` bucket (so a late or restarted rank reads the current
one) and then published on ``phalanx.job.<job>.generation``; a replacement is
a :class:`LaunchReplica` request to the agent that holds the slot, and a
replica no longer needed a :class:`StopReplica`; a job below its minimum for
too long is handed back to admission. The job's history (every generation,
the pause each cost, the replacements launched) is stored in the
``phalanx_history`` bucket, where ``phalanx job`` reads it, and kept after
the job ends.

**Nothing is missed across a restart or a handover.** After acting on an event,
the leader stores the job's whole state (:func:`~.core.snapshot`) with the
event's stream sequence in the ``phalanx_elasticity`` bucket (a job of more than
:data:`DEFER_ABOVE` replicas at most every :data:`SAVE_EVERY_S`, and always before
the cursor passes its events: its state takes 0.1 s to encode at 16,384 replicas,
and its start brings one event per replica), compare-and-swapped
on the revision it last wrote (a deposed leader cannot overwrite its
successor's state), and every second the stream position up to which
everything is stored. A new leader restores every job, reads the stream on
from that position (skipping, per job, what its snapshot already reflects),
and re-asserts what the last decisions of its predecessor may not have
carried out: it publishes each job's current generation again (ranks ignore
one they have) and asks agents again for replicas still expected to start
(agents launch a replica id at most once). So every event is acted on at
least once, and acting twice is harmless.

Each generation is published inside the span of the fault or report that
caused it, so a recovery is one trace from the agent that saw the exit to
every rank's phases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from phalanx.bus import telemetry
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import NoResponders, RequestTimeout
from phalanx.bus.kv import Change
from phalanx.bus.stream import StreamEvent
from phalanx.schemas import subjects
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import (
    Fault,
    Generation,
    GenerationApplied,
    GenerationGivenUp,
    JobHistory,
    JobProgress,
    JobRecord,
    JobSnapshot,
    JobState,
    LaunchReplica,
    RankExited,
    ReplicaReady,
    ReplicaReply,
    RequeueRequest,
    StopReplica,
)
from phalanx.schemas.replicas import another_admission
from phalanx.schemas.scaling import ScalingRules
from phalanx.services import metrics
from phalanx.services.elasticity import core
from phalanx.services.elasticity.history import carried
from phalanx.services.jobstate import FencedKeys
from phalanx.services.leader import JobEventsLeader, JobTerm

log = logging.getLogger("phalanx.elasticity")
AGENT_TIMEOUT_S = 10.0
#: The first and the longest pause before a launch request that got no answer is repeated.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
LEASE_KEY = "elasticity"
SNAPSHOT_FORMAT = 1
CURSOR_EVERY_S = 1.0
#: A job of more replicas than this has its state stored at most every
#: :data:`SAVE_EVERY_S` rather than after each event (events since are read again by a
#: successor: the cursor never passes an event whose job's state is not stored).
DEFER_ABOVE = 1024
SAVE_EVERY_S = 0.25


@dataclasses.dataclass
class ElasticityTerm(JobTerm[core.ElasticityCore]):
    """A term of elasticity: its core and job state, and the generation records it
    writes (fenced: a deposed leader's held-back write is refused by revision)."""

    generations: FencedKeys[Generation] | None = None
    unsaved: set[str] = dataclasses.field(default_factory=set)  # large jobs acted on since
    # their state was last stored


class ElasticityService(JobEventsLeader[ElasticityTerm]):
    """Owns the membership of every running job as a sequence of generations.

    Args:
        make_core: builds a fresh core for each term of leadership.
        lease_s: how long the lease lasts without renewal (the takeover bound).
    """

    description = "phalanx membership of running jobs"
    service_name = "phalanx-elasticity"
    lease_key = LEASE_KEY
    metric_families = metrics.LEADERSHIP + metrics.ELASTICITY
    event_kinds = frozenset({"fault", "ready", "applied", "given_up", "exited"})

    def __init__(self, make_core: Callable[[], core.ElasticityCore],
                 bus_config: BusConfig | None = None, *, instance: str | None = None,
                 lease_s: float = 3.0) -> None:
        super().__init__(bus_config, instance=instance, lease_s=lease_s)
        self.make_core = make_core

    async def setup(self) -> None:
        self.generations = await self.bucket(subjects.GENERATIONS_BUCKET, Generation)
        self.histories = await self.bucket(subjects.HISTORY_BUCKET, JobHistory)
        self.progress = await self.bucket(subjects.PROGRESS_BUCKET, JobProgress)
        await self.open_job_state(subjects.ELASTICITY_BUCKET)

    # --- a term of leadership -----------------------------------------------------------

    def begin_term(self) -> ElasticityTerm:
        return ElasticityTerm(self.make_core(), *self.job_state(),
                              generations=FencedKeys(self.generations, LEASE_KEY))

    def restore_job(self, term: ElasticityTerm, state: bytes, now: float) -> str:
        return term.core.restore(state)

    async def caught_up(self, term: ElasticityTerm) -> None:
        await self._reassert(term)

    def term_loops(self, term: ElasticityTerm) -> list[Coroutine[Any, Any, None]]:
        return [self._waits(term), self._saves(term)]

    async def _reassert(self, term: ElasticityTerm) -> None:
        """Carry out again what the previous leader's last decisions may not have done."""
        assert self.bus is not None
        for job in list(term.core.jobs.values()):
            if job.complete:
                continue
            if job.current is not None:
                await self._publish(term, job.current)
            for replica, slot in sorted(job.launched.items()):
                if slot in job.slots and core.slot_of(replica)[1] > 0:
                    self._send(core.LaunchReplacement(job.job_id, slot, job.slots[slot],
                                                      replica, "takeover"))

    async def on_event(self, term: ElasticityTerm, event: StreamEvent) -> None:
        translated = _event(event)
        if translated is None:
            return
        if isinstance(event.message, GenerationApplied):
            _observe_applied(term.core, event.message)  # before it moves on
        elif isinstance(event.message, GenerationGivenUp):
            log.info("generation given up", extra={
                "job": event.message.job_id, "generation": event.message.generation,
                "replica": event.message.replica_id, "reason": event.message.reason,
                "unreachable": event.message.unreachable})
        await self._act(term, translated.job_id, term.core.handle(translated, time.time()),
                        event.seq)

    async def _waits(self, term: ElasticityTerm) -> None:
        """Requeue jobs left below their minimum for too long; store the cursor."""
        while not await self.sleep_or_stop(CURSOR_EVERY_S):
            async with term.turn:
                for decision in term.core.tick(time.time()):
                    assert isinstance(decision, core.Requeue)
                    await self._requeue(decision)
                    term.unsaved.discard(decision.job_id)
                    await term.store.forget(decision.job_id)
                if term.reader is not None:
                    await self._save_all(term)  # every event up to the cursor is stored
                    await term.store.advance(term.reader.delivered)

    async def _saves(self, term: ElasticityTerm) -> None:
        """Store the state of the large jobs acted on since it was last stored."""
        while not await self.sleep_or_stop(SAVE_EVERY_S):
            async with term.turn:
                await self._save_all(term)

    async def _save_all(self, term: ElasticityTerm) -> None:
        for job_id in sorted(term.unsaved):
            await self._save(term, job_id)

    async def _save(self, term: ElasticityTerm, job_id: str) -> None:
        """Store ``job_id``'s state as of the last event it reflects."""
        term.unsaved.discard(job_id)
        job = term.core.jobs.get(job_id)
        if job is not None:
            await term.store.store(job_id, JobSnapshot(
                job_id=job_id, seq=term.store.seq(job_id), format=SNAPSHOT_FORMAT,
                state=core.snapshot(job)))

    # --- events in ----------------------------------------------------------------------

    async def on_record(self, term: ElasticityTerm, change: Change[JobRecord]) -> None:
        record = change.value
        job_id = change.key
        if record is not None and record.state is JobState.ADMITTED:
            replicas = record.spec.replicas
            running = term.core.jobs.get(job_id)
            # Admitted again, a new membership starts where the earlier admissions left
            # the job (read once, when it starts: a record is seen at every change).
            starts = record.admission > 1 and (
                running is None or another_admission(running.admission, record.admission))
            event: core.Event = core.JobAdmitted(
                job_id, record.placement(), replicas.min, replicas.max, event_id="record",
                max_replacements=record.spec.restart_policy.max_restarts,
                sizes=ScalingRules.of(record.spec).sizes, admission=record.admission,
                reached=await self._reached(job_id) if starts else 0,
                session=record.spec.session)
            await self._act(term, job_id, term.core.handle(event, time.time()), None)
            return
        # Told even of a job it never ran: a leader that took over while the job was
        # requeued must not keep its earlier admission's events for the next one.
        known = job_id in term.core.jobs
        term.core.handle(core.JobStopped(job_id, event_id="record"), time.time())
        if known:
            term.unsaved.discard(job_id)
            await term.store.forget(job_id)
            metrics.forget_job(job_id, metrics.JOB_WORLD_SIZE, metrics.JOB_GENERATION)
        assert term.generations is not None
        term.generations.forget(job_id)
        with contextlib.suppress(PhalanxError):
            await self.generations.delete(job_id)

    async def _reached(self, job_id: str) -> int:
        """The most steps the job committed over its admissions, as health stored it (0:
        not known; a read that fails is logged)."""
        try:
            stored = await self.progress.get(job_id)
        except (PhalanxError, TimeoutError, OSError) as exc:
            log.warning("the step job %s had reached is not known: %s", job_id, exc)
            return 0
        reached = 0 if stored is None else stored.value.reached_step()
        log.info("admitted again", extra={"job": job_id, "reached": reached})
        return reached

    async def _act(self, term: ElasticityTerm, job_id: str, decisions: list[core.Decision],
                   seq: int | None) -> None:
        """Carry out ``decisions``, then store the job's state as of event ``seq``."""
        await self._execute(term, decisions)
        for history in term.core.take_histories():
            stored = await self.histories.get(history.job_id)
            await self.histories.put(history.job_id, carried(
                None if stored is None else stored.value, history))
        term.store.reflects(job_id, seq)
        job = term.core.jobs.get(job_id)
        if job is not None:
            if len(job.slots) > DEFER_ABOVE:
                term.unsaved.add(job_id)
            else:
                await self._save(term, job_id)

    # --- decisions out ------------------------------------------------------------------

    async def _execute(self, term: ElasticityTerm, decisions: list[core.Decision]) -> None:
        for decision in decisions:
            match decision:
                case core.PublishGeneration(generation=g):
                    with telemetry.tracer().start_as_current_span(
                            f"generation {g.generation}", attributes={
                                "phalanx.job": g.job_id, "phalanx.generation": g.generation,
                                "phalanx.world_size": g.world_size,
                                "phalanx.reason": g.reason.value}):
                        await self._publish(term, g)
                    metrics.GENERATIONS.labels(g.reason.value).inc()
                    metrics.JOB_WORLD_SIZE.labels(g.job_id).set(g.world_size)
                    metrics.JOB_GENERATION.labels(g.job_id).set(g.generation)
                    log.info("generation", extra={"job": g.job_id, "generation": g.generation,
                                                  "world_size": g.world_size,
                                                  "reason": g.reason.value, "cause": g.cause})
                case core.LaunchReplacement() | core.RetireReplica():
                    self._send(decision)
                case core.Requeue():
                    await self._requeue(decision)
                case _:
                    raise TypeError(f"unknown decision {decision!r}")

    async def _publish(self, term: ElasticityTerm, generation: Generation) -> None:
        """Store the generation (fenced on this term's revision of the job's record),
        then publish it: itself, or, past one payload, the pointer to its chunks under
        which it was stored (:mod:`phalanx.bus.spill`)."""
        assert self.bus is not None and term.generations is not None
        await term.generations.put(generation.job_id, generation)
        await self.bus.publish(subjects.job_generation(generation.job_id),
                               term.generations.bucket.pointer(generation.job_id) or generation)

    def _send(self, decision: core.LaunchReplacement | core.RetireReplica) -> None:
        self.spawn(self._to_agent(decision), f"agent {decision.replica_id}")

    async def _to_agent(self, decision: core.LaunchReplacement | core.RetireReplica) -> None:
        """Ask the slot's agent to start (or stop) a replica; a failure is logged.

        A launch that gets no answer (no agent listens yet: the cluster is restarting; or
        it is too busy to answer) is asked again, backing off up to
        :data:`RETRY_MAX_S`, for as long as this instance leads and its core still waits
        for the replica (:meth:`~.core.ElasticityCore.awaits`); the agent's answer,
        whatever it is, ends it (a repeated launch starts nothing twice).
        """
        assert self.bus is not None
        request: LaunchReplica | StopReplica
        if isinstance(decision, core.LaunchReplacement):
            request = LaunchReplica(job_id=decision.job_id, slot=decision.slot,
                                    replica_id=decision.replica_id,
                                    warm_only=decision.warm_only, gang=decision.gang)
            subject = subjects.agent_launch(decision.node_id)
        else:
            request = StopReplica(job_id=decision.job_id, slot=decision.slot,
                                  replica_id=decision.replica_id)
            subject = subjects.agent_stop(decision.node_id)
        context = {"job": decision.job_id, "replica": decision.replica_id,
                   "node": decision.node_id, "request": type(request).__name__}
        pause = RETRY_FIRST_S
        while True:
            try:
                reply = await self.bus.request(subject, request, ReplicaReply,
                                               timeout_s=AGENT_TIMEOUT_S)
                break
            except (NoResponders, RequestTimeout) as exc:
                term = self.term
                # A launch asked of a spare is not repeated: the cold one follows anyway.
                if not isinstance(decision, core.LaunchReplacement) or decision.warm_only \
                        or term is None or not term.core.awaits(decision):
                    log.warning("agent request failed", extra={**context, "error": str(exc)})
                    return
                log.info("agent request unanswered; asking again",
                         extra={**context, "error": str(exc), "in_s": pause})
            except PhalanxError as exc:
                log.warning("agent request failed", extra={**context, "error": str(exc)})
                return
            if await self.sleep_or_stop(pause):
                return
            pause = min(RETRY_MAX_S, 2 * pause)
        # Which path a replacement took: a warm spare handed its identity, or a cold start.
        log.info("agent request done", extra={**context, "detail": reply.detail,
                                              "spare": reply.spare})

    async def _requeue(self, decision: core.Requeue) -> None:
        assert self.bus is not None
        try:
            await self.bus.request(subjects.admission_requeue(),
                                   RequeueRequest(job_id=decision.job_id, reason=decision.reason),
                                   JobRecord, timeout_s=AGENT_TIMEOUT_S)
        except PhalanxError as exc:
            log.error("requeue failed", extra={"job": decision.job_id, "error": str(exc)})


def _observe_applied(elasticity: core.ElasticityCore, applied: GenerationApplied) -> None:
    """A member's report of what applying a generation took, into the recovery metrics."""
    metrics.RECOVERY_PHASE.labels("rebuild").observe(applied.rebuild_s)
    metrics.RECOVERY_PHASE.labels("state_copy").observe(applied.state_copy_s)
    job = elasticity.jobs.get(applied.job_id)
    current = job.current if job is not None else None
    if applied.pause_s is not None and current is not None \
            and current.generation == applied.generation:
        metrics.RECOVERY.labels(current.reason.value).observe(applied.pause_s)


def _event(event: StreamEvent) -> core.Event | None:
    """The core's event for a stored job event (None: nothing for elasticity)."""
    match event.message:
        case Fault() as fault:
            if not fault.removes_member or fault.replica_id is None:
                return None
            return core.MemberFailed(
                fault.job_id, fault.replica_id,
                f"{fault.kind.value}: {fault.detail}".rstrip(": "),
                replaceable=fault.kind.replaceable, event_id=fault.fault_id,
                admission=fault.admission)
        case ReplicaReady() as msg:
            return core.ReplicaReadySeen(msg.job_id, msg.replica_id, msg.node_id, msg.slot,
                                         msg.endpoint, event_id=f"ready:{msg.replica_id}",
                                         admission=msg.admission)
        case GenerationApplied() as msg:
            return core.GenerationAppliedSeen(msg.job_id, msg.generation, msg.replica_id,
                                          msg.committed_step,
                                          event_id=f"applied:{msg.replica_id}",
                                          pause_s=msg.pause_s, resume_step=msg.resume_step,
                                          restored_from=msg.restored_from,
                                          admission=msg.admission)
        case GenerationGivenUp() as msg:
            return core.GenerationGivenUpSeen(
                msg.job_id, msg.generation, msg.replica_id, msg.reason,
                event_id=f"given-up:{msg.replica_id}:g{msg.generation}",
                admission=msg.admission, unreachable=tuple(msg.unreachable))
        case RankExited() as msg:
            if msg.replica_id is None:
                return None
            if msg.exit_code == 0:
                return core.MemberFinished(msg.job_id, msg.replica_id,
                                           event_id=f"exited:{msg.replica_id}",
                                           admission=msg.admission)
            how = f"signal {msg.signal}" if msg.signal else f"exit code {msg.exit_code}"
            return core.ReplicaExited(msg.job_id, msg.replica_id, f"{msg.cause.value}, {how}",
                                      event_id=f"exited:{msg.replica_id}",
                                      admission=msg.admission)
    return None

