"""The registry rule: alive up to lost_after_s, lost after; what a node offers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from phalanx.schemas.messages import NodeInfo, NodeRecord
from phalanx.schemas.registry import (
    DEFAULT_LOST_AFTER_S,
    NodeState,
    NodeView,
    view,
    views,
)

T0 = 1_717_000_000.0


def record(node_id: str = "n1", *, at: float = T0, slots: int = 8, used: int = 2,
           cordoned: bool = False, labels: dict[str, str] | None = None) -> NodeRecord:
    info = NodeInfo(node_id=node_id, host=f"{node_id}.example", slots=slots,
                    failure_domain="rack-1", labels=labels or {"gpu": "a100"}, agent_pid=4242)
    return NodeRecord(node=info, heartbeat_seq=5, heartbeat_at=at, slots_used=used,
                      cordoned=cordoned)


def test_view_copies_the_record() -> None:
    v = view(record(), T0 + 1.0)
    assert v == NodeView(node_id="n1", host="n1.example", state=NodeState.ALIVE, slots=8,
                         slots_used=2, failure_domain="rack-1", labels={"gpu": "a100"},
                         cordoned=False, heartbeat_age_s=1.0, agent_pid=4242)


def test_view_labels_are_a_copy() -> None:
    r = record()
    v = view(r, T0)
    v.labels["gpu"] = "h100"
    assert r.node.labels == {"gpu": "a100"}


def test_default_lost_after() -> None:
    assert DEFAULT_LOST_AFTER_S == 3.0
    assert view(record(), T0 + 3.0).state is NodeState.ALIVE
    assert view(record(), T0 + 3.01).state is NodeState.LOST


@pytest.mark.parametrize("lost_after", [0.5, 3.0, 10.0])
def test_alive_at_exactly_lost_after(lost_after: float) -> None:
    v = view(record(at=T0), T0 + lost_after, lost_after)
    assert v.heartbeat_age_s == lost_after
    assert v.state is NodeState.ALIVE
    assert v.schedulable_slots == 6


@pytest.mark.parametrize("lost_after", [0.5, 3.0, 10.0])
def test_lost_just_after(lost_after: float) -> None:
    now = math.nextafter(T0 + lost_after, math.inf)
    v = view(record(at=T0), now, lost_after)
    assert v.heartbeat_age_s > lost_after
    assert v.state is NodeState.LOST
    assert v.schedulable_slots == 0


def test_fresh_heartbeat_is_alive() -> None:
    v = view(record(at=T0), T0)
    assert v.state is NodeState.ALIVE
    assert v.heartbeat_age_s == 0.0


@pytest.mark.parametrize("skew", [0.001, 1.0, 3600.0])
def test_future_heartbeat_clamps_to_age_zero_and_alive(skew: float) -> None:
    v = view(record(at=T0 + skew), T0, lost_after_s=3.0)
    assert v.heartbeat_age_s == 0.0
    assert v.state is NodeState.ALIVE


def test_schedulable_slots_of_an_alive_node() -> None:
    assert view(record(slots=8, used=3), T0).schedulable_slots == 5
    assert view(record(slots=8, used=8), T0).schedulable_slots == 0
    assert view(record(slots=8, used=0), T0).schedulable_slots == 8


def test_schedulable_slots_zero_when_cordoned() -> None:
    v = view(record(cordoned=True, used=0), T0)
    assert v.state is NodeState.ALIVE
    assert v.cordoned
    assert v.slots == 8
    assert v.schedulable_slots == 0


def test_schedulable_slots_zero_when_lost() -> None:
    v = view(record(used=0), T0 + 60.0)
    assert v.state is NodeState.LOST
    assert v.schedulable_slots == 0


def test_schedulable_slots_zero_when_lost_and_cordoned() -> None:
    assert view(record(cordoned=True), T0 + 60.0).schedulable_slots == 0


def test_views_are_sorted_by_node_id() -> None:
    records = [record("node-c"), record("node-a", at=T0 - 100), record("node-b")]
    got = views(records, T0)
    assert [v.node_id for v in got] == ["node-a", "node-b", "node-c"]
    assert [v.state for v in got] == [NodeState.LOST, NodeState.ALIVE, NodeState.ALIVE]


def test_views_use_the_given_lost_after() -> None:
    records = [record("a", at=T0), record("b", at=T0 - 5.0)]
    assert [v.state for v in views(records, T0, lost_after_s=10.0)] == [NodeState.ALIVE] * 2
    assert [v.state for v in views(records, T0, lost_after_s=1.0)] == [
        NodeState.ALIVE, NodeState.LOST]


def test_views_accept_any_iterable_and_empty() -> None:
    assert views(iter([]), T0) == []
    assert [v.node_id for v in views((r for r in [record("z"), record("y")]), T0)] == ["y", "z"]


def test_node_view_is_frozen() -> None:
    v = view(record(), T0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.slots = 1  # type: ignore[misc]


def test_node_state_values() -> None:
    assert NodeState.ALIVE == "alive"
    assert NodeState.LOST == "lost"


def test_silence_a_reader_could_not_hear_does_not_make_a_node_lost() -> None:
    """A reader blind until ``watching_since`` (its bus was down) gives every node a full
    timeout from then: a bus outage never looks like every node dying."""
    stale = record(at=100.0)
    assert view(stale, 110.0, 3.0).state is NodeState.LOST
    assert view(stale, 110.0, 3.0, watching_since=108.0).state is NodeState.ALIVE
    assert view(stale, 111.0, 3.0, watching_since=108.0).state is NodeState.ALIVE
    lost = view(stale, 111.5, 3.0, watching_since=108.0)
    assert lost.state is NodeState.LOST and lost.heartbeat_age_s == 11.5
