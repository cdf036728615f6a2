"""Before a restore from memory: shards that no member's node holds are fetched onto one.

A restore (:func:`.snapshot.restore`) reads what the members' nodes hold, their
own snapshots and the replicas their agents keep for their buddies. After a
whole-job loss the new generation's members need not be where the copies
are: a lost node's shards live on its buddy, which may run no member (it is
full, cordoned, or the job was placed elsewhere). Then a restore from memory
would find no complete step, and the job would fall back to durable storage
or start over while the step sat in a live node's memory.

So before the restore, when no member holds the step the job had reached,
the members ask the checkpoint service which step is complete in memory
anywhere (:func:`phalanx.services.checkpoint.core.resume_answer` with
``at_nodes`` and ``memory_only``). For each shard of it that no member's node
holds, one member asks the agent of a node that does to send its copy to the
member's own node (:class:`~phalanx.schemas.messages.ReplicaFetch`, on a subject
naming the job: a rank may ask for its own job's shards only), agent to agent,
over the replication stream, where it lands as a replica, checksummed
and announced like any other. The shards are split among the members, so the
copies travel in parallel and each member waits for its own share only.

Everything here is best effort: a catalog that cannot be asked, a holder that
is gone or refuses, a copy overwritten meanwhile, is logged and skipped; the
restore then works from what the members' nodes hold, as before. A member
waits for its fetches at most :data:`FETCH_SHARE` of the collective timeout,
so that the members meet in the restore's first collective before it times
out and the generation is not given up for a slow copy (one still under way
lands anyway, for a later restore). The catalog may also be behind the stores
(a ring overwrote a buffer it lists): the restore's own agreement on what the
members hold decides, never the catalog.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from phalanx.runtime.state import broadcast_bytes
from phalanx.schemas import subjects
from phalanx.schemas.codec import decode, encode
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import (
    Generation,
    ReplicaFetch,
    ReplicaFetched,
    ResumeAnswer,
    ResumeRequest,
)

if TYPE_CHECKING:
    from phalanx.runtime.elastic import ElasticSession

log = logging.getLogger("phalanx.runtime")

#: How long the checkpoint service may take to say where the job's snapshots are.
CATALOG_TIMEOUT_S = 5.0
#: The share of the collective timeout a member may spend on its fetches: the members
#: then meet in the restore's first collective, which must not time out waiting for one.
FETCH_SHARE = 0.8


def plan_fetches(answer: ResumeAnswer, at_nodes: set[str], rank: int,
                 world_size: int) -> list[tuple[int, list[str]]]:
    """This member's share of the shards to fetch: ``(shard, its holders nearest
    first)`` for each shard of ``answer``'s step that no node of ``at_nodes`` holds,
    split round robin over the members (every member computes the same split)."""
    missing = [(shard, holders) for shard, holders in enumerate(answer.held_by)
               if holders and not at_nodes.intersection(holders)]
    return missing[rank::world_size]


def fetch_missing(s: ElasticSession, generation: Generation, newer_than: int) -> None:
    """A collective of the members of ``generation``: fetch onto the members' nodes the
    shards of the newest step complete in memory that those nodes lack, if it is newer
    than ``newer_than``. What this member fetched, and why any copy did not come, goes
    to the log and its record (``kind: fetch``)."""
    if s._snapshots is None or s.bus is None or s.bus.bus is None:
        return
    assert s.pg is not None and s.rank is not None
    at_nodes = sorted({m.node_id for m in generation.members})
    data: bytes | None = None
    if s.rank == 0:
        try:
            answer = s.bus.request(subjects.ckpt_resume(), ResumeRequest(
                job_id=s.job_id, world_size=s.world_size, at_nodes=at_nodes,
                memory_only=True), ResumeAnswer, CATALOG_TIMEOUT_S, s._heartbeat)
            data = encode(answer)
        except (PhalanxError, OSError) as exc:
            log.warning("%s: where the job's snapshots are is not known (%s): the restore "
                        "reads the members' nodes only", s.replica_id, exc)
            data = b""
    data = broadcast_bytes(s.pg, s._wait, s.rank, 0, data)
    if not data:
        return
    answer = decode(data, ResumeAnswer)
    if answer.step is None or answer.step <= newer_than:
        return
    mine = plan_fetches(answer, set(at_nodes), s.rank, s.world_size)
    if not mine:
        return
    started, nbytes = time.monotonic(), 0
    taken: list[int] = []  # the shards this member took, each from the first holder that sent it
    failed: list[str] = []  # why each refused or failed attempt brought no copy
    deadline = started + FETCH_SHARE * s.timeout.total_seconds()
    for shard, holders in mine:
        for holder in holders:
            left = deadline - time.monotonic()
            if left <= 0:
                # A copy still under way lands all the same: a later restore finds it.
                failed.append(f"shard {shard}: no time left (collective timeout "
                              f"{s.timeout.total_seconds():g} s)")
                break
            request = ReplicaFetch(job_id=s.job_id, step=answer.step, shard=shard,
                                   shards=answer.shards, to_node=s.node_id)
            try:
                reply = s.bus.request(subjects.agent_fetch(holder, s.job_id), request,
                                      ReplicaFetched, left, s._heartbeat)
            except (PhalanxError, OSError) as exc:
                failed.append(f"shard {shard} from {holder}: {exc}")
                log.warning("%s: shard %d of step %d not fetched from %s: %s", s.replica_id,
                            shard, answer.step, holder, exc)
                continue
            taken.append(shard)
            nbytes += reply.nbytes
            break
    seconds = time.monotonic() - started
    log.warning("%s fetched %d of %d shards of step %d onto %s (%d B, %.2f s)",
                s.replica_id, len(taken), len(mine), answer.step, s.node_id, nbytes, seconds)
    if s._record is not None:
        s._record.write(kind="fetch", generation=generation.generation, step=answer.step,
                        shards=taken, wanted=[shard for shard, _ in mine], state_bytes=nbytes,
                        seconds=round(seconds, 3), failed=failed)
