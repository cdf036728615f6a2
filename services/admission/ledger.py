"""Admission's ledger as stored: which slots each job holds, written so that no slot is
ever given twice, and a pass writes only what it changed.

The ledger lives in the ``phalanx_admission`` bucket as two kinds of record:

* ``node.<node id>`` (:class:`~phalanx.schemas.messages.NodeClaims`): the slots reserved
  on that node, by job. A slot is given only through its node's record, compare-and-
  swapped on the revision the writer last saw, so two instances that both give a slot
  of the same node conflict and one of them steps down. Safety needs nothing else.
* ``job.<job id>`` (:class:`~phalanx.schemas.messages.JobPlacement`): what the job holds,
  one node id per replica. This is what a new leader restores jobs from.

JetStream KV has no transaction across keys, so a pass writes in three phases, each
key compare-and-swapped (:class:`WritePlan`): (1) placements that lose nodes shrink to
what they keep (a requeued job's to nothing, an ended job's key is deleted), (2) every
changed node's claims, (3) placements that gain nodes. Between any two writes — where
a crash may leave them — every placement names only slots its nodes' claims hold, and
no node's claims exceed what its core view gave, so the placements never give a slot
twice either.

A crash can leave claims no placement names (phase 2 done, phase 3 not; or phase 1
done, phase 2 not). A new leader finds them (:func:`restore`), and before it releases
them it rewrites the placement of each job concerned at the revision it read — the
*fence*: an older leader still about to commit that job's placement onto those slots
fails its compare-and-swap instead of committing onto slots that are no longer
claimed. An ended job's key is simply deleted: a placement of a job whose record is
terminal is never restored.

Limits: a node's claims record grows with the jobs on that node (about 140 bytes a
job with the longest ids), so the 1 MB payload bound is ~7,000 jobs on one node, not
a number of jobs in the cluster. A crash in the middle of a pass that moves a job
(shrinks it on one node and grows it on another) restores it at the size it kept,
which an elastic job's scaling rules may not list; the next pass treats it as any
running gang.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping

import msgspec

from phalanx.schemas.messages import JobPlacement

JOB_PREFIX = "job."
NODE_PREFIX = "node."

Claims = Mapping[str, Mapping[str, int]]  # node -> job -> slots


def job_key(job_id: str) -> str:
    return JOB_PREFIX + job_id


def node_key(node_id: str) -> str:
    return NODE_PREFIX + node_id


def slots_by_node(placement: JobPlacement) -> dict[str, int]:
    """The slots ``placement`` holds on each of its nodes."""
    return {node: count * placement.slots_per_replica
            for node, count in Counter(placement.nodes).items()}


def node_claims(placements: Iterable[tuple[str, JobPlacement]]) -> dict[str, dict[str, int]]:
    """The claims that cover exactly ``placements`` (pairs of job id and placement)."""
    claims: dict[str, dict[str, int]] = {}
    for job_id, placement in placements:
        for node, slots in slots_by_node(placement).items():
            claims.setdefault(node, {})[job_id] = slots
    return claims


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a new leader reads from the stored ledger.

    Attributes:
        placements: every job's committed placement that holds slots.
        fence: jobs with claims beyond their placement (left by a crash, or by an older
            leader between its claims and its commit): their placement is rewritten before
            those claims are released.
        dirty: nodes whose claims disagree with the placements: rewritten by the first
            pass, from the core's view.
    """

    placements: dict[str, JobPlacement]
    fence: frozenset[str]
    dirty: frozenset[str]


def restore(placements: Mapping[str, JobPlacement], claims: Claims) -> Restored:
    """Read the stored ``placements`` (empty ones included) and node ``claims``."""
    held = {job: p for job, p in placements.items() if p.nodes}
    covered = node_claims(held.items())
    dirty = {node for node in set(claims) | set(covered)
             if dict(claims.get(node, {})) != covered.get(node, {})}
    fence = {job for node in dirty for job, slots in claims.get(node, {}).items()
             if slots > covered.get(node, {}).get(job, 0)}
    return Restored(held, frozenset(fence), frozenset(dirty))


@dataclasses.dataclass(frozen=True)
class WritePlan:
    """One pass's writes, in the order they must be made (each phase may run at once).

    Attributes:
        shrink: phase 1, placements that lose nodes, as what they keep (``None``: delete
            the key, the job ended).
        claims: phase 2, each changed node's claims as they are after the pass.
        grow: phase 3, placements that gain nodes (or are new), as they are after it.
    """

    shrink: dict[str, JobPlacement | None]
    claims: dict[str, dict[str, int]]
    grow: dict[str, JobPlacement]

    def __bool__(self) -> bool:
        return bool(self.shrink or self.claims or self.grow)


def _kept(old: JobPlacement, new: JobPlacement) -> JobPlacement:
    """``new`` without the replicas on nodes ``old`` did not hold (new's order)."""
    budget = Counter(old.nodes)
    nodes = []
    for node in new.nodes:
        if budget[node]:
            budget[node] -= 1
            nodes.append(node)
    return msgspec.structs.replace(new, nodes=nodes)


def plan(stored: Mapping[str, JobPlacement], claims: Claims,
         after: Mapping[str, JobPlacement | None], *, dirty: Iterable[str] = (),
         fence: Iterable[str] = ()) -> WritePlan:
    """The writes that take the stored ledger to ``after`` for the jobs it names.

    Args:
        stored: every job's stored placement (empty ones included; absent: no key).
        claims: every node's stored claims.
        after: each changed job's placement after the pass: ``None`` for a job that ended
            (or that the leader does not know), empty ``nodes`` for one that holds nothing.
            For a ``dirty`` node, every job with slots on it, in the store or in the
            core's view, must be here.
        dirty: nodes to rewrite even if no job in ``after`` changed there.
        fence: jobs whose placement must be rewritten before their claims are released.
    """
    fence = set(fence)
    shrink: dict[str, JobPlacement | None] = {}
    grow: dict[str, JobPlacement] = {}
    nodes = set(dirty)
    for job, new in after.items():
        old = stored.get(job)
        before = slots_by_node(old) if old is not None else {}
        now_held = slots_by_node(new) if new is not None else {}
        nodes.update(node for node in before.keys() | now_held.keys()
                     if before.get(node) != now_held.get(node))
        if new is None:
            if old is not None or job in fence:
                shrink[job] = None
            continue
        kept = old
        if old is not None and (job in fence or any(
                slots > now_held.get(node, 0) for node, slots in before.items())):
            kept = shrink[job] = _kept(old, new)
        elif old is None and job in fence:
            kept = shrink[job] = msgspec.structs.replace(new, nodes=[])
        if new.nodes and (kept is None or kept.nodes != new.nodes):
            grow[job] = new
    changed = {job: slots_by_node(p) if p is not None else {} for job, p in after.items()}
    new_claims: dict[str, dict[str, int]] = {}
    for node in nodes:
        held = {job: slots for job, slots in claims.get(node, {}).items() if job not in changed}
        for job, by_node in changed.items():
            if by_node.get(node):
                held[job] = by_node[node]
        if held != dict(claims.get(node, {})):
            new_claims[node] = held
    return WritePlan(shrink, new_claims, grow)
