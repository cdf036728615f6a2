"""The agent's snapshot endpoints: a rank's ring of buffers, and a copy sent to another node.

A rank of a job running here asks once per membership for a ring of snapshot buffers in
the node's store (:meth:`SnapshotEndpoints.reserve`, ``phalanx.agent.<node>.snapshot``;
:mod:`.snapshots` bounds them, and a reservation past the bound is refused with 507).
A generation about to restore on another node asks this one for a snapshot shard it
holds a committed copy of (:meth:`SnapshotEndpoints.fetch`,
``phalanx.agent.<node>.fetch.<job>``): the copy is sent to that node's replication
listener (:mod:`.replication`) before the reply, which says how long it took.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection

from phalanx.bus.client import Delivery
from phalanx.bus.errors import RequestRefused
from phalanx.schemas.messages import (
    NodeRecord,
    ReplicaFetch,
    ReplicaFetched,
    SnapshotReservation,
    SnapshotReserve,
)
from phalanx.services.agent.replication import ReplicaSender
from phalanx.services.agent.snapshots import SnapshotRefused, SnapshotStore

log = logging.getLogger("phalanx.agent")


class SnapshotEndpoints:
    """The requests a node's snapshot store answers over the bus.

    Args:
        node_id: this node.
        store: the node's snapshot store.
        sender: sends this node's copies to other nodes' replication listeners.
        jobs_here: the jobs with a rank running (or launched) here.
        node_record: a node's record as the registry holds it now (None: it holds none).
    """

    def __init__(self, node_id: str, store: SnapshotStore, sender: ReplicaSender,
                 jobs_here: Callable[[], Collection[str]],
                 node_record: Callable[[str], Awaitable[NodeRecord | None]]) -> None:
        self.node_id = node_id
        self.store = store
        self.sender = sender
        self.jobs_here = jobs_here
        self.node_record = node_record

    async def reserve(self, request: SnapshotReserve, _: Delivery) -> SnapshotReservation:
        """Give a rank of a job running here a ring of snapshot buffers in this node's
        shared memory (404: no rank of the job runs here; 507: the node's bound would be
        passed)."""
        if request.job_id not in self.jobs_here():
            raise RequestRefused("404", f"no rank of {request.job_id!r} runs on {self.node_id}")
        try:
            paths = self.store.reserve(request)
        except SnapshotRefused as exc:
            log.warning("snapshot refused", extra={"job": request.job_id, "reason": str(exc)})
            raise RequestRefused("507", str(exc)) from None
        return SnapshotReservation(node_id=self.node_id, paths=[str(p) for p in paths],
                                   detail=f"{len(paths)} x {request.nbytes} B")

    async def fetch(self, request: ReplicaFetch, _: Delivery) -> ReplicaFetched:
        """Send the copy this node holds of a snapshot shard to another node's replication
        listener, for a generation about to restore there (404: no committed copy here,
        or no such node; 409: the node is this one; 503: it could not be sent)."""
        node = self.node_id
        what = (f"shard {request.shard}/{request.shards}"
                f"{f' of column {request.column}' if request.column else ''} of "
                f"{request.job_id} step {request.step}")
        if request.to_node == node:
            raise RequestRefused("409", f"{what} is asked for {node}, which is this node")
        found = self.store.copy_of(request.job_id, request.step, request.shards,
                                   request.shard, request.column)
        if found is None:
            raise RequestRefused("404", f"{node} holds no committed copy of {what}")
        record = await self.node_record(request.to_node)
        if record is None or not record.node.replica_port:
            raise RequestRefused("404", f"node {request.to_node} is not registered with a "
                                        "replication listener")
        path, header, owner = found
        address = (request.to_node, record.node.host, record.node.replica_port)
        started = time.monotonic()
        try:
            problem = await self.sender.send_copy(address, path, header, owner or node)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            problem = f"sending to {address[1]}:{address[2]} failed: {exc!r}"
        if problem:
            log.warning("fetch refused", extra={"job": request.job_id, "what": what,
                                                "to": request.to_node, "reason": problem})
            raise RequestRefused("503", f"{what} not taken by {request.to_node}: {problem}")
        seconds = time.monotonic() - started
        log.info("fetched", extra={"job": request.job_id, "what": what, "to": request.to_node,
                                   "bytes": header.meta_length + header.length,
                                   "seconds": round(seconds, 3)})
        return ReplicaFetched(node_id=node, nbytes=header.meta_length + header.length,
                              seconds=seconds)
