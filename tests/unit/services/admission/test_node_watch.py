"""Admission's judgement of the nodes' silence (:mod:`phalanx.services.admission.node_watch`),
driven as its service drives it: every record read is judged, every tick may begin a
mass silence."""

from __future__ import annotations

import dataclasses

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import NodeInfo, NodeRecord
from phalanx.services.admission.node_watch import NodeWatch

LOST_AFTER = 3.0
TICK = 0.1


def record(node_id: str, heartbeat_at: float) -> NodeRecord:
    return NodeRecord(node=NodeInfo(node_id=node_id, host="h", slots=1, failure_domain="d"),
                      heartbeat_at=heartbeat_at)


@dataclasses.dataclass
class Leader:
    """The service's use of a watch: what it read, and what it judged each node."""

    watch: NodeWatch = dataclasses.field(default_factory=lambda: NodeWatch(LOST_AFTER))
    records: dict[str, NodeRecord] = dataclasses.field(default_factory=dict)
    judged: dict[str, bool] = dataclasses.field(default_factory=dict)
    held: list[float] = dataclasses.field(default_factory=list)  # when silences began

    def believed_alive(self) -> list[NodeRecord]:
        return [r for n, r in self.records.items() if self.judged.get(n)]

    def read(self, node_id: str, heartbeat_at: float, now: float) -> None:
        self.records[node_id] = record(node_id, heartbeat_at)
        self.watch.read(self.records[node_id], self.believed_alive, now)
        self._judge(node_id, now)

    def tick(self, now: float) -> None:
        if self.watch.hold(self.believed_alive(), now):
            self.held.append(now)
        for node_id in list(self.records):
            self._judge(node_id, now)

    def _judge(self, node_id: str, now: float) -> None:
        self.judged[node_id] = self.watch.alive(self.records[node_id], now,
                                                self.judged.get(node_id))


def run(leader: Leader, until: float, beats: dict[str, list[float]]) -> dict[str, float]:
    """Tick every ``TICK`` and read each node's heartbeats at their times until
    ``until``; when each node was first judged lost."""
    lost: dict[str, float] = {}
    pending = sorted((at, node_id) for node_id, times in beats.items() for at in times)
    now = 0.0
    while now < until:
        now = round(now + TICK, 6)
        while pending and pending[0][0] <= now:
            at, node_id = pending.pop(0)
            leader.read(node_id, at, now)
        leader.tick(now)
        for node_id, alive in leader.judged.items():
            if not alive:
                lost.setdefault(node_id, now)
    return lost


def test_a_node_silent_while_another_is_heard_is_lost_after_the_timeout() -> None:
    leader = Leader()
    lost = run(leader, 10.0, {"a": [0.0, 1.0], "b": [float(t) for t in range(11)]})
    assert lost == {"a": 4.1}  # silent from 1.0: lost once 3 s have passed
    assert leader.held == []


def test_nothing_before_the_watch_could_hear_counts() -> None:
    leader = Leader()
    leader.watch.blind_until(5.0)
    lost = run(leader, 10.0, {"a": [0.0], "b": [float(t) for t in range(11)]})
    assert lost == {"a": 8.1}


def test_no_judgement_changes_in_a_mass_silence_and_its_span_is_credited() -> None:
    leader = Leader()
    # Both nodes beat each second to 4.0, then nothing until b at 12.0; a never again.
    # c was lost before the silence (silent from 0.0) and must stay lost through it.
    beats = {"a": [0.0, 1.0, 2.0, 3.0, 4.0],
             "b": [0.0, 1.0, 2.0, 3.0, 4.0, *(float(t) for t in range(12, 21))], "c": [0.0]}
    lost = run(leader, 20.0, beats)
    assert leader.held == [7.1]  # a and b both past the timeout at once
    assert lost["c"] == 3.2  # its one heartbeat was read at the first tick, 0.1
    # a is credited the unheard span (4.0 to 12.0): lost 3 s of heard silence after 4.0
    assert lost["a"] == 15.1
    assert "b" not in lost


def test_a_dead_nodes_requeue_is_not_put_off_by_a_survivor_late_at_each_deadline() -> None:
    """a dies at 0; b beats each second but, where it can, is late just past a's
    deadline, never twice in a row. A full timeout for every node from the end of each
    held silence kept a alive as long as this went on."""
    leader = Leader()
    leader.read("a", 0.0, 0.0)
    leader.read("b", 0.0, 0.0)
    last_b, late, now, lost_at = 0.0, False, 0.0, None
    while now < 60.0 and lost_at is None:
        now = round(now + TICK, 6)
        a_deadline = max(0.0, leader.watch.judged_from("a")) + LOST_AFTER
        # Late past a's deadline (gap at most 2.5 s) unless the last beat was late.
        due = last_b + 1.0
        if not late and due <= a_deadline < last_b + 2.3:
            due = a_deadline + 0.2
        if now >= due:
            late, last_b = due > last_b + 1.0 + 1e-9, now
            leader.read("b", now, now)
        leader.tick(now)
        if leader.judged["a"] is False:
            lost_at = now
        assert leader.judged["b"]
    assert leader.held, "the scenario held at least one mass silence"
    assert lost_at is not None and lost_at < 10.0, lost_at


