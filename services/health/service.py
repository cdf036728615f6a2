"""The health service's shell: signals in, faults and node verdicts out.

Any number of instances run; the one holding the ``health`` lease
(:mod:`phalanx.services.lease`) judges, the others stand by and take over
within the lease bound. The leader feeds the pure :class:`~.core.HealthCore`:

* job records, followed through the jobs bucket (an admitted job is watched
  with its placement and hang timeout; anything else ends the watch);
* rank starts and exits from the job-events stream (:mod:`phalanx.bus.stream`),
  read on from where the previous leader stopped, so no exit is missed while
  no instance leads;
* per-step progress from ranks and node heartbeats (plain subscriptions: one
  lost tick is harmless), and operators' uncordons;

and carries out its decisions: a :class:`Fault` on ``phalanx.job.<job>.fault``
(stored in the job-events stream before it counts as sent), a
:class:`NodeConditionChanged` on ``phalanx.node.<node>.condition``, a cordon
written to the node's registry entry, a finished job's record, and each job's
:class:`JobProgress` (step, rate, restarts) in ``phalanx_progress`` at most
every ``PROGRESS_EVERY_S`` while it changes, and at once when the job ends
(kept afterwards: ``phalanx job`` reads it). After each
event, a job whose lasting part changed (replicas, exits, who reports) has its
snapshot stored (``phalanx_health``), fenced like elasticity's, so a new
leader takes the jobs over with their exits and replica ids and judges every
reporting rank from the takeover on.

**Blindness is not evidence.** While the bus connection is down the timer does
not judge; after a reconnection, and at the start of a term, every node and
rank gets a full timeout (:class:`~.core.WatchResumed`), since the silence
may have been this instance's, not theirs. A new leader resumes only once it
listens (its subscriptions made and a round trip done): the time it spends
reading the stored records is not the ranks' silence. Nor is a backlog: before
a due timeout is judged, a round trip to the server brings every report it
already sent into the subscriptions' queues, and the timer waits until those
are handled (for up to ``BACKLOG_LIMIT_S``); an event from the intake judges
the timeouts due by its arrival. What the core decides is carried out from an
outbox (:mod:`.outbox`), so a slow write never holds up the intake, and a fault
never waits behind the state writes of earlier events. A cordon counts only
faults seen within one term: a new leader starts a fresh window.

Time-based rules (hangs, lost nodes) run when they are due: the timer sleeps
exactly until :meth:`HealthCore.next_deadline` and is woken whenever an
event moves that deadline, so detection latency is scheduling latency, not a
polling period. Each fault is published inside the span of the message that
caused it (a rank's exit, a heartbeat), or of its own "detect" span for a
timeout, so one trace runs from the agent that saw the signal to the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import msgspec
import nats.errors
from nats.aio.subscription import Subscription
from opentelemetry import context as otel_context

from phalanx.bus import telemetry
from phalanx.bus.client import Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import Change
from phalanx.bus.stream import StreamEvent
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Fault,
    GenerationApplied,
    JobProgress,
    JobRecord,
    JobSnapshot,
    JobState,
    NodeCondition,
    NodeConditionChanged,
    NodeHeartbeat,
    NodeRecord,
    RankExited,
    RankProgress,
    RankStarted,
    ReasonCode,
)
from phalanx.services import metrics
from phalanx.services.deadline import wait_set
from phalanx.services.health import core
from phalanx.services.health.core import Decision, Event  # HealthService.core hides `core`
from phalanx.services.health.outbox import Outbox
from phalanx.services.health.progress import carried as carried_progress
from phalanx.services.leader import JobEventsLeader, JobTerm

log = logging.getLogger("phalanx.health")
LEASE_KEY = "health"
SNAPSHOT_FORMAT = 1
CURSOR_EVERY_S = 1.0
#: A job of more ranks than this has its state stored at most every LARGE_EVERY_S.
LARGE_JOB_RANKS = 1024
LARGE_EVERY_S = 1.0
#: The pause before a job's state that could not be stored is stored again.
STORE_RETRY_S = 1.0
#: How often a job's progress record is stored while it trains.
PROGRESS_EVERY_S = 1.0
#: A timeout falls due while reports wait unhandled: those already received are handled
#: first, for at most this long (a detector stuck behind still judges, only later).
BACKLOG_LIMIT_S = 10.0
#: After an injected fault is over, how long its effects may still be reported.
CHAOS_DETECTION_S = 10.0


@dataclasses.dataclass
class HealthTerm(JobTerm[core.HealthCore]):
    """What exists only while this instance leads."""

    rearm: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    resumed_at: float = 0.0  # the last WatchResumed: timeouts are judged only after it
    # What the core decided, carried out apart from the intake: a slow write (a fault
    # retried through an outage) never holds up the intake of progress and heartbeats,
    # whose late handling would look like silence.
    outbox: Outbox = dataclasses.field(default_factory=Outbox)
    stored_at: dict[str, float] = dataclasses.field(default_factory=dict)  # large jobs:
    # when their state was last stored (monotonic)
    handled: int = 0  # the last stream event handled (its effects are in the outbox)
    subscriptions: list[Subscription] = dataclasses.field(default_factory=list)


class HealthService(JobEventsLeader[HealthTerm]):
    """Turns heartbeats, progress and exits into faults, within a bound a user sets.

    Args:
        policy: the detection thresholds.
        lease_s: how long the lease lasts without renewal (the takeover bound).
    """

    description = "phalanx failure detection"
    service_name = "phalanx-health"
    lease_key = LEASE_KEY
    metric_families = metrics.LEADERSHIP + metrics.HEALTH
    event_kinds = frozenset({"started", "exited", "applied"})

    def __init__(self, policy: core.HealthPolicy, bus_config: BusConfig | None = None, *,
                 instance: str | None = None, lease_s: float = 3.0) -> None:
        super().__init__(bus_config, instance=instance, lease_s=lease_s)
        self.policy = policy
        self.faults_published = 0

    @property
    def core(self) -> core.HealthCore | None:
        return None if self.term is None else self.term.core

    async def setup(self) -> None:
        assert self.bus is not None
        self.nodes = await self.bucket(subjects.NODES_BUCKET, NodeRecord)
        self.progress = await self.bucket(subjects.PROGRESS_BUCKET, JobProgress)
        self.bus.on_reconnect(self._on_reconnect)
        await self.open_job_state(subjects.HEALTH_BUCKET)

    async def _on_reconnect(self) -> None:
        term = self.term
        if term is not None:  # not awaited here: this runs inside nats-py's reconnection
            self.spawn(self._resume(term), "resume")

    async def _resume(self, term: HealthTerm) -> None:
        """The silence while this instance was blind was its own: a full timeout for all."""
        async with term.turn:
            resumed_at = time.time()
            await self._handle(term, core.WatchResumed())
            term.resumed_at = resumed_at

    # --- a term of leadership -----------------------------------------------------------

    def begin_term(self) -> HealthTerm:
        return HealthTerm(core.HealthCore(self.policy), *self.job_state())

    def restore_job(self, term: HealthTerm, state: bytes, now: float) -> str:
        return term.core.restore(state, now)

    async def caught_up(self, term: HealthTerm) -> None:
        """Listen to progress, heartbeats and node conditions (not stored: one lost is
        harmless), then resume: every restored rank's timeout runs from when this
        instance can hear it, not from the restore (reading records takes time)."""
        assert self.bus is not None
        for subject, message_type, handler in (
                (subjects.health_ranks(), RankProgress, self._on_progress),
                (subjects.node_heartbeats(), NodeHeartbeat, self._on_heartbeat),
                (subjects.node_conditions(), NodeConditionChanged, self._on_condition),
                (subjects.node_chaos_all(), NodeConditionChanged, self._on_chaos)):
            term.subscriptions.append(await self.bus.subscribe(
                subject, message_type, functools.partial(handler, term)))
        await self.bus.round_trip(1.0)  # the server has the subscriptions
        await self._resume(term)

    def term_loops(self, term: HealthTerm) -> list[Coroutine[Any, Any, None]]:
        return [self._timer(term), self._cursor(term), self._progress_records(term),
                term.outbox.run()]

    async def end_term(self, term: HealthTerm) -> None:
        metrics.MASS_SILENCE.labels("health").set(0)  # a standby judges nothing
        for sub in term.subscriptions:
            with contextlib.suppress(Exception):  # the connection may be closing
                await sub.unsubscribe()

    async def on_event(self, term: HealthTerm, event: StreamEvent) -> None:
        msg = event.message
        occurred_at = None
        if isinstance(msg, RankStarted):
            happened: core.Event = core.RankStartSeen(
                msg.job_id, msg.rank, msg.node_id, msg.pid, msg.replica_id, msg.admission)
        elif isinstance(msg, GenerationApplied):
            happened = core.MemberApplied(msg.job_id, msg.replica_id, msg.committed_step,
                                          msg.generation)
        else:
            assert isinstance(msg, RankExited)
            happened = core.RankExitSeen(msg.job_id, msg.rank, msg.node_id, msg.exit_code,
                                       msg.signal, msg.cause.value, msg.replica_id,
                                       msg.detail, msg.with_agent, msg.admission)
            occurred_at = msg.exited_at
        await self._handle(term, happened, event.seq, occurred_at=occurred_at)
        term.handled = event.seq

    async def _cursor(self, term: HealthTerm) -> None:
        while not await self.sleep_or_stop(CURSOR_EVERY_S):
            seq = term.handled  # stored after what those events decided is carried out
            term.outbox.write(("cursor", seq), functools.partial(term.store.advance, seq))

    async def _progress_records(self, term: HealthTerm) -> None:
        while not await self.sleep_or_stop(PROGRESS_EVERY_S):
            async with term.turn:
                self._store_progress(term)

    def _store_progress(self, term: HealthTerm) -> None:
        for progress in term.core.take_progress(time.time(), PROGRESS_EVERY_S):
            metrics.JOB_STEP.labels(progress.job_id).set(progress.step)
            if progress.steps_per_s is not None:
                metrics.JOB_STEP_RATE.labels(progress.job_id).set(progress.steps_per_s)
            term.outbox.write(("progress", progress.job_id), functools.partial(
                self.progress.modify, progress.job_id,
                functools.partial(carried_progress, new=progress)))

    # --- events in ----------------------------------------------------------------------

    async def _handle(self, term: HealthTerm, event: Event, seq: int | None = None, *,
                      occurred_at: float | None = None) -> None:
        """Apply ``event`` (which happened at ``occurred_at``, when it says); queue its
        decisions and the snapshots of jobs it changed."""
        if not self._seeing(term) and not isinstance(event, core.WatchResumed):
            # Events still arrive (queued before a disconnection, or right after a
            # reconnection before the resumption): none may judge a timeout meanwhile.
            term.core.handle(core.WatchLost(), time.time())
        decisions = term.core.handle(event, time.time())
        self._decided(term, decisions, occurred_at)
        if any(isinstance(d, core.FinishJob | core.FailJob) for d in decisions):
            self._store_progress(term)  # its last progress, with the record that ends it
        changed = term.core.take_changed()
        if seq is not None:  # from the job-events stream: a rank's start or exit
            assert isinstance(event, core.RankStartSeen | core.RankExitSeen
                              | core.MemberApplied)
            changed.add(event.job_id)
        for job_id in changed:
            term.store.reflects(job_id, seq)
            if job_id not in term.core.jobs:
                term.outbox.write(("job", job_id),
                                  functools.partial(term.store.forget, job_id))
            else:
                term.outbox.write(("job", job_id),
                                  functools.partial(self._store_job, term, job_id))
        term.rearm.set()  # the next deadline may have moved

    async def _store_job(self, term: HealthTerm, job_id: str) -> None:
        """Store ``job_id``'s state as it is when this write's turn comes, not as it was at
        the event that queued it: a job of 16,384 ranks takes 0.3 s to encode, and a
        start brings one event per rank. The state is read once every action decided
        so far is out (:meth:`Outbox.settled`), so a stored state never reflects an
        event whose fault is not out; it is at least as new as the event that queued
        the write, so a cursor queued after it never passes an event it does not
        reflect. A job of more than :data:`LARGE_JOB_RANKS` ranks (every progress report
        changes its state) is stored at most every :data:`LARGE_EVERY_S`."""
        job = term.core.jobs.get(job_id)
        if job is not None and len(job.ranks) > LARGE_JOB_RANKS:
            pause = term.stored_at.get(job_id, -math.inf) + LARGE_EVERY_S - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            term.stored_at[job_id] = time.monotonic()

        def state() -> JobSnapshot | None:
            job = term.core.jobs.get(job_id)
            return None if job is None else JobSnapshot(
                job_id=job_id, seq=term.store.seq(job_id), format=SNAPSHOT_FORMAT,
                state=core.snapshot(job))

        snapshot = await term.outbox.settled(state)
        while snapshot is not None:
            try:
                await term.store.store(job_id, snapshot)
                return
            except (TimeoutError, nats.errors.Error) as exc:
                # The server is slow (a large state's chunks on a loaded one timed out
                # past the KV's retries): try again, holding up only the writes behind
                # it. Ending the term for it (the outbox's rule for any failure) kept a
                # crash's fault 40 s away at 16,384 ranks; faults go out meanwhile.
                log.warning("storing job state failed; retrying",
                            extra={"job": job_id, "error": repr(exc)})
                await asyncio.sleep(STORE_RETRY_S)

    def _decided(self, term: HealthTerm, decisions: list[Decision],
                 occurred_at: float | None = None) -> None:
        if decisions:
            context = otel_context.get_current()  # the span of what caused them
            decided_at = time.time()  # a fault's detected_at, however late it goes out

            async def carry_out() -> None:
                token = otel_context.attach(context)
                try:
                    await self._execute(decisions, decided_at, occurred_at)
                finally:
                    otel_context.detach(token)

            term.outbox.act(carry_out)

    async def on_record(self, term: HealthTerm, change: Change[JobRecord]) -> None:
        record = change.value
        if record is not None and record.state is JobState.ADMITTED:
            await self._handle(term, core.JobWatched(record.job_id, tuple(record.nodes),
                                                     record.spec.hang_timeout_s,
                                                     tuple(record.slots),
                                                     record.spec.restart_policy,
                                                     record.admission))
        elif change.key in term.core.jobs:
            await self._handle(term, core.JobUnwatched(change.key))
            metrics.forget_job(change.key, metrics.JOB_STEP, metrics.JOB_STEP_RATE)

    async def _on_progress(self, term: HealthTerm, msg: RankProgress, _: Delivery) -> None:
        async with term.turn:
            await self._handle(term, core.ProgressReported(msg.job_id, msg.rank, msg.step,
                                                           msg.step_time_s, msg.final,
                                                           msg.replica_id, msg.total_steps,
                                                           msg.generation))

    async def _on_heartbeat(self, term: HealthTerm, msg: NodeHeartbeat, _: Delivery) -> None:
        async with term.turn:
            await self._handle(term, core.HeartbeatSeen(msg.node_id))

    async def _on_condition(self, term: HealthTerm, msg: NodeConditionChanged, _: Delivery) -> None:
        if msg.condition is NodeCondition.UNCORDONED:
            async with term.turn:
                await self._handle(term, core.NodeUncordoned(msg.node_id))

    async def _on_chaos(self, term: HealthTerm, msg: NodeConditionChanged, where: Delivery) -> None:
        """An agent injects a fault on its own node (only its own: the subject says which)."""
        if msg.condition is not NodeCondition.CHAOS \
                or where.subject != subjects.node_chaos(msg.node_id):
            log.warning("ignored a chaos notice for %s on %s", msg.node_id, where.subject)
            return
        # The faults it causes are detected up to a node timeout later (a lost node), and
        # their reports may travel a little longer.
        until = max(msg.at, msg.until or 0.0) + self.policy.node_timeout_s + CHAOS_DETECTION_S
        async with term.turn:
            await self._handle(term, core.ChaosInjected(msg.node_id, until))

    async def _read_the_mail(self, term: HealthTerm, deadline: float) -> bool:
        """Before silence is judged: a round trip to the server puts every report it
        already sent into the subscriptions' queues (a starved process has them unread in
        its socket), then wait until those are handled; False if the round trip failed
        (the timer tries again). Reports that come in meanwhile are not waited for: the
        backlog to read is the one there was, so a detector that is behind still judges.
        """
        assert self.bus is not None
        if not await self.bus.round_trip(1.0):
            await asyncio.sleep(0.01)
            return False
        # A subscription's delivered count includes what is queued; what has left the queue
        # has been handled (or waits for the turn, which the judgement takes after it).
        marks = [(sub, sub.delivered) for sub in term.subscriptions]
        waited = time.time()
        while any(sub.delivered - sub.pending_msgs < mark for sub, mark in marks):
            if time.time() - waited > BACKLOG_LIMIT_S:
                log.warning("judging timeouts with reports unread",
                            extra={"unread": sum(s.pending_msgs for s, _ in marks),
                                   "late_s": round(time.time() - deadline, 3)})
                break
            await asyncio.sleep(0.005)
        return True

    def _seeing(self, term: HealthTerm) -> bool:
        """Connected, and resumed since the connection came up: silence means something."""
        assert self.bus is not None
        since = self.bus.connected_since
        return since is not None and since <= term.resumed_at

    async def _timer(self, term: HealthTerm) -> None:
        """Run :meth:`HealthCore.tick` exactly when the next deadline passes, but only while
        :meth:`_seeing` (a blind detector judges nothing)."""
        while True:
            deadline = term.core.next_deadline()
            term.rearm.clear()
            delay = None if deadline is None else max(0.0, deadline - time.time())
            if delay is None or delay > 0 or not self._seeing(term):
                await wait_set(term.rearm, delay or 0.5)
                if deadline is None or time.time() < deadline or not self._seeing(term):
                    continue  # woken early, or blind: recompute
            assert deadline is not None  # without one, the wait above always recomputes
            if not await self._read_the_mail(term, deadline):
                continue
            async with term.turn:
                if self._seeing(term):
                    with telemetry.tracer().start_as_current_span("detect timeouts"):
                        self._decided(term, term.core.tick(time.time()))

    # --- decisions out ------------------------------------------------------------------

    async def _execute(self, decisions: list[Decision], now: float,
                       occurred_at: float | None = None) -> None:
        """Carry out ``decisions`` made at ``now`` about an event of ``occurred_at``."""
        assert self.bus is not None
        for decision in decisions:
            match decision:
                case core.RaiseFault():
                    fault = Fault(fault_id=uuid.uuid4().hex[:16], job_id=decision.job_id,
                                  kind=decision.kind, node_id=decision.node_id,
                                  detected_at=now, rank=decision.rank,
                                  exit_code=decision.exit_code, signal=decision.signal,
                                  detail=decision.detail, replica_id=decision.replica_id,
                                  application=decision.application,
                                  admission=decision.admission)
                    await self._raise(fault, occurred_at)
                    log.warning("fault", extra={"job": fault.job_id, "kind": fault.kind.value,
                                                "rank": fault.rank, "node": fault.node_id,
                                                "detail": fault.detail})
                case core.MarkNodeLost():
                    await self._condition(decision.node_id, NodeCondition.LOST, decision.reason)
                case core.MarkNodeAlive():
                    await self._condition(decision.node_id, NodeCondition.ALIVE,
                                          decision.reason)
                case core.JudgementHeld():
                    metrics.MASS_SILENCE.labels("health").set(int(decision.held))
                    log.warning("mass silence" if decision.held else "mass silence ended",
                                extra={"reason": decision.reason})
                case core.CordonNode():
                    try:
                        await self.nodes.modify(decision.node_id, _cordon)
                    except LookupError:
                        # Faults may name a node that never registered (or was removed):
                        # there is nothing to cordon, and nothing else to stop for.
                        log.warning("cannot cordon a node not in the registry",
                                    extra={"node": decision.node_id, "reason": decision.reason})
                        continue
                    await self._condition(decision.node_id, NodeCondition.CORDONED,
                                          decision.reason)
                case core.FinishJob():
                    at = f" at step {decision.step}" if decision.step is not None else ""
                    await self._end(decision.job_id, now, JobState.FINISHED,
                                    ReasonCode.FINISHED, f"training completed{at}")
                case core.FailJob():
                    log.warning("job failed", extra={"job": decision.job_id,
                                                     "reason_code": decision.reason_code.value,
                                                     "reason": decision.reason})
                    await self._end(decision.job_id, now, JobState.FAILED,
                                    decision.reason_code, decision.reason)
                case _:
                    raise TypeError(f"unknown decision {decision!r}")

    async def _raise(self, fault: Fault, occurred_at: float | None) -> None:
        """Publish ``fault`` in a span of its own (the recovery trace's fault), counted."""
        assert self.bus is not None
        attributes: dict[str, str | int | float] = {
            "phalanx.job": fault.job_id, "phalanx.fault.kind": fault.kind.value,
            "phalanx.fault.id": fault.fault_id, "phalanx.node": fault.node_id,
            "phalanx.fault.detail": fault.detail}
        if fault.replica_id is not None:
            attributes["phalanx.replica"] = fault.replica_id
        if fault.rank is not None:
            attributes["phalanx.rank"] = fault.rank
        if occurred_at is not None:  # the exit it was raised for, as the agent saw it
            detection_s = max(0.0, fault.detected_at - occurred_at)
            attributes["phalanx.fault.detection_s"] = detection_s
            metrics.DETECTION.labels(fault.kind.value).observe(detection_s)
        # Counted as it goes out, so a scrape that sees what the fault caused counts it too.
        metrics.FAULTS.labels(fault.kind.value).inc()
        with telemetry.tracer().start_as_current_span(f"fault {fault.kind.value}",
                                                      attributes=attributes):
            await self.bus.publish_event(subjects.job_fault(fault.job_id), fault,
                                         event_id=fault.fault_id)
        self.faults_published += 1

    async def _condition(self, node_id: str, condition: NodeCondition, reason: str) -> None:
        assert self.bus is not None
        log.warning("node %s", condition.value, extra={"node": node_id, "reason": reason})
        await self.bus.publish(subjects.node_condition(node_id), NodeConditionChanged(
            node_id=node_id, condition=condition, reason=reason, at=time.time()))

    async def _end(self, job_id: str, now: float, state: JobState, code: ReasonCode,
                   reason: str) -> None:
        """End the job's record (finished or failed) unless something ended it first."""
        assert self.bus is not None

        def end(current: JobRecord | None) -> JobRecord:
            if current is None:
                raise LookupError(f"job {job_id} has no record")
            if current.state.terminal:
                return current
            return msgspec.structs.replace(current, state=state, updated_at=now,
                                           reason_code=code, reason=reason, nodes=[], slots=[])

        try:
            entry = await self.jobs.modify(job_id, end)
        except LookupError:  # no record (any more): nothing to end
            return
        await self.bus.publish(subjects.job_state(job_id),
                               self.jobs.pointer(job_id) or entry.value)


def _cordon(record: NodeRecord | None) -> NodeRecord:
    if record is None:
        raise LookupError("the node is not in the registry")
    return msgspec.structs.replace(record, cordoned=True)
