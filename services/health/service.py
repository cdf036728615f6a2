"""The health service's shell: signals in, faults and node verdicts out.

Feeds the pure :class:`~.core.HealthCore` from the bus — rank starts and
exits from agents, per-step progress from ranks, node heartbeats, and job
records (an admitted job is watched with its placement and hang timeout;
anything else ends the watch) — and carries out its decisions: a
:class:`Fault` on ``phalanx.job.<job>.fault``, a
:class:`NodeConditionChanged` on ``phalanx.node.<node>.condition``, a
cordon written to the node's registry entry, a finished job's record.

Time-based rules (hangs, lost nodes) run when they are due: the timer sleeps
exactly until :meth:`HealthCore.next_deadline` and is woken whenever an
event moves that deadline, so detection latency is scheduling latency, not a
polling period. Each fault is published inside the span of the message that
caused it (a rank's exit, a heartbeat), or of its own "detect" span for a
timeout, so one trace runs from the agent that saw the signal to the fault.

State is rebuilt from the jobs bucket at start; run one instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import msgspec

from phalanx.bus import telemetry
from phalanx.bus.client import Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Fault,
    JobRecord,
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
from phalanx.services.base import Service
from phalanx.services.health import core

log = logging.getLogger("phalanx.health")


class HealthService(Service):
    """Turns heartbeats, progress and exits into faults, within a bound a user sets."""

    description = "phalanx failure detection"

    def __init__(self, policy: core.HealthPolicy, bus_config: BusConfig | None = None, *,
                 instance: str = "health") -> None:
        super().__init__("phalanx-health", instance, bus_config)
        self.core = core.HealthCore(policy)
        self._rearm = asyncio.Event()
        self.faults_published = 0
        # (job, rank) -> the replica last started in that slot, named in its faults.
        self.replicas: dict[tuple[str, int], str] = {}

    async def setup(self) -> None:
        assert self.bus is not None
        self.jobs = await TypedKV.open(self.bus.js, subjects.JOBS_BUCKET, JobRecord)
        self.nodes = await TypedKV.open(self.bus.js, subjects.NODES_BUCKET, NodeRecord)
        records, _ = await self.jobs.entries()
        for entry in records:
            await self._job_state(entry.value)
        bus = self.bus
        await bus.subscribe(subjects.job_states(), JobRecord, lambda r, d: self._job_state(r))
        await bus.subscribe(subjects.job_events("started"), RankStarted, self._on_started)
        await bus.subscribe(subjects.job_events("exited"), RankExited, self._on_exited)
        await bus.subscribe(subjects.health_ranks(), RankProgress, self._on_progress)
        await bus.subscribe(subjects.node_heartbeats(), NodeHeartbeat, self._on_heartbeat)
        await bus.subscribe(f"{subjects.PREFIX}.node.*.condition", NodeConditionChanged,
                            self._on_condition)
        self.spawn(self._timer(), "deadlines")

    # --- events in ----------------------------------------------------------------------

    async def _feed(self, event: object) -> None:
        decisions = self.core.handle(event, time.time())  # type: ignore[arg-type]
        await self._execute(decisions)
        self._rearm.set()  # the next deadline may have moved

    async def _job_state(self, record: JobRecord) -> None:
        if record.state is JobState.ADMITTED:
            await self._feed(core.JobWatched(record.job_id, tuple(record.nodes),
                                             record.spec.hang_timeout_s, tuple(record.slots)))
        elif record.job_id in self.core.jobs:
            await self._feed(core.JobEnded(record.job_id))
            for key in [k for k in self.replicas if k[0] == record.job_id]:
                del self.replicas[key]

    async def _on_started(self, msg: RankStarted, _: Delivery) -> None:
        if msg.replica_id is not None:
            self.replicas[(msg.job_id, msg.rank)] = msg.replica_id
        await self._feed(core.RankStarted(msg.job_id, msg.rank, msg.node_id, msg.pid))

    async def _on_exited(self, msg: RankExited, _: Delivery) -> None:
        if msg.replica_id is not None:
            self.replicas.setdefault((msg.job_id, msg.rank), msg.replica_id)
        await self._feed(core.RankExited(msg.job_id, msg.rank, msg.node_id, msg.exit_code,
                                         msg.signal, msg.cause.value))

    async def _on_progress(self, msg: RankProgress, _: Delivery) -> None:
        await self._feed(core.ProgressReported(msg.job_id, msg.rank, msg.step, msg.step_time_s,
                                                        msg.final))

    async def _on_heartbeat(self, msg: NodeHeartbeat, _: Delivery) -> None:
        await self._feed(core.NodeHeartbeat(msg.node_id))

    async def _on_condition(self, msg: NodeConditionChanged, _: Delivery) -> None:
        if msg.condition is NodeCondition.UNCORDONED:
            await self._feed(core.NodeUncordoned(msg.node_id))

    async def _timer(self) -> None:
        """Run :meth:`HealthCore.tick` exactly when the next deadline passes."""
        while not self.stopping:
            deadline = self.core.next_deadline()
            self._rearm.clear()
            delay = None if deadline is None else max(0.0, deadline - time.time())
            if delay is None or delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._rearm.wait(), delay)
                if deadline is None or time.time() < deadline:
                    continue  # woken early: recompute
            with telemetry.tracer().start_as_current_span("detect timeouts"):
                await self._execute(self.core.tick(time.time()))

    # --- decisions out ------------------------------------------------------------------

    async def _execute(self, decisions: list[core.Decision]) -> None:
        assert self.bus is not None
        now = time.time()
        for decision in decisions:
            match decision:
                case core.RaiseFault():
                    fault = Fault(fault_id=uuid.uuid4().hex[:16], job_id=decision.job_id,
                                  kind=decision.kind, node_id=decision.node_id,
                                  detected_at=now, rank=decision.rank,
                                  exit_code=decision.exit_code, signal=decision.signal,
                                  detail=decision.detail,
                                  replica_id=self.replicas.get((decision.job_id, decision.rank)))
                    await self.bus.publish(subjects.job_fault(decision.job_id), fault)
                    self.faults_published += 1
                    log.warning("fault", extra={"job": fault.job_id, "kind": fault.kind.value,
                                                "rank": fault.rank, "node": fault.node_id,
                                                "detail": fault.detail})
                case core.MarkNodeLost():
                    await self._condition(decision.node_id, NodeCondition.LOST, decision.reason)
                case core.MarkNodeAlive():
                    await self._condition(decision.node_id, NodeCondition.ALIVE,
                                          decision.reason)
                case core.CordonNode():
                    await self.nodes.modify(decision.node_id, lambda r: _cordon(r, True))
                    await self._condition(decision.node_id, NodeCondition.CORDONED,
                                          decision.reason)
                case core.FinishJob():
                    await self._finish(decision.job_id, now)
                case _:
                    raise TypeError(f"unknown decision {decision!r}")

    async def _condition(self, node_id: str, condition: NodeCondition, reason: str) -> None:
        assert self.bus is not None
        log.warning("node %s", condition.value, extra={"node": node_id, "reason": reason})
        await self.bus.publish(subjects.node_condition(node_id), NodeConditionChanged(
            node_id=node_id, condition=condition, reason=reason, at=time.time()))

    async def _finish(self, job_id: str, now: float) -> None:
        assert self.bus is not None

        def finish(current: JobRecord | None) -> JobRecord:
            if current is None or current.state.terminal:
                return current  # type: ignore[return-value]
            return msgspec.structs.replace(current, state=JobState.FINISHED, updated_at=now,
                                           reason_code=ReasonCode.FINISHED,
                                           reason="every rank exited 0", nodes=[], slots=[])

        if await self.jobs.get(job_id) is None:
            return
        entry = await self.jobs.modify(job_id, finish)
        await self.bus.publish(subjects.job_state(job_id), entry.value)


def _cordon(record: NodeRecord | None, cordoned: bool) -> NodeRecord:
    if record is None:
        raise LookupError("the node left the registry")
    return msgspec.structs.replace(record, cordoned=cordoned)
