"""The admission ledger's storage: reading it whole, writing a pass's changes.

:mod:`.ledger` says what to write and in which order; this module does it against the
``phalanx_admission`` bucket, each key compare-and-swapped on the revision this
instance last read or wrote, and keeps that view (placements, claims, revisions). A
write that finds its key moved on means another instance wrote it: the leader stops
acting (:class:`~phalanx.services.lease.LeadershipLost`) rather than guess.

:meth:`LedgerStore.phases` hands out a plan's writes one by one, phase by phase, so
that a test can interleave the writes of several instances; :meth:`LedgerStore.write`
runs each phase's writes at once, and when one fails it cancels the others and waits
for them (:func:`~phalanx.bus.tasks.concurrently`): none lands after the leader stepped
down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Any

from nats.js.kv import KeyValue

from phalanx.bus.errors import Conflict
from phalanx.bus.kv import TypedKV
from phalanx.bus.tasks import concurrently
from phalanx.schemas.messages import JobPlacement, NodeClaims
from phalanx.services.admission import ledger
from phalanx.services.lease import LeadershipLost

Write = Callable[[], Coroutine[Any, Any, None]]


class LedgerStore:
    """One instance's view of the stored ledger, and the writes that keep it current.

    Attributes:
        stored: every job's stored placement, empty ones included.
        claims: every node's stored claims.
        unreadable: jobs whose stored placement does not decode (replaced at its revision
            by the next write of that job).
    """

    def __init__(self, kv: KeyValue, bucket: str) -> None:
        self.placements = TypedKV(kv, bucket, JobPlacement)
        self.nodes = TypedKV(kv, bucket, NodeClaims)
        self.stored: dict[str, JobPlacement] = {}
        self.claims: dict[str, dict[str, int]] = {}
        self.unreadable: set[str] = set()
        self._job_revisions: dict[str, int] = {}
        self._node_revisions: dict[str, int] = {}

    async def load(self) -> None:
        """Read every placement and every node's claims (an undecodable claims record
        reads as no claims: the placements say what its node holds, and it is rewritten)."""
        placements = await self.placements.currents(ledger.JOB_PREFIX)
        claims = await self.nodes.currents(ledger.NODE_PREFIX)
        self.stored.clear()
        self.claims.clear()
        self.unreadable.clear()
        self._job_revisions.clear()
        self._node_revisions.clear()
        for key, (placement, revision) in placements.items():
            job = key.removeprefix(ledger.JOB_PREFIX)
            self._job_revisions[job] = revision
            if placement is None:
                self.unreadable.add(job)
            else:
                self.stored[job] = placement
        for key, (record, revision) in claims.items():
            node = key.removeprefix(ledger.NODE_PREFIX)
            self._node_revisions[node] = revision
            self.claims[node] = dict(record.claims) if record is not None else {}

    def phases(self, plan: ledger.WritePlan) -> list[list[Write]]:
        """``plan``'s writes in its three phases; each updates this view when it lands."""
        return [[self._placement_write(job, p) for job, p in plan.shrink.items()],
                [self._claims_write(node, held) for node, held in plan.claims.items()],
                [self._placement_write(job, p) for job, p in plan.grow.items()]]

    async def write(self, plan: ledger.WritePlan) -> None:
        """Make ``plan``'s writes, each phase's at once.

        Raises:
            LeadershipLost: a key had moved on since this instance read or wrote it.
        """
        for phase in self.phases(plan):
            await concurrently(write() for write in phase)

    def _placement_write(self, job: str, placement: JobPlacement | None) -> Write:
        key = ledger.job_key(job)

        async def write() -> None:
            revision = self._job_revisions.get(job, 0)
            try:
                if placement is None:
                    if revision:
                        await self.placements.delete(key, revision=revision)
                    self._job_revisions.pop(job, None)
                    self.stored.pop(job, None)
                else:
                    self._job_revisions[job] = await (
                        self.placements.update(key, placement, revision) if revision
                        else self.placements.create(key, placement))
                    self.stored[job] = placement
                self.unreadable.discard(job)
            except Conflict:
                raise LeadershipLost(f"the placement of {job} was written by another "
                                     "admission instance") from None

        return write

    def _claims_write(self, node: str, held: dict[str, int]) -> Write:
        key = ledger.node_key(node)

        async def write() -> None:
            revision = self._node_revisions.get(node, 0)
            value = NodeClaims(claims=held, updated_at=time.time())
            try:
                self._node_revisions[node] = await (
                    self.nodes.update(key, value, revision) if revision
                    else self.nodes.create(key, value))
            except Conflict:
                raise LeadershipLost(f"the claims on node {node} were written by another "
                                     "admission instance") from None
            self.claims[node] = held

        return write

