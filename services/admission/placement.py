"""Where a gang's replicas go: best-fit placement, failure-domain spread, the slots a
reservation holds, and elastic growth into free slots. Pure.

A replica needs ``slots_per_replica`` slots on one schedulable node that carries the
gang's labels; one of ``ranks_per_replica`` ranks (a group) needs all their slots
(``JobSpec.slots_per_group``) on one node, and is placed as one replica that size.
Placement is best-fit: the fullest node that still fits first, so large holes stay for
large gangs. A gang with ``spread_failure_domains`` puts no more than
``ceil(n / domains)`` of its ``n`` replicas in one failure domain, ``domains`` counting
those with a node that could host a replica. Slots a reservation holds (``reserved``:
node -> slots) are not free to anyone else in the pass.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator

from phalanx.services.admission.model import AdmissionState, Gang, Node


def candidates(state: AdmissionState, gang: Gang,
               reserved: dict[str, int]) -> Iterator[tuple[Node, int]]:
    """Schedulable matching nodes with room for a replica, fullest first, and their room."""
    k = gang.per_replica
    if state.free_sizes[0] != state.version:
        state.free_sizes = (state.version, sorted(state.by_free))
    sizes = state.free_sizes[1]
    for free in sizes[bisect.bisect_left(sizes, k):]:
        for node_id in state.by_free[free]:
            node = state.nodes[node_id]
            room = free - reserved.get(node_id, 0)
            if room >= k and node.matches(gang.spec):
                yield node, room


def place(state: AdmissionState, gang: Gang, replicas: int, reserved: dict[str, int],
          existing: Iterable[str] = ()) -> list[str] | None:
    """Nodes for ``replicas`` more replicas of ``gang`` (all or None)."""
    k = gang.per_replica
    cap = math.inf
    per_domain: dict[str, int] = {}
    if gang.spec.placement.spread_failure_domains:
        total = replicas + len(list(existing))
        cap = math.ceil(total / max(1, domains(state, gang)))
        for node_id in existing:
            domain = state.nodes[node_id].failure_domain
            per_domain[domain] = per_domain.get(domain, 0) + 1
    chosen: list[str] = []
    for node, room in candidates(state, gang, reserved):
        domain = node.failure_domain
        take = min(room // k, replicas - len(chosen), cap - per_domain.get(domain, 0))
        if take > 0:
            chosen += [node.node_id] * int(take)
            per_domain[domain] = per_domain.get(domain, 0) + int(take)
            if len(chosen) == replicas:
                return chosen
    return None


def domains(state: AdmissionState, gang: Gang) -> int:
    """How many failure domains have a schedulable node that could host a replica (cached)."""
    labels = tuple(sorted(gang.spec.placement.node_labels.items()))
    key = (gang.per_replica, labels)
    count = state.domain_cache.get(key)
    if count is None:
        count = state.domain_cache[key] = len({
            n.failure_domain for n in state.nodes.values()
            if n.schedulable and n.matches(gang.spec) and n.slots >= gang.per_replica})
    return count


def reserve(state: AdmissionState, gang: Gang, reserved: dict[str, int]) -> int:
    """Hold free slots for ``gang`` on the nodes it will land on; returns slots held.

    The target nodes are the matching ones with the most free slots, taken until
    they could host the gang's smallest size once empty (at most a fair share per
    failure domain for a spread gang). Everything free on them is held, even less
    than a replica, so slots freed there a few at a time add up to whole replicas
    instead of being backfilled away. Held slots only grow on the targets, so the
    same nodes stay the targets from pass to pass.
    """
    k = gang.per_replica
    n = gang.smallest
    share = (math.ceil(n / max(1, domains(state, gang)))
             if gang.spec.placement.spread_failure_domains else n)
    per_domain: dict[str, int] = {}
    held = assigned = 0
    for free in sorted(state.by_free, reverse=True):
        for node_id in state.by_free[free]:
            node = state.nodes[node_id]
            room = free - reserved.get(node_id, 0)
            if room <= 0 or node.slots < k or not node.matches(gang.spec):
                continue
            domain = node.failure_domain
            replicas = min(node.slots // k, n - assigned, share - per_domain.get(domain, 0))
            if replicas <= 0:
                continue
            take = min(room, replicas * k)
            reserved[node_id] = reserved.get(node_id, 0) + take
            per_domain[domain] = per_domain.get(domain, 0) + replicas
            held += take
            assigned += replicas
            if assigned >= n:
                return held
    return held


def could_ever_fit(state: AdmissionState, gang: Gang) -> bool:
    """Would ``gang`` fit if every matching schedulable node were empty? (cached)"""
    fits = state.fit_cache.get(gang.shape)
    if fits is None:
        fits = state.fit_cache[gang.shape] = _fits_empty(state, gang)
    return fits


def _fits_empty(state: AdmissionState, gang: Gang) -> bool:
    """:func:`could_ever_fit`, computed."""
    k = gang.per_replica
    by_domain: dict[str, int] = {}
    for node in state.nodes.values():
        if node.schedulable and node.slots >= k and node.matches(gang.spec):
            by_domain[node.failure_domain] = (by_domain.get(node.failure_domain, 0)
                                              + node.slots // k)
    n = gang.smallest
    if gang.spec.placement.spread_failure_domains and by_domain:
        cap = math.ceil(n / len(by_domain))
        return sum(min(c, cap) for c in by_domain.values()) >= n
    return sum(by_domain.values()) >= n


def grow(state: AdmissionState, gang: Gang, reserved: dict[str, int]) -> None:
    """Give an elastic gang extra replicas from unreserved free slots, up to the largest
    allowed size within its cap that they reach (none if they reach no allowed size)."""
    ceiling = state.quota(gang.team).ceiling
    before = len(gang.nodes)
    added: list[str] = []
    while before + len(added) < gang.cap:
        if state.usage.get(gang.team, 0) + gang.per_replica > ceiling:
            break
        extra = place(state, gang, 1, reserved, existing=gang.nodes)
        if extra is None:
            break
        state.allocate(gang, extra)
        added += extra
    target = gang.rules.grow_target(before, before + len(added), gang.cap) or before
    if len(gang.nodes) > target:
        state.release(gang, gang.nodes[target:])
