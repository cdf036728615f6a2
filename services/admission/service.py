"""The admission service's shell: leader lease, KV state, requests, persistence.

Any number of instances run. Each answers ``submit``/``cancel``/``requeue``/
``explain``/``scale`` on the public subjects and forwards the request to the leader's
subject for that verb, so clients never need to know who leads. One instance
at a time leads: it holds the ``leader`` lease in the ``phalanx_admission``
bucket (compare-and-swap renewed every ``lease_s / 6``; a crashed leader is
replaced once its lease expires, a stopped one hands over at once by
releasing it).

The leader rebuilds the pure :class:`~.core.AdmissionCore` from KV — the
ledger (:mod:`.ledger`: each job's placement and each node's claims), the node
registry and the job records — then watches the jobs and nodes buckets and runs
the core on each batch of events. After a batch it writes, in this order: the
ledger records the batch changed (placements that shrink, the changed nodes'
claims, placements that grow; each compare-and-swapped), then the changed job
records, then a state event per changed job and the scaling events
(:class:`~phalanx.schemas.messages.ScalingEvent` on ``phalanx.job.<job>.scaling``, each
in a span). The leader also follows the generations
bucket: a job's world size there completes its planned size change. A
restarted leader therefore recovers from any crash point: a job placed in the
ledger is admitted, a terminal record (cancelled, failed, finished) is final,
everything else is pending. A ledger write whose compare-and-swap fails means
another instance wrote it: this one steps down rather than guess.

A node is judged lost only on silence the leader could have heard, timed by when
it read each heartbeat (agents' clocks need not agree with its own): nothing
while its bus is disconnected, a fresh ``lost_after_s`` for every node from
its term's first read of the registry and one more after a reconnection (the
registry rule's ``watching_since``), so a bus outage never requeues a job. The
registry is followed from that read on, through the restore of the jobs, so a
restore longer than ``lost_after_s`` leaves no check judging entries it read
before; and a time the leader's loop was held up (a long pass, with heartbeats
waiting unread) counts as no node's silence. Nor does a mass silence
(:func:`~phalanx.schemas.registry.mass_silence`: a node falls silent with every
other node believed alive): no judgement changes while it lasts, and once a node is
heard the others are credited the span in which none was (:mod:`.node_watch`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

import msgspec

from phalanx.bus import telemetry
from phalanx.bus.client import Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import Conflict, NoResponders, RemoteError, RequestRefused, RequestTimeout
from phalanx.bus.kv import Change
from phalanx.bus.tasks import concurrently
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Explanation,
    Generation,
    JobPlacement,
    JobRecord,
    JobRequest,
    JobState,
    Lease,
    Message,
    NodeRecord,
    ReasonCode,
    RequeueRequest,
    ScaleRequest,
    ScalingEvent,
    SubmitRequest,
)
from phalanx.services import metrics
from phalanx.services.admission import core, ledger
from phalanx.services.admission.changes import Announce
from phalanx.services.admission.config import AdmissionConfig
from phalanx.services.admission.events import Event, NodeUpdated
from phalanx.services.admission.node_watch import NodeWatch
from phalanx.services.admission.store import LedgerStore
from phalanx.services.leader import LeaderService

log = logging.getLogger("phalanx.admission")
LEADER_KEY = "leader"


class _Tick(enum.Enum):
    TICK = enum.auto()


_TICK: Final = _Tick.TICK  # scheduler wake-up for timeouts and node liveness
#: The verbs every instance takes and the leader serves: request and reply types.
VERBS: dict[str, tuple[type[Message], type[Message]]] = {
    "submit": (SubmitRequest, JobRecord), "cancel": (JobRequest, JobRecord),
    "requeue": (RequeueRequest, JobRecord), "explain": (JobRequest, Explanation),
    "scale": (ScaleRequest, JobRecord)}


@dataclasses.dataclass(frozen=True)
class Reconciled:
    """A job whose record disagrees with the ledger after a restart: rewrite it."""

    job_id: str


@dataclasses.dataclass
class AdmissionTerm:
    """What exists only while this instance leads."""

    core: core.AdmissionCore
    events: asyncio.Queue[Event | _Tick]
    store: LedgerStore
    watch: NodeWatch  # the nodes' silence as this term could hear it
    persisted: dict[str, tuple[JobState, ReasonCode, tuple[str, ...]]] = dataclasses.field(
        default_factory=dict)
    node_events: dict[str, NodeUpdated] = dataclasses.field(default_factory=dict)
    traces: dict[str, str] = dataclasses.field(default_factory=dict)  # JobRecord.trace by job
    serving: bool = False  # state rebuilt: requests may be answered


class AdmissionService(LeaderService[AdmissionTerm]):
    """Gang admission: one leader decides, every instance takes requests."""

    description = "phalanx gang admission"
    service_name = "phalanx-admission"
    lease_key = LEADER_KEY
    metric_families = metrics.LEADERSHIP + metrics.ADMISSION

    def __init__(self, config: AdmissionConfig, bus_config: BusConfig | None = None, *,
                 instance: str | None = None) -> None:
        super().__init__(bus_config, instance=instance, lease_s=config.lease_s)
        self.config = config
        self.node_records: dict[str, NodeRecord] = {}
        self._capacity: core.Capacity | None = None  # of node_records; None: recount
        self._handlers: dict[str, Callable[[AdmissionTerm, Any], Awaitable[Message]]] = {
            "submit": self._on_submit, "cancel": self._on_cancel, "requeue": self._on_requeue,
            "explain": self._on_explain, "scale": self._on_scale}

    # --- set-up and the lease -----------------------------------------------------------

    async def setup(self) -> None:
        self.jobs = await self.bucket(subjects.JOBS_BUCKET, JobRecord)
        self.nodes = await self.bucket(subjects.NODES_BUCKET, NodeRecord)
        self.leases = await self.bucket(subjects.ADMISSION_BUCKET, Lease)
        self.generations = await self.bucket(subjects.GENERATIONS_BUCKET, Generation)
        for verb, (request_type, reply_type) in VERBS.items():
            await self.add_endpoint(verb, subjects.admission(verb), request_type,
                                    self._forwarder(verb, reply_type), concurrent=True)
        self.start_leadership(self.leases)

    def _forwarder(self, verb: str,
                   reply_type: type[Message]) -> Callable[[Message, Delivery], Awaitable[Message]]:
        """The public endpoint: served here when leading, else forwarded to the leader."""
        subject = subjects.admission_leader(verb)

        async def forward(request: Message, _: Delivery) -> Message:
            assert self.bus is not None
            term = self.term
            if term is not None and term.serving:
                return await self._handlers[verb](term, request)
            try:
                return await self.bus.request(subject, request, reply_type,
                                              timeout_s=self.config.forward_timeout_s)
            except NoResponders:
                raise RequestRefused("503", "no admission leader right now (election in "
                                            "progress); retry shortly") from None
            except RequestTimeout:
                raise RequestRefused("504", f"the admission leader did not answer within "
                                            f"{self.config.forward_timeout_s:g} s") from None
            except RemoteError as exc:
                raise RequestRefused(exc.code, exc.description) from None

        return forward

    def _serving(self, term: AdmissionTerm,
                 verb: str) -> Callable[[Message, Delivery], Awaitable[Message]]:
        """The leader's endpoint of ``verb`` in ``term``."""
        handler = self._handlers[verb]

        async def serve(request: Message, _: Delivery) -> Message:
            return await handler(term, request)

        return serve

    def begin_term(self) -> AdmissionTerm:
        return AdmissionTerm(core.AdmissionCore(self.config.policy), asyncio.Queue(),
                    LedgerStore(self.leases.kv, subjects.ADMISSION_BUCKET),
                    NodeWatch(self.config.lost_after_s))

    # --- leading ------------------------------------------------------------------------

    async def lead(self, term: AdmissionTerm) -> None:
        """Rebuild state from KV, then serve requests and run the core until cancelled."""
        assert self.bus is not None
        await term.store.load()
        # The registry is heard from here on: read whole, then followed without a gap
        # through the restore (which can outlast lost_after_s), so that no liveness check
        # judges a node on a record older than what this term could have heard since.
        node_changes = self.nodes.follow(self.bus.resync_event())
        job_changes = self.jobs.follow(self.bus.resync_event())
        nodes_followed: asyncio.Task[None] | None = None
        subscriptions = []
        try:
            now = time.time()
            term.watch.blind_until(now)  # a new leader has heard nobody yet
            # The registry as this term reads it: a node removed while another instance
            # led is in no change this term will see.
            self.node_records, self._capacity = {}, None
            async for change in node_changes:
                if change is None:
                    break
                self._node_changed(term, change.key, change.value, now)
            while not term.events.empty():
                if (event := term.events.get_nowait()) is not _TICK:
                    term.core.handle(event, now)
            nodes_followed = asyncio.create_task(self._watch_nodes(term, node_changes))
            restored, repair = await self._restore(term, job_changes)
            subscriptions = [
                await self.bus.subscribe(subjects.admission_leader(verb), request_type,
                                         self._serving(term, verb), concurrent=True)
                # Every verb a standby forwards (requeue too: elasticity's requeue reaching
                # a standby was forwarded to nobody, and the job was dropped).
                for verb, (request_type, _) in VERBS.items()
            ]
            term.serving = True
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._watch_jobs(term, job_changes))
                tasks.create_task(_joined(nodes_followed))
                tasks.create_task(self._watch_generations(term))
                tasks.create_task(self._tick(term))
                tasks.create_task(self._schedule(term, restored, repair))
        finally:
            metrics.MASS_SILENCE.labels("admission").set(0)  # a standby judges nothing
            if nodes_followed is not None:
                nodes_followed.cancel()
                await asyncio.wait([nodes_followed])
                if not nodes_followed.cancelled():
                    nodes_followed.exception()  # retrieved: raised by _joined, or moot
            for sub in subscriptions:
                try:
                    await sub.unsubscribe()
                except Exception as exc:  # the connection may be closing
                    log.debug("unsubscribe failed: %s", exc)
            await job_changes.aclose()
            await node_changes.aclose()

    async def _restore(self, term: AdmissionTerm,
                       changes: AsyncIterator[Change[JobRecord] | None]
                       ) -> tuple[list[core.Decision | Reconciled], ledger.Restored]:
        """Feed the jobs' current records to the core, admitted ones onto their placements;
        returns the decisions and what the ledger needs repaired (:func:`ledger.restore`)."""
        current: list[JobRecord] = []
        async for change in changes:
            if change is None:
                break
            if change.value is not None:
                current.append(change.value)
        store = term.store
        placements = dict(store.stored)
        decisions: list[core.Decision] = []
        for record in sorted(current, key=lambda r: (r.submitted_at, r.job_id)):
            term.traces[record.job_id] = record.trace
            if record.state.terminal:
                term.persisted[record.job_id] = (record.state, record.reason_code, ())
                continue
            if record.job_id in store.unreadable and record.state is JobState.ADMITTED:
                # An undecodable placement: the admitted record says where the job runs.
                placements[record.job_id] = JobPlacement(
                    team=record.spec.team, slots_per_replica=record.spec.slots_per_group,
                    nodes=list(record.nodes))
            placement = placements.get(record.job_id)
            event = core.JobSubmitted(record.job_id, record.spec, record.submitted_at,
                                      event_id="restore", pinned_replicas=record.pinned_replicas,
                                      change=record.scaling_change)
            decisions += term.core.restore(event, list(placement.nodes) if placement else [],
                                           time.time())
            term.persisted[record.job_id] = (record.state, record.reason_code,
                                             tuple(record.nodes))
        # Records the crash left behind the ledger (admitted there, still pending here, or
        # the other way round, or admitted on other nodes: a pass that moved a job wrote
        # the ledger, then not every record) are rewritten by the first persist.
        stale = [Reconciled(gang.job_id) for gang in term.core.gangs.values()
                 if not gang.state.terminal
                 and (term.persisted[gang.job_id][0] is not gang.state
                      or term.persisted[gang.job_id][2] != tuple(gang.nodes))]
        repair = ledger.restore(placements, store.claims)
        nodes = term.core.nodes.values()
        log.info("restored", extra={"jobs": len(current), "admitted": len(term.core.running),
                                    "placements": len(repair.placements),
                                    "nodes": len(nodes), "alive": sum(n.alive for n in nodes),
                                    "reconciled": len(stale), "fenced": len(repair.fence),
                                    "nodes_repaired": len(repair.dirty)})
        return [*decisions, *stale], repair

    @staticmethod
    def _ledger_repairs(term: AdmissionTerm, repair: ledger.Restored) -> set[str]:
        """The jobs the first persist writes besides those the pass changed: placements to
        fence or to replace, those of jobs the core does not run (ended while nobody led),
        and every job with slots on a node whose claims are rewritten."""
        store, gangs = term.store, term.core.gangs
        jobs = set(repair.fence) | store.unreadable
        jobs.update(job for job in store.stored
                    if job not in gangs or gangs[job].state is not JobState.ADMITTED)
        for node in repair.dirty:
            jobs.update(store.claims.get(node, {}))
            jobs.update(job for job, placement in store.stored.items() if node in placement.nodes)
        return jobs

    async def _schedule(self, term: AdmissionTerm, first: list[core.Decision | Reconciled],
                        repair: ledger.Restored) -> None:
        """Repair the ledger, then apply batches of events, run a pass, persist; forever."""
        now = time.time()
        decisions = term.core.schedule(now)
        self._count(term, decisions, now)
        await self._persist(term, [*first, *decisions], repair=repair,
                            ledger_jobs=self._ledger_repairs(term, repair))
        while True:
            batch = [await term.events.get()]
            while not term.events.empty() and len(batch) < 10_000:
                batch.append(term.events.get_nowait())
            now = time.time()
            decisions = []
            for event in batch:
                if event is not _TICK:
                    decisions += term.core.handle(event, now)
            decisions += term.core.schedule(now)
            self._count(term, decisions, now)
            await self._persist(term, decisions)

    @staticmethod
    def _count(term: AdmissionTerm, decisions: list[core.Decision], now: float) -> None:
        """The admission metrics, from what a pass decided (not from a restore's decisions,
        which a previous leader counted)."""
        metrics.QUEUE_DEPTH.set(len(term.core.queue))
        for decision in decisions:
            match decision:
                case core.Admit():
                    metrics.ADMITTED.inc()
                    metrics.ADMISSION_LATENCY.observe(
                        max(0.0, now - term.core.gangs[decision.job_id].submitted_at))
                case core.Evict(requeue=True):
                    if decision.reason.code is ReasonCode.PREEMPTED:
                        metrics.PREEMPTED.labels("evicted").inc()
                    metrics.REQUEUED.labels(decision.reason.code.value).inc()
                case core.Shrink() if decision.reason.code is ReasonCode.PREEMPTED:
                    metrics.PREEMPTED.labels("shrunk").inc()

    async def _persist(self, term: AdmissionTerm,
                       decisions: Sequence[core.Decision | Reconciled], *,
                       repair: ledger.Restored | None = None,
                       ledger_jobs: set[str] | frozenset[str] = frozenset()) -> None:
        """The ledger's changes first (:func:`ledger.plan`), then changed job records,
        then state and scaling events. Writes of one step run at once; when one fails,
        the rest are cancelled and waited for (:func:`~phalanx.bus.tasks.concurrently`),
        so none of them runs on into the next term (a record write retrying its
        compare-and-swap would rewrite that term's decision with this one's)."""
        touched = {d.job_id for d in decisions}
        placed = {d.job_id for d in decisions if not isinstance(d, Announce)} | ledger_jobs
        gangs = term.core.gangs
        now = time.time()
        after = {job: _placement(gangs.get(job), now) for job in placed}
        plan = ledger.plan(term.store.stored, term.store.claims, after,
                           dirty=repair.dirty if repair else (),
                           fence=repair.fence if repair else ())
        if plan:
            await term.store.write(plan)
        # Pending gangs whose reason changed get their record refreshed too.
        for gang in term.core.queue:
            if gang.reason_pass == term.core.pass_no:
                persisted = term.persisted.get(gang.job_id)
                if persisted is None or persisted[1] is not gang.reason.code:
                    touched.add(gang.job_id)
        decided = {d.job_id: d for d in decisions if not isinstance(d, Announce | Reconciled)}
        await concurrently(self._write_decided(term, gangs[j], now, decided.get(j))
                           for j in touched)
        for decision in decisions:
            if isinstance(decision, Announce):
                await self._announce(term, decision, now)

    async def _write_decided(self, term: AdmissionTerm, gang: core.Gang, now: float,
                             decision: core.Decision | None) -> None:
        """Write a gang's record; in a span naming the decision when one changed it (the
        record's publish, and what agents and elasticity do about it, are its children)."""
        if decision is None:
            await self._write_record(term, gang, now)
            return
        attributes: dict[str, str | int] = {
            "phalanx.job": gang.job_id, "phalanx.team": gang.team,
            "phalanx.replicas": len(gang.nodes), "phalanx.cause": decision.cause}
        reason = getattr(decision, "reason", None)
        if reason is not None:
            attributes["phalanx.reason"] = reason.code.value
        with telemetry.tracer().start_as_current_span(
                f"admission {type(decision).__name__.lower()}", attributes=attributes,
                context=telemetry.within(term.traces.get(gang.job_id, ""))):
            await self._write_record(term, gang, now)

    async def _announce(self, term: AdmissionTerm, announce: Announce, now: float) -> None:
        """Publish a scaling event, in a span of the job's trace (attributes name the job)."""
        assert self.bus is not None
        event = ScalingEvent(job_id=announce.job_id, kind=announce.kind,
                             from_replicas=announce.from_replicas,
                             to_replicas=announce.to_replicas, reason=announce.reason,
                             at=now, deadline=announce.deadline)
        with telemetry.tracer().start_as_current_span(
                f"scaling {announce.kind.value}", attributes={
                    "phalanx.job": announce.job_id, "phalanx.scaling.kind": announce.kind.value,
                    "phalanx.scaling.from": announce.from_replicas,
                    "phalanx.scaling.to": announce.to_replicas,
                    "phalanx.scaling.reason": announce.reason,
                    "phalanx.scaling.deadline": announce.deadline or 0.0},
                context=telemetry.within(term.traces.get(announce.job_id, ""))):
            await self.bus.publish(subjects.job_scaling(announce.job_id), event)
        log.info("scaling", extra={"job": announce.job_id, "kind": announce.kind.value,
                                   "from": announce.from_replicas, "to": announce.to_replicas,
                                   "reason": announce.reason})

    async def _write_record(self, term: AdmissionTerm, gang: core.Gang, now: float) -> None:
        assert self.bus is not None
        reason = gang.reason  # the record keeps the reason; explain adds the live position

        def change(current: JobRecord | None) -> JobRecord:
            admission = core.admission_number(
                None if current is None else current.state,
                0 if current is None else current.admission, gang.state)
            base = current or JobRecord(
                job_id=gang.job_id, spec=gang.spec, state=gang.state,
                submitted_at=gang.submitted_at, updated_at=now, reason_code=reason.code)
            if base.state.terminal and (gang.state.terminal or base.state is not gang.state):
                # A record that ended stays as its writer left it: a cancel written
                # meanwhile wins (its watch event follows), and health's finish or
                # failure keeps its own reason.
                return base
            nodes = list(gang.nodes)
            running = base.state is JobState.ADMITTED and gang.state is JobState.ADMITTED
            slots = core.carry_slots(base.nodes, base.slots, nodes, base.next_slot) \
                if running else list(range(len(nodes)))
            # Within one admission slot numbers only grow; a new admission starts at 0.
            next_slot = max(base.next_slot if running else 0, max(slots, default=-1) + 1)
            return msgspec.structs.replace(base, state=gang.state, updated_at=now,
                                           reason_code=reason.code, reason=reason.message,
                                           nodes=nodes, next_slot=next_slot,
                                           pinned_replicas=gang.pinned,
                                           scaling_change=gang.change, admission=admission,
                                           slots=[] if slots == list(range(len(nodes))) else slots)

        entry = await self.jobs.modify(gang.job_id, change)
        record = entry.value
        previous = term.persisted.get(gang.job_id)
        term.persisted[gang.job_id] = (record.state, record.reason_code, tuple(record.nodes))
        if previous is None or previous[0] is not record.state or previous[2] != tuple(
                record.nodes):
            await self.bus.publish(subjects.job_state(gang.job_id),
                                   self.jobs.pointer(gang.job_id) or record)

    # --- event sources ------------------------------------------------------------------

    async def _watch_jobs(self, term: AdmissionTerm,
                          changes: AsyncIterator[Change[JobRecord] | None]) -> None:
        async for change in changes:
            if change is not None:
                self._job_changed(term, change)

    def _job_changed(self, term: AdmissionTerm, change: Change[JobRecord]) -> None:
        gang = term.core.gangs.get(change.key)
        record = change.value
        if gang is None:
            if record is not None and not record.state.terminal:
                term.events.put_nowait(core.JobSubmitted(record.job_id, record.spec,
                                                         record.submitted_at, event_id="watch"))
            return
        if gang.state.terminal:
            return
        if record is None or record.state is JobState.CANCELLED:
            term.events.put_nowait(core.JobCancelled(change.key, event_id="watch"))
        elif record.state is JobState.FINISHED:
            term.events.put_nowait(core.JobFinished(change.key, event_id="watch"))
        elif record.state is JobState.FAILED:
            term.events.put_nowait(core.JobFailed(change.key, record.reason_code, record.reason,
                                                  event_id="watch"))

    async def _watch_generations(self, term: AdmissionTerm) -> None:
        """A job's world size, as elasticity publishes its generations: it completes the
        job's planned size change."""
        assert self.bus is not None
        async for change in self.generations.follow(self.bus.resync_event()):
            if change is not None:
                size = None if change.value is None else change.value.world_size
                term.events.put_nowait(core.MembershipChanged(change.key, size,
                                                              event_id="generation"))

    async def _watch_nodes(self, term: AdmissionTerm,
                           changes: AsyncIterator[Change[NodeRecord] | None]) -> None:
        async for change in changes:
            if change is not None:
                self._node_changed(term, change.key, change.value, time.time())

    def _node_changed(self, term: AdmissionTerm, node_id: str, record: NodeRecord | None,
                      now: float) -> None:
        before = self.node_records.get(node_id)
        slots = (before.node.slots if before else None, record.node.slots if record else None)
        if slots[0] != slots[1]:
            self._capacity = None  # heartbeats leave it alone: only slots added or gone
        if record is None:
            self.node_records.pop(node_id, None)
            term.watch.forget(node_id)
            if term.node_events.pop(node_id, None) is not None:
                term.events.put_nowait(core.NodeRemoved(node_id, event_id="registry"))
            return
        self.node_records[node_id] = record
        held = term.watch.read(record, lambda: self._believed_alive(term), now)
        if held is not None:
            log.warning("mass silence ended: %s heard again after %.1f s; the other nodes "
                        "are credited the span in which none was heard", node_id, held)
            metrics.MASS_SILENCE.labels("admission").set(0)
        self._node_seen(term, record, now)

    def _hearing(self, term: AdmissionTerm) -> bool:
        """Whether this term can hear the nodes now (its bus connected); if so, its
        watch is blind until one timeout after the connection: the agents need a moment
        too (JetStream may refuse their first heartbeat writes while it recovers)."""
        assert self.bus is not None
        connected_since = self.bus.connected_since
        if connected_since is None:
            return False
        term.watch.blind_until(connected_since + self.config.lost_after_s)
        return True

    def _believed_alive(self, term: AdmissionTerm) -> list[NodeRecord]:
        return [r for r in self.node_records.values()
                if (seen := term.node_events.get(r.node.node_id)) is not None and seen.alive]

    def _node_seen(self, term: AdmissionTerm, record: NodeRecord, now: float) -> None:
        if not self._hearing(term):
            return  # blind while disconnected: the nodes' silence proves nothing
        node = record.node
        seen = term.node_events.get(node.node_id)
        alive = term.watch.alive(record, now, None if seen is None else seen.alive)
        # A cordoned slot (its GPU failed) is no slot: placements leave it out, and a node
        # that holds more than its usable slots now gives back its newest gangs.
        event = core.NodeUpdated(node.node_id, record.usable_slots, node.failure_domain,
                                 dict(node.labels), alive=alive, cordoned=record.cordoned,
                                 event_id="registry")
        if seen != event:
            term.node_events[node.node_id] = event
            term.events.put_nowait(event)

    async def _tick(self, term: AdmissionTerm) -> None:
        due = time.monotonic() + self.config.tick_s
        while not await self.sleep_or_stop(self.config.tick_s):
            woke = time.monotonic()
            held_up = woke - due  # how long the loop kept this tick waiting past its time
            due = woke + self.config.tick_s
            now = time.time()
            if held_up > self.config.tick_s:
                # The loop heard nothing while it was held up (a long pass): the heartbeats
                # of that time wait unread, so it is no node's silence. A node is judged
                # lost once it has been silent for lost_after_s of time this term heard.
                term.watch.blind_until(now - self.config.lost_after_s + held_up)
            self._hold_a_mass_silence(term, now)
            for record in list(self.node_records.values()):
                self._node_seen(term, record, now)
            term.events.put_nowait(_TICK)

    def _hold_a_mass_silence(self, term: AdmissionTerm, now: float) -> None:
        """A node believed alive falls silent with every other such node: judge none lost
        (every job would be requeued at once, more likely for this leader's or the
        network's fault than every node's) until one is heard again."""
        if not self._hearing(term):
            return
        believed_alive = self._believed_alive(term)
        if term.watch.hold(believed_alive, now):
            metrics.MASS_SILENCE.labels("admission").set(1)
            log.warning("mass silence: every node (%s) fell silent at once; no node is "
                        "judged lost until one is heard again",
                        ", ".join(sorted(r.node.node_id for r in believed_alive)))

    # --- requests (leader side) ---------------------------------------------------------

    async def _on_submit(self, term: AdmissionTerm, request: SubmitRequest) -> JobRecord:
        try:
            # Against the registry as this instance hears it: the core learns of a node
            # through its event queue, which a long pass holds up.
            if self._capacity is None:
                self._capacity = core.Capacity.of(r.node.slots
                                                  for r in self.node_records.values())
            term.core.validate(request.spec, self._capacity)
        except core.SpecRejected as exc:
            raise RequestRefused("400", f"job spec refused: {exc}") from None
        now = time.time()
        # The job's trace is its submission's (the submitting client's, when it traces; a
        # new one when it does not): later decisions and scaling events join it.
        with telemetry.tracer().start_as_current_span(
                "job submitted", attributes={"phalanx.job": request.job_id,
                                             "phalanx.team": request.spec.team}):
            trace = telemetry.traceparent()
        record = JobRecord(job_id=request.job_id, spec=request.spec, state=JobState.PENDING,
                           submitted_at=now, updated_at=now, reason_code=ReasonCode.QUEUED,
                           reason="submitted; waiting for the next admission pass",
                           trace=trace)
        try:
            await self.jobs.create(request.job_id, record)
        except Conflict:
            existing = await self.jobs.get(request.job_id)
            if existing is not None and existing.value.spec == request.spec:
                return existing.value  # a retried submit: same job, nothing new
            raise RequestRefused("409", f"job id {request.job_id!r} already exists with a "
                                        "different spec") from None
        term.traces[request.job_id] = record.trace
        term.events.put_nowait(core.JobSubmitted(request.job_id, request.spec, now,
                                                 event_id="submit"))
        return record

    async def _on_cancel(self, term: AdmissionTerm, request: JobRequest) -> JobRecord:
        now = time.time()

        def cancel(current: JobRecord | None) -> JobRecord:
            if current is None:
                raise RequestRefused("404", f"no job {request.job_id!r}")
            if current.state.terminal:
                return current
            return msgspec.structs.replace(
                current, state=JobState.CANCELLED, updated_at=now,
                reason_code=ReasonCode.CANCELLED, reason="cancelled by request", nodes=[],
                slots=[])

        entry = await self.jobs.modify(request.job_id, cancel)
        term.events.put_nowait(core.JobCancelled(request.job_id, event_id="cancel"))
        return entry.value

    async def _on_requeue(self, term: AdmissionTerm, request: RequeueRequest) -> JobRecord:
        entry = await self.jobs.get(request.job_id)
        if entry is None:
            raise RequestRefused("404", f"no job {request.job_id!r}")
        term.events.put_nowait(core.JobRequeued(request.job_id, request.reason,
                                                event_id="requeue"))
        return entry.value

    async def _on_scale(self, term: AdmissionTerm, request: ScaleRequest) -> JobRecord:
        """Pin a job's size (or release the pin): checked against its scaling rules, stored
        in its record (a new leader keeps it), then applied by the next pass."""
        gang = term.core.gangs.get(request.job_id)
        if gang is None:
            entry = await self.jobs.get(request.job_id)
            if entry is None:
                raise RequestRefused("404", f"no job {request.job_id!r}")
            raise RequestRefused("409", f"{request.job_id} is {entry.value.state.value}: "
                                        "nothing to scale")
        problem = term.core.pin_problem(request.job_id, request.replicas)
        if problem is not None:
            raise RequestRefused("409" if gang.state.terminal else "400",
                                 f"cannot scale {request.job_id}: {problem}")

        def pin(current: JobRecord | None) -> JobRecord:
            if current is None:
                raise RequestRefused("404", f"no job {request.job_id!r}")
            return msgspec.structs.replace(current, pinned_replicas=request.replicas)

        entry = await self.jobs.modify(request.job_id, pin)
        term.events.put_nowait(core.ScalePinned(request.job_id, request.replicas,
                                                event_id="scale"))
        return entry.value

    async def _on_explain(self, term: AdmissionTerm, request: JobRequest) -> Explanation:
        gang = term.core.gangs.get(request.job_id)
        if gang is None:
            entry = await self.jobs.get(request.job_id)
            if entry is None:
                raise RequestRefused("404", f"no job {request.job_id!r}")
            record = entry.value
            return Explanation(job_id=record.job_id, state=record.state,
                               reason_code=record.reason_code, reason=record.reason,
                               nodes=list(record.nodes))
        reason = term.core.explain(gang.job_id)
        position = term.core.position(gang.job_id)
        return Explanation(job_id=gang.job_id, state=gang.state, reason_code=reason.code,
                           reason=reason.message, position=position,
                           queue_length=len(term.core.queue), nodes=list(gang.nodes))

async def _joined(task: asyncio.Task[None]) -> None:
    """Wait for ``task`` (started before a task group), raising what it raised."""
    await task


def _placement(gang: core.Gang | None, now: float) -> JobPlacement | None:
    """What the ledger stores for ``gang`` now: None once it ended (or is unknown)."""
    if gang is None or gang.state.terminal:
        return None
    return JobPlacement(team=gang.team, slots_per_replica=gang.per_replica,
                        nodes=list(gang.nodes) if gang.state is JobState.ADMITTED else [],
                        updated_at=now)
