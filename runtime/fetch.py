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
refuses, a copy overwritten meanwhile, is logged and skipped; a holder whose
agent does not answer (down, restarting: its memory may be intact) is asked
again until the time is up, after the others (:func:`fetch_shard`); the
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
from collections.abc import Callable, Sequence

from phalanx.bus.errors import NoResponders
from phalanx.runtime.session_state import Seat, SessionState
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

log = logging.getLogger("phalanx.runtime")

#: How long the checkpoint service may take to say where the job's snapshots are.
CATALOG_TIMEOUT_S = 5.0
#: The share of the collective timeout a member may spend on its fetches: the members
#: then meet in the restore's first collective, which must not time out waiting for one.
FETCH_SHARE = 0.8
#: How often holders whose agents do not answer are asked again, within that share.
ASK_AGAIN_S = 0.5


def plan_fetches(answer: ResumeAnswer, at_nodes: set[str], rank: int,
                 world_size: int) -> list[tuple[int, list[str]]]:
    """This member's share of the shards to fetch: ``(shard, its holders nearest
    first)`` for each shard of ``answer``'s step that no node of ``at_nodes`` holds,
    split round robin over the members (every member computes the same split)."""
    missing = [(shard, holders) for shard, holders in enumerate(answer.held_by)
               if holders and not at_nodes.intersection(holders)]
    return missing[rank::world_size]


def fetch_missing(s: SessionState, seat: Seat, generation: Generation,
                  newer_than: int) -> None:
    """A collective of the members of ``generation``: fetch onto the members' nodes the
    shards of the newest step complete in memory that those nodes lack, if it is newer
    than ``newer_than``. What this member fetched, and why any copy did not come, goes
    to the log and its record (``kind: fetch``)."""
    if s.snapshots is None or s.bus is None or s.bus.bus is None:
        return
    at_nodes = sorted({m.node_id for m in generation.members})
    data: bytes | None = None
    if seat.rank == 0:
        try:
            answer = s.bus.request(subjects.ckpt_resume(), ResumeRequest(
                job_id=s.replica.job_id, world_size=seat.world_size, at_nodes=at_nodes,
                memory_only=True, column=s.column), ResumeAnswer, CATALOG_TIMEOUT_S,
                seat.heartbeat)
            data = encode(answer)
        except (PhalanxError, OSError) as exc:
            log.warning("%s: where the job's snapshots are is not known (%s): the restore "
                        "reads the members' nodes only", s.replica.replica_id, exc)
            data = b""
    data = broadcast_bytes(seat.pg, seat.wait, seat.rank, 0, data)
    if not data:
        return
    answer = decode(data, ResumeAnswer)
    if answer.step is None or answer.step <= newer_than:
        return
    mine = plan_fetches(answer, set(at_nodes), seat.rank, seat.world_size)
    if not mine:
        return
    started, nbytes = time.monotonic(), 0
    taken: list[int] = []  # the shards this member took, each from the first holder that sent it
    failed: list[str] = []  # why each refused or failed attempt brought no copy
    deadline = started + FETCH_SHARE * s.timeout.total_seconds()
    bus = s.bus

    def pause(seconds: float) -> None:
        seat.heartbeat()  # waiting for a holder's agent is not a hang
        s.inbox.sleep(seconds)

    for shard, holders in mine:
        request = ReplicaFetch(job_id=s.replica.job_id, step=answer.step, shard=shard,
                               shards=answer.shards, to_node=s.replica.node_id,
                               column=s.column)

        def ask(holder: str, left: float, request: ReplicaFetch = request) -> int:
            return bus.request(subjects.agent_fetch(holder, s.replica.job_id), request,
                               ReplicaFetched, left, seat.heartbeat).nbytes

        got, why = fetch_shard(ask, holders, deadline, time.monotonic, pause)
        failed += [f"shard {shard} {reason}" for reason in why]
        for reason in why:
            log.warning("%s: shard %d of step %d: %s", s.replica.replica_id, shard, answer.step,
                        reason)
        if got is not None:
            taken.append(shard)
            nbytes += got
    seconds = time.monotonic() - started
    log.warning("%s fetched %d of %d shards of step %d onto %s (%d B, %.2f s)",
                s.replica.replica_id, len(taken), len(mine), answer.step, s.replica.node_id,
                nbytes, seconds)
    if s.record is not None:
        s.record.write(kind="fetch", generation=generation.generation, step=answer.step,
                        shards=taken, wanted=[shard for shard, _ in mine], state_bytes=nbytes,
                        seconds=round(seconds, 3), failed=failed)


def fetch_shard(ask: Callable[[str, float], int], holders: Sequence[str], deadline: float,
                clock: Callable[[], float], pause: Callable[[float], None]
                ) -> tuple[int | None, list[str]]:
    """Ask ``holders`` in turn (``ask(holder, seconds left)``: the bytes it sent) until
    one sends the shard or ``deadline`` (on ``clock``) passes; the bytes (None: no copy
    came) and why each holder last failed. While every holder's agent is only silent
    (none listens: down, restarting), ask again every :data:`ASK_AGAIN_S`: a node's agent
    back within the deadline still serves the step its memory kept. A refusal (the copy
    is no longer there) is final for its holder."""
    why: dict[str, str] = {}
    asking = list(holders)
    while asking:
        silent = []
        for holder in asking:
            left = deadline - clock()
            if left <= 0:
                # A copy still under way lands all the same: a later restore finds it.
                return None, [*why.values(), "no time left to fetch it"]
            try:
                return ask(holder, left), list(why.values())
            except NoResponders as exc:
                why[holder] = f"from {holder}: {exc}"
                silent.append(holder)
            except (PhalanxError, OSError) as exc:
                why[holder] = f"from {holder}: {exc}"
        asking = silent
        if asking:
            pause(min(ASK_AGAIN_S, max(0.0, deadline - clock())))
    return None, list(why.values())
