"""Cordoning: which faults are evidence against a node, and when a node has too many. Pure.

Rule 6 of :mod:`.core`. Every infrastructure fault and straggler is charged to its node
(:func:`charge`) at the moment it happened, unless the node was under injected chaos
then; every fault of a job is noted (:func:`strike`) to judge the charges against. A
charge is judged (:func:`judge`) ``cordon_spread_s`` after it happened, once the job's
other faults of that moment are in: a fault of a job that struck most of its nodes alike
is the job's, any other charge and every node loss is evidence (:func:`evidence`), and
``cordon_faults`` pieces within ``cordon_window_s`` cordon the node (once), until
:func:`uncordon` forgets its evidence and its charges not yet judged.
"""

from __future__ import annotations

import collections
import heapq

from phalanx.schemas.messages import FaultKind
from phalanx.services.health.events import CordonNode, Decision
from phalanx.services.health.model import Charge, HealthState, JobHealth, NodeHealth


def strike(state: HealthState, job_id: str, node_id: str, at: float) -> None:
    """Note a fault of ``job_id`` on ``node_id`` (faults come in time order)."""
    struck = state.struck
    struck.append((at, job_id, node_id))
    # The charges still to judge look back a spread from their own time: from the
    # oldest of them, or (none) from a charge this fault's may yet bring.
    spread = state.policy.cordon_spread_s
    oldest = state.charges[0][2].at if state.charges else at
    while struck[0][0] < min(oldest, at - spread) - spread:
        struck.popleft()


def charge(state: HealthState, node_id: str, at: float, kind: FaultKind,
           job: JobHealth | None) -> None:
    """Charge a fault at ``at`` to its node (``job``: None for the node's own loss), to
    be judged once the job's faults of that moment are in."""
    node = state.node(node_id)
    if at <= node.chaos_until:
        return  # injected on purpose: says nothing about the node
    nodes = 0 if job is None else len({r.node_id for r in [*job.ranks.values(),
                                                           *job.departing.values()]})
    state.seq += 1
    heapq.heappush(state.charges, (at + state.policy.cordon_spread_s, state.seq, Charge(
        node_id, at, kind, None if job is None else job.job_id, nodes, node.uncordons)))


def judge(state: HealthState, charge: Charge) -> list[Decision]:
    """A charge whose spread has passed: evidence against its node, or the job's."""
    node = state.nodes[charge.node_id]
    if node.uncordons != charge.uncordons:
        return []  # forgotten by an uncordon
    if charge.job_id is not None:
        spread = state.policy.cordon_spread_s
        struck = {n for t, j, n in state.struck
                  if j == charge.job_id and abs(t - charge.at) <= spread}
        if len(struck) >= 2 and 2 * len(struck) > charge.job_nodes:
            return []  # it struck most of the job's nodes alike: the job's, not the node's
    return evidence(state, node, charge.at, charge.kind)


def evidence(state: HealthState, node: NodeHealth, at: float,
             kind: FaultKind) -> list[Decision]:
    """A piece of evidence against ``node`` at ``at``: a cordon once there are enough."""
    node_id = node.node_id
    faults = node.faults
    faults.append((at, kind))
    window = state.policy.cordon_window_s
    while at - faults[0][0] > window:
        faults.popleft()
    if node.cordoned or len(faults) < state.policy.cordon_faults:
        return []
    node.cordoned = True
    counts = collections.Counter(k.value for _, k in faults)
    what = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    return [CordonNode(node_id, f"{len(faults)} faults within {window:g} s ({what})")]


def uncordon(state: HealthState, node_id: str) -> None:
    """An operator uncordoned the node: its evidence and its charges not yet judged go."""
    node = state.nodes.get(node_id)
    if node is not None:
        node.cordoned = False
        node.faults.clear()
        node.uncordons += 1


def chaos(state: HealthState, node_id: str, until: float) -> None:
    """Faults charged to the node until ``until`` are injected: no evidence."""
    node = state.node(node_id)
    node.chaos_until = max(node.chaos_until, until)
