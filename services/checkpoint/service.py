"""The checkpoint service's shell: snapshot announcements in, the catalog in KV out.

Any number of instances run; the holder of the ``checkpoint`` lease keeps the
catalog (:mod:`.core`). It restores every job's catalog from the
``phalanx_checkpoints`` bucket at the start of its term, follows the job
records (a job's ``checkpoint.memory_keep`` and ``durable_keep``; an ended
job's memory snapshots are deleted by its agents, so its catalog keeps only
its durable steps), and takes in every
``SnapshotRecord`` on ``phalanx.ckpt.<job>.snapshot``. Changed catalogs are
written at most every :data:`STORE_EVERY_S` (the newest catalog of a job is
what counts; ranks announce a snapshot every step), fenced on the revision
this leader last wrote.

Announcements are plain publishes, not stream events: a memory snapshot is
superseded by the next one within one interval, so one missed while no leader
listened is corrected by the next, and the ranks restore from their nodes'
memory without asking the catalog (docs/checkpoints.md).

The leader also places buddies (:func:`.core.place_buddies`): every
:data:`PLACE_EVERY_S` it reads the node registry and stores each live node's
placement in the ``phalanx_buddies`` bucket (key = node id), where the node's
agent reads it. A bucket of their own rather than a field of the node record:
the agent rewrites its record every heartbeat, and a second writer there would
turn every placement into a compare-and-swap race with it; a placement changes
rarely, and an agent reads only its own key.

Every instance answers ``phalanx.ckpt.resume`` from the stored catalog (the
same pure rule, :func:`.core.resume_answer`), so a question needs no leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from phalanx.bus.client import Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import Conflict
from phalanx.bus.kv import Change
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    BuddyPlacement,
    CheckpointCatalog,
    JobRecord,
    Lease,
    NodeRecord,
    ResumeAnswer,
    ResumeRequest,
    SnapshotRecord,
)
from phalanx.schemas.registry import DEFAULT_LOST_AFTER_S, Heard, heard
from phalanx.services import metrics
from phalanx.services.checkpoint import core
from phalanx.services.leader import LeaderService
from phalanx.services.lease import LeadershipLost

log = logging.getLogger("phalanx.checkpoint")
LEASE_KEY = "checkpoint"
STORE_EVERY_S = 0.5
PLACE_EVERY_S = 1.0


class CheckpointService(LeaderService[core.CheckpointCore]):
    """Keeps the catalog of every job's snapshots; answers where a job can resume."""

    description = "phalanx checkpoint catalog"
    service_name = "phalanx-checkpoint"
    lease_key = LEASE_KEY
    metric_families = metrics.LEADERSHIP

    def __init__(self, bus_config: BusConfig | None = None, *, instance: str | None = None,
                 lease_s: float = 3.0, lost_after_s: float = DEFAULT_LOST_AFTER_S) -> None:
        super().__init__(bus_config, instance=instance, lease_s=lease_s)
        self.lost_after_s = lost_after_s

    async def setup(self) -> None:
        self.catalogs = await self.bucket(subjects.CHECKPOINTS_BUCKET, CheckpointCatalog)
        self.jobs = await self.bucket(subjects.JOBS_BUCKET, JobRecord)
        self.nodes = await self.bucket(subjects.NODES_BUCKET, NodeRecord)
        self.buddies = await self.bucket(subjects.BUDDIES_BUCKET, BuddyPlacement)
        leases = await self.bucket(subjects.LEASES_BUCKET, Lease)
        await self.add_endpoint("resume", subjects.ckpt_resume(), ResumeRequest,
                                self.on_resume)
        self.start_leadership(leases)

    async def on_resume(self, request: ResumeRequest, _: Delivery) -> ResumeAnswer:
        entry = await self.catalogs.get(request.job_id)
        return core.resume_answer(None if entry is None else entry.value, request.job_id,
                                  request.world_size, at_nodes=request.at_nodes,
                                  memory_only=request.memory_only, column=request.column)

    def begin_term(self) -> core.CheckpointCore:
        return core.CheckpointCore()

    async def lead(self, the_core: core.CheckpointCore) -> None:
        """Restore the catalogs, then take in records and announcements until cancelled."""
        assert self.bus is not None
        revisions: dict[str, int] = {}
        stored, bad = await self.catalogs.entries()
        for error in bad:
            log.error("unreadable catalog skipped: %s", error)
        for entry in stored:
            the_core.restore(entry.value)
            revisions[entry.key] = entry.revision
        placements, bad = await self.buddies.entries()
        for error in bad:
            log.error("unreadable buddy placement skipped: %s", error)
        for placed in placements:
            the_core.restore_buddy(placed.value)
        log.info("restored", extra={"jobs": len(the_core.catalogs),
                                    "buddies": len(the_core.buddies)})
        changed: dict[str, core.Decision] = {}

        def act(decisions: list[core.Decision]) -> None:
            for decision in decisions:  # a job's events decide about its catalog alone
                match decision:
                    case core.StoreCatalog(catalog=catalog):
                        changed[catalog.job_id] = decision
                    case core.ForgetCatalog(job_id=job_id):
                        changed[job_id] = decision
                    case _:
                        raise TypeError(f"unexpected decision {decision!r}")

        async def on_snapshot(record: SnapshotRecord, _: Delivery) -> None:
            act(the_core.handle(core.SnapshotAnnounced(record)))

        records = self.jobs.follow(self.bus.resync_event())
        sub = await self.bus.subscribe(subjects.any_id(subjects.ckpt_snapshot),
                                       SnapshotRecord, on_snapshot)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._follow_jobs(the_core, records, act))
                tasks.create_task(self._store(changed, revisions))
                tasks.create_task(self._place(the_core))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            await records.aclose()

    async def _follow_jobs(self, the_core: core.CheckpointCore,
                           records: AsyncIterator[Change[JobRecord] | None],
                           act: Callable[[list[core.Decision]], None]) -> None:
        async for change in records:
            if change is None:
                continue
            record = change.value
            if record is not None:
                policy = record.spec.checkpoint
                act(the_core.handle(core.JobSeen(record.job_id, policy.memory_keep,
                                                 policy.durable_keep)))
            if record is None or record.state.terminal:
                act(the_core.handle(core.JobEnded(change.key)))

    async def _place(self, the_core: core.CheckpointCore) -> None:
        """Every PLACE_EVERY_S, place buddies on the registry as read now and store what
        changed. Silence before this term proves nothing (the node may have beaten while
        no leader read), so a node is judged lost only after silence within the term;
        each heartbeat is timed by the first read that held it, so the agents' clocks
        may be off."""
        since = time.time()
        read: dict[str, Heard] = {}
        while not await self.sleep_or_stop(PLACE_EVERY_S):
            try:
                entries, _ = await self.nodes.entries()
            except Exception as exc:  # the bus away: placements stay as they are
                log.warning("cannot read the node registry: %s", exc)
                continue
            now = time.time()
            records = tuple(e.value for e in entries)
            read = {r.node.node_id: heard(read.get(r.node.node_id), r, now) for r in records}
            decisions = the_core.handle(core.NodesSeen(
                records, now, self.lost_after_s, since,
                heard_at={node_id: h.at for node_id, h in read.items()}))
            for decision in decisions:
                match decision:
                    case core.StoreBuddy(placement=placement):
                        await self.buddies.put(placement.node_id, placement)
                        log.info("buddy placed", extra={
                            "node": placement.node_id, "buddy": placement.buddy_id,
                            "reason": placement.reason.value})
                    case core.ForgetBuddy(node_id=node_id):
                        await self.buddies.delete(node_id)
                    case _:
                        raise TypeError(f"unknown decision {decision!r}")

    async def _store(self, changed: dict[str, core.Decision], revisions: dict[str, int]) -> None:
        """Write what changed, at most every STORE_EVERY_S, fenced on our revisions."""
        while not await self.sleep_or_stop(STORE_EVERY_S):
            batch = dict(changed)
            changed.clear()
            for job_id, decision in batch.items():
                try:
                    match decision:
                        case core.StoreCatalog(catalog=catalog):
                            revision = revisions.get(job_id)
                            revisions[job_id] = (
                                await self.catalogs.update(job_id, catalog, revision)
                                if revision is not None
                                else await self.catalogs.create(job_id, catalog))
                        case core.ForgetCatalog():
                            revision = revisions.pop(job_id, None)
                            if revision is not None:
                                await self.catalogs.delete(job_id, revision=revision)
                        case _:
                            raise TypeError(f"unknown decision {decision!r}")
                except Conflict:
                    raise LeadershipLost(f"the catalog of {job_id} was written by another "
                                         "instance") from None
