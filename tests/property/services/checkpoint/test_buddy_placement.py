"""Property tests of buddy placement: after every view of the registry each live node has
exactly one placement, its buddy live and in another failure domain (or none, saying so,
when no such node exists); a placement whose buddy still qualifies never moves; the lost
are forgotten; a core restored from the stored placements decides as one that never
stopped."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import BuddyReason, NodeInfo, NodeRecord
from phalanx.services.checkpoint import core

LOST_AFTER_S = 3.0
NODES = [f"n{i}" for i in range(6)]


def record(node_id: str, domain: str, heartbeat_at: float) -> NodeRecord:
    return NodeRecord(node=NodeInfo(node_id=node_id, host="h", slots=2,
                                    failure_domain=domain),
                      heartbeat_at=heartbeat_at)


# One view of the registry: per node (present?, domain, alive?, its clock's error).
registry_views = st.lists(
    st.tuples(st.booleans(), st.sampled_from(["d0", "d1", "d2"]), st.booleans(),
              st.sampled_from([0.0, -3600.0, 3600.0])),
    min_size=len(NODES), max_size=len(NODES))


def seen(view: list[tuple[bool, str, bool, float]], now: float) -> core.NodesSeen:
    """The view as read at ``now``: each node's heartbeat read then if alive, two
    timeouts before if not, whatever its clock stamped."""
    present = [(node, domain, now if alive else now - 2 * LOST_AFTER_S, clock_off)
               for node, (there, domain, alive, clock_off) in zip(NODES, view, strict=True)
               if there]
    return core.NodesSeen(
        tuple(record(node, domain, heard + clock_off) for node, domain, heard, clock_off
              in present), now, LOST_AFTER_S,
        heard_at={node: heard for node, _, heard, _ in present})


def check(placements: dict, event: core.NodesSeen, before: dict) -> None:
    domains = {r.node.node_id: r.node.failure_domain for r in event.records
               if event.heard_at[r.node.node_id] >= event.now - LOST_AFTER_S}
    assert placements.keys() == domains.keys()
    for node, placement in placements.items():
        assert placement.node_id == node and placement.failure_domain == domains[node]
        others = {n for n in domains if domains[n] != domains[node]}
        if not others:
            assert not placement.buddy_id and placement.reason is BuddyReason.NO_OTHER_DOMAIN
            continue
        assert placement.buddy_id in others
        assert placement.buddy_domain == domains[placement.buddy_id]
        old = before.get(node)
        if old is not None and old.buddy_id in others:  # stable while it qualifies
            assert placement.buddy_id == old.buddy_id
        elif old is not None and old.buddy_id:
            assert placement.reason in (BuddyReason.BUDDY_LOST, BuddyReason.SAME_DOMAIN)
            assert placement.placed_at == event.now


@settings(max_examples=300, deadline=None)
@example(views=[[(True, "d0", True, 0.0), (True, "d1", True, 0.0), (True, "d0", True, 0.0)] +
                [(False, "d0", True, 0.0)] * 3,
                [(False, "d0", True, 0.0), (True, "d1", True, 0.0), (True, "d0", True, 0.0)] +
                [(False, "d0", True, 0.0)] * 3], cut=1)
@given(st.lists(registry_views, min_size=1, max_size=12), st.integers(0, 12))
def test_every_live_node_has_a_stable_buddy_in_another_domain(views, cut) -> None:
    live = core.CheckpointCore()
    stored: dict = {}
    restarted = None
    for i, view in enumerate(views):
        now = 1000.0 + 10 * i
        if i == cut:  # the service restarts from what it stored
            restarted = core.CheckpointCore()
            for placement in stored.values():
                restarted.restore_buddy(placement)
        before = dict(live.buddies)
        event = seen(view, now)
        decisions = live.handle(event)
        check(live.buddies, event, before)
        for decision in decisions:
            match decision:
                case core.StoreBuddy(placement=placement):
                    assert before.get(placement.node_id) != placement
                    stored[placement.node_id] = placement
                case core.ForgetBuddy(node_id=node_id):
                    assert node_id not in live.buddies
                    del stored[node_id]
        assert stored == live.buddies  # the decisions are exactly the changes
        if restarted is not None:
            restarted.handle(event)
            assert restarted.buddies == live.buddies


def test_a_lost_buddy_is_replaced_by_the_least_loaded_node_of_another_domain() -> None:
    the_core = core.CheckpointCore()
    nodes = [record("a", "d0", 100.0), record("b", "d1", 100.0), record("c", "d0", 100.0),
             record("d", "d1", 100.0)]
    the_core.handle(core.NodesSeen(tuple(nodes), 100.0, LOST_AFTER_S))
    assert {n: p.buddy_id for n, p in the_core.buddies.items()} == {
        "a": "b", "b": "a", "c": "d", "d": "c"}
    nodes[1] = record("b", "d1", 90.0)  # b falls silent
    decisions = the_core.handle(core.NodesSeen(tuple(nodes), 100.0, LOST_AFTER_S))
    assert decisions[0] == core.ForgetBuddy("b")
    assert the_core.buddies["a"].buddy_id == "d"
    assert the_core.buddies["a"].reason is BuddyReason.BUDDY_LOST
    assert {n: p.buddy_id for n, p in the_core.buddies.items()} == {
        "a": "d", "c": "d", "d": "c"}
    alone = core.CheckpointCore()
    alone.handle(core.NodesSeen((record("a", "d0", 100.0),), 100.0, LOST_AFTER_S))
    assert alone.buddies["a"].reason is BuddyReason.NO_OTHER_DOMAIN
