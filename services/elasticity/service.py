"""The elasticity service's shell: faults and readiness in, generations and replacements out.

Feeds the pure :class:`~.core.ElasticityCore` from the bus:

* job records (the jobs bucket at start, then ``phalanx.job.*.state``): an
  admitted job starts, anything else stops it;
* ``phalanx.job.*.fault`` from health (crash, hang, node lost; stragglers
  are reported, not dropped);
* ``phalanx.job.*.ready`` and ``phalanx.job.*.applied`` from the runtime in
  every rank, and ``phalanx.job.*.exited`` from agents (a member that exits 0
  completes the training).

and carries out its decisions: a generation is stored in the
``phalanx_generations`` bucket (so a late or restarted rank reads the
current one) and then published on ``phalanx.job.<job>.generation``; a
replacement is a :class:`LaunchReplica` request to the agent that holds the
slot, and a replica no longer needed a :class:`StopReplica`; a job below its
minimum for too long is handed back to admission.

A job is only managed once one of its replicas reports ready: jobs that do
not use the runtime never get generations or replacements. Each generation is
published inside the span of the fault or report that caused it, so a
recovery is one trace from the agent that saw the exit to every rank's
phases. On restart the service takes over the stored generations of jobs
still admitted; run one instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from phalanx.bus import telemetry
from phalanx.bus.client import Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import (
    Fault,
    FaultKind,
    Generation,
    GenerationApplied,
    JobRecord,
    JobState,
    LaunchReplica,
    RankExited,
    ReplicaReady,
    ReplicaReply,
    RequeueRequest,
    StopReplica,
)
from phalanx.services.base import Service
from phalanx.services.elasticity import core

log = logging.getLogger("phalanx.elasticity")
AGENT_TIMEOUT_S = 10.0


class ElasticityService(Service):
    """Owns the membership of every running job as a sequence of generations."""

    description = "phalanx membership of running jobs"

    def __init__(self, elasticity: core.ElasticityCore, bus_config: BusConfig | None = None, *,
                 instance: str = "elasticity") -> None:
        super().__init__("phalanx-elasticity", instance, bus_config)
        self.core = elasticity
        self.records: dict[str, JobRecord] = {}  # admitted jobs, not yet managed
        self.early_faults: dict[str, list[Fault]] = {}  # of those, replayed once managed
        self._wake = asyncio.Event()

    async def setup(self) -> None:
        assert self.bus is not None
        js = self.bus.js
        self.jobs = await TypedKV.open(js, subjects.JOBS_BUCKET, JobRecord)
        self.generations = await TypedKV.open(js, subjects.GENERATIONS_BUCKET, Generation)
        records, _ = await self.jobs.entries()
        admitted = {e.value.job_id: e.value for e in records
                    if e.value.state is JobState.ADMITTED}
        stored, _ = await self.generations.entries()
        for entry in stored:
            record = admitted.get(entry.key)
            if record is None:
                await self.generations.delete(entry.key)
                continue
            replicas = record.spec.replicas
            self.core.restore(entry.value, record.placement(), replicas.min, replicas.max)
        for record in admitted.values():
            await self._job_state(record)
        bus = self.bus
        await bus.subscribe(subjects.job_states(), JobRecord, lambda r, d: self._job_state(r))
        await bus.subscribe(subjects.job_events("fault"), Fault, self._on_fault)
        await bus.subscribe(subjects.job_events("ready"), ReplicaReady, self._on_ready)
        await bus.subscribe(subjects.job_events("applied"), GenerationApplied, self._on_applied)
        await bus.subscribe(subjects.job_events("exited"), RankExited, self._on_exited)
        self.spawn(self._waits(), "waits")

    # --- events in ----------------------------------------------------------------------

    async def _feed(self, event: core.Event) -> None:
        await self._execute(self.core.handle(event, time.time()))
        self._wake.set()

    async def _job_state(self, record: JobRecord) -> None:
        job_id = record.job_id
        if record.state is JobState.ADMITTED:
            if job_id not in self.core.jobs:
                self.records[job_id] = record
            else:  # shrunk (a node lost) or grown: slots that stay keep their numbers
                await self._feed(core.PlacementChanged(job_id, record.placement(),
                                                       event_id="record"))
            return
        self.records.pop(job_id, None)
        self.early_faults.pop(job_id, None)
        if job_id in self.core.jobs:
            await self._feed(core.JobStopped(job_id, event_id="record"))
        with contextlib.suppress(PhalanxError):
            await self.generations.delete(job_id)

    async def _on_ready(self, msg: ReplicaReady, _: Delivery) -> None:
        record = self.records.pop(msg.job_id, None)
        if record is not None:  # the first ready replica: the job uses the runtime
            replicas = record.spec.replicas
            await self._feed(core.JobStarted(msg.job_id, record.placement(), replicas.min,
                                             replicas.max, event_id="admitted"))
            for fault in self.early_faults.pop(msg.job_id, []):
                await self._on_fault(fault, _)
        await self._feed(core.ReplicaReady(msg.job_id, msg.replica_id, msg.node_id, msg.slot,
                                           msg.endpoint, event_id=f"ready:{msg.replica_id}"))

    async def _on_fault(self, fault: Fault, _: Delivery) -> None:
        if fault.kind is FaultKind.STRAGGLER or fault.replica_id is None:
            return
        if fault.job_id in self.records:  # before the job's first ready replica
            self.early_faults.setdefault(fault.job_id, []).append(fault)
            return
        await self._feed(core.MemberFailed(
            fault.job_id, fault.replica_id, f"{fault.kind.value}: {fault.detail}".rstrip(": "),
            replaceable=fault.kind is not FaultKind.NODE_LOST, event_id=fault.fault_id))

    async def _on_applied(self, msg: GenerationApplied, _: Delivery) -> None:
        await self._feed(core.GenerationApplied(msg.job_id, msg.generation, msg.replica_id,
                                                msg.committed_step,
                                                event_id=f"applied:{msg.replica_id}"))

    async def _on_exited(self, msg: RankExited, _: Delivery) -> None:
        if msg.exit_code == 0 and msg.replica_id is not None:
            await self._feed(core.MemberFinished(msg.job_id, msg.replica_id,
                                                 event_id=f"exited:{msg.replica_id}"))

    async def _waits(self) -> None:
        """Requeue jobs left below their minimum for too long (checked every second)."""
        while not await self.sleep_or_stop(1.0):
            await self._execute(self.core.tick(time.time()))

    # --- decisions out ------------------------------------------------------------------

    async def _execute(self, decisions: list[core.Decision]) -> None:
        assert self.bus is not None
        for decision in decisions:
            match decision:
                case core.PublishGeneration(generation=g):
                    with telemetry.tracer().start_as_current_span(
                            f"generation {g.generation}", attributes={
                                "phalanx.job": g.job_id, "phalanx.generation": g.generation,
                                "phalanx.world_size": g.world_size,
                                "phalanx.reason": g.reason.value}):
                        await self.generations.put(g.job_id, g)
                        await self.bus.publish(subjects.job_generation(g.job_id), g)
                    log.info("generation", extra={"job": g.job_id, "generation": g.generation,
                                                  "world_size": g.world_size,
                                                  "reason": g.reason.value, "cause": g.cause})
                case core.LaunchReplacement() | core.StopReplica():
                    self.spawn(self._to_agent(decision), f"agent {decision.replica_id}")
                case core.Requeue():
                    self.spawn(self._requeue(decision), f"requeue {decision.job_id}")
                case _:
                    raise TypeError(f"unknown decision {decision!r}")

    async def _to_agent(self, decision: core.LaunchReplacement | core.StopReplica) -> None:
        """Ask the slot's agent to start (or stop) a replica; a failure is logged."""
        assert self.bus is not None
        request: LaunchReplica | StopReplica
        if isinstance(decision, core.LaunchReplacement):
            request = LaunchReplica(job_id=decision.job_id, slot=decision.slot,
                                    replica_id=decision.replica_id)
            subject = subjects.agent_launch(decision.node_id)
        else:
            request = StopReplica(job_id=decision.job_id, slot=decision.slot,
                                  replica_id=decision.replica_id)
            subject = subjects.agent_stop(decision.node_id)
        context = {"job": decision.job_id, "replica": decision.replica_id,
                   "node": decision.node_id, "request": type(request).__name__}
        try:
            reply = await self.bus.request(subject, request, ReplicaReply,
                                           timeout_s=AGENT_TIMEOUT_S)
        except PhalanxError as exc:
            log.warning("agent request failed", extra={**context, "error": str(exc)})
            return
        log.info("agent request done", extra={**context, "detail": reply.detail})

    async def _requeue(self, decision: core.Requeue) -> None:
        assert self.bus is not None
        try:
            await self.bus.request(subjects.admission_requeue(),
                                   RequeueRequest(job_id=decision.job_id, reason=decision.reason),
                                   JobRecord, timeout_s=AGENT_TIMEOUT_S)
        except PhalanxError as exc:
            log.error("requeue failed", extra={"job": decision.job_id, "error": str(exc)})