def test_heartbeats_are_timed_as_read_whatever_the_agents_clock_says() -> None:
    """a's clock runs 60 s behind, c's 60 s ahead: each is alive while its heartbeats
    arrive, and lost a timeout after the last one arrived."""
    leader = Leader()
    for t in range(8):
        leader.read("a", t - 60.0, float(t))
        leader.read("b", float(t), float(t))
        if t < 4:
            leader.read("c", t + 60.0, float(t))
        leader.tick(t + 0.5)
        assert leader.judged["a"] and leader.judged["b"]
    assert leader.judged["c"] is False  # last read at 3.0, lost past 6.0
    assert leader.watch.heard["a"].at == 7.0


def test_a_record_rewritten_without_a_heartbeat_times_nothing() -> None:
    leader = Leader()
    leader.read("a", 0.0, 0.0)
    leader.read("b", 0.0, 0.0)
    for t in (1.0, 2.0, 3.0, 4.0):
        leader.read("b", t, t)
        leader.records["a"] = msgspec.structs.replace(leader.records["a"], cordoned=True)
        leader.watch.read(leader.records["a"], leader.believed_alive, t)  # a cordon
        leader.tick(t)
    assert leader.judged == {"a": False, "b": True}


def silent_from_nought() -> tuple[NodeWatch, list[NodeRecord]]:
    """A watch that read a and b at 0 and held their silence at 3.5; the two records."""
    watch = NodeWatch(LOST_AFTER)
    a, b = record("a", 0.0), record("b", 0.0)
    watch.read(a, list, 0.0)
    watch.read(b, lambda: [a], 0.0)
    assert watch.hold([a, b], 3.5)
    return watch, [a, b]


def test_a_heartbeat_read_late_still_ends_a_mass_silence() -> None:
    watch, both = silent_from_nought()
    assert watch.read(record("b", 2.0), lambda: both, 4.0) == 0.5  # written before, heard now
    assert watch.judged_from("a") == 4.0  # credited the 4 s in which no node was heard


def test_a_node_that_left_keeps_no_credit() -> None:
    watch, both = silent_from_nought()
    watch.read(record("a", 5.0), lambda: both, 5.0)
    assert watch.judged_from("b") == 5.0
    watch.forget("b")
    assert watch.judged_from("b") == float("-inf")
    assert "b" not in watch.heard


# --- properties over arbitrary heartbeat schedules --------------------------------------

NODES = ("a", "b", "c")


@st.composite
def schedules(draw: st.DrawFn) -> dict[str, list[tuple[float, float]]]:
    """Per node: its heartbeats as (its agent's stamp, read at), each read at most 2 s
    late, each agent's clock off by up to a minute either way."""
    beats: dict[str, list[tuple[float, float]]] = {}
    for node_id in NODES[:draw(st.integers(1, 3))]:
        gaps = draw(st.lists(st.sampled_from([0.5, 1.0, 1.0, 1.7, 2.5, 4.0, 9.0]),
                             min_size=1, max_size=20))
        skew = draw(st.sampled_from([0.0, 0.0, -60.0, 45.5]))
        at, beats[node_id] = 0.0, []
        for gap in gaps:
            lag = draw(st.sampled_from([0.0, 0.0, 0.3, 1.2, 2.0]))
            beats[node_id].append((at + skew, round(at + lag, 6)))
            at = round(at + gap, 6)
    return beats


@settings(derandomize=True, database=None, deadline=None, max_examples=150)
@given(beats=schedules(), blind=st.sampled_from([0.0, 0.0, 2.0]))
def test_judgements_follow_only_the_silence_that_could_be_heard(
        beats: dict[str, list[tuple[float, float]]], blind: float) -> None:
    leader = Leader()
    leader.watch.blind_until(blind)
    reads = sorted((read, stamp, node_id)
                   for node_id, times in beats.items() for stamp, read in times)
    end = max(read for read, _, _ in reads) + 2 * LOST_AFTER
    never_held, now = True, 0.0
    while now < end:
        now = round(now + TICK, 6)
        read_now = set()
        while reads and reads[0][0] <= now:
            _, stamp, node_id = reads.pop(0)
            newest = leader.records.get(node_id)
            if newest is None or stamp > newest.heartbeat_at:
                leader.read(node_id, stamp, now)
            read_now.add(node_id)
        before = dict(leader.judged)
        silent = leader.watch.silent_since is not None
        leader.tick(now)
        never_held &= not leader.held
        for node_id, alive in leader.judged.items():
            heard = leader.watch.heard[node_id].at  # by the leader's clock, not the agent's
            if before.get(node_id) is False and alive:
                # Only a node's own heartbeat brings it back: no credit revives the lost.
                assert node_id in read_now
            if silent and leader.watch.silent_since is not None and node_id in before:
                assert alive == before[node_id]  # nothing judged in a mass silence
            if leader.watch.silent_since is None and now - heard <= LOST_AFTER:
                assert alive  # heard within the timeout
            if never_held and now - max(heard, blind) > LOST_AFTER + 1e-9:
                assert not alive  # no silence held: the registry's rule, exactly


def test_a_record_judged_before_it_was_read_counts_as_read_then() -> None:
    watch = NodeWatch(LOST_AFTER)
    stale = record("a", -100.0)
    assert watch.alive(stale, 10.0, None)
    assert watch.alive(stale, 13.0, True)
    assert not watch.alive(stale, 13.5, True)
