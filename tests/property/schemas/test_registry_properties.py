"""Properties of the registry rule over arbitrary records and clocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import NodeInfo, NodeRecord
from phalanx.schemas.registry import NodeState, heard, mass_silence, view, views

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=200)

times = st.floats(min_value=0.0, max_value=4e9, allow_nan=False)
lost_afters = st.floats(min_value=0.001, max_value=600.0, allow_nan=False)


@st.composite
def records(draw: st.DrawFn, node_id: st.SearchStrategy[str] | None = None) -> NodeRecord:
    slots = draw(st.integers(1, 256))
    info = NodeInfo(
        node_id=draw(node_id or st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True)),
        host="h", slots=slots, failure_domain="d", agent_pid=draw(st.integers(0, 2**22)),
    )
    return NodeRecord(node=info, heartbeat_seq=draw(st.integers(0, 10**6)),
                      heartbeat_at=draw(times), slots_used=draw(st.integers(0, slots)),
                      cordoned=draw(st.booleans()))


@SETTINGS
@given(record=records(), now=times, lost_after=lost_afters)
def test_state_follows_the_age_rule(record: NodeRecord, now: float, lost_after: float) -> None:
    v = view(record, now, lost_after)
    assert v.heartbeat_age_s >= 0.0
    assert v.heartbeat_age_s == max(0.0, now - record.heartbeat_at)
    expected = NodeState.ALIVE if v.heartbeat_age_s <= lost_after else NodeState.LOST
    assert v.state is expected
    if now <= record.heartbeat_at:
        assert v.state is NodeState.ALIVE


@SETTINGS
@given(record=records(), now=times, lost_after=lost_afters)
def test_schedulable_slots_are_bounded(record: NodeRecord, now: float,
                                       lost_after: float) -> None:
    v = view(record, now, lost_after)
    assert 0 <= v.schedulable_slots <= v.slots
    if v.state is NodeState.ALIVE and not v.cordoned:
        assert v.schedulable_slots == v.slots - v.slots_used
    else:
        assert v.schedulable_slots == 0


@SETTINGS
@given(record=records(), now=times, later=st.floats(0.0, 1e6), lost_after=lost_afters)
def test_once_lost_stays_lost_without_a_new_heartbeat(record: NodeRecord, now: float,
                                                      later: float, lost_after: float) -> None:
    if view(record, now, lost_after).state is NodeState.LOST:
        assert view(record, now + later, lost_after).state is NodeState.LOST


@SETTINGS
@given(rs=st.lists(records(), max_size=8), now=times, lost_after=lost_afters)
def test_views_are_sorted_and_one_per_record(rs: list[NodeRecord], now: float,
                                             lost_after: float) -> None:
    got = views(rs, now, lost_after)
    assert [v.node_id for v in got] == sorted(r.node.node_id for r in rs)
    assert sorted(got, key=lambda v: v.node_id) == got
    by_id = {r.node.node_id: r for r in rs}
    for v in got:
        if list(r.node.node_id for r in rs).count(v.node_id) == 1:
            assert v == view(by_id[v.node_id], now, lost_after)


@SETTINGS
@given(record=records(), now=times, since=times, lost_after=lost_afters)
def test_a_reader_judges_only_silence_it_could_hear(record: NodeRecord, now: float,
                                                    since: float, lost_after: float) -> None:
    """Watching since ``since`` (a reconnection, a new term), a node is lost only after
    ``lost_after`` of silence after it: never sooner than to an unblinded reader, and
    never within ``lost_after`` of ``since``."""
    v = view(record, now, lost_after, watching_since=since)
    expected = NodeState.ALIVE if now - max(record.heartbeat_at, since) <= lost_after \
        else NodeState.LOST
    assert v.state is expected
    assert v.heartbeat_age_s == view(record, now, lost_after).heartbeat_age_s
    if view(record, now, lost_after).state is NodeState.ALIVE or now - since <= lost_after:
        assert v.state is NodeState.ALIVE
    if since <= record.heartbeat_at:
        assert v == view(record, now, lost_after)


@SETTINGS
@given(at=times, timeout=lost_afters,
       ages=st.lists(st.floats(min_value=-10.0, max_value=1200.0, allow_nan=False), max_size=8))
def test_a_mass_silence_is_every_other_node_silent_past_half_a_timeout(
        at: float, timeout: float, ages: list[float]) -> None:
    heard = [at - age for age in ages]
    silent = mass_silence(heard, at, timeout)
    # A lone node's silence is its own; any node heard within half a timeout (or after
    # ``at``) shows the reader hears the nodes.
    assert silent == (len(heard) >= 2 and all(at - when > timeout / 2 for when in heard))
    if len(heard) < 2 or any(when >= at for when in heard):
        assert not silent
    # Adding a node heard just now ends it; adding one as silent as the rest keeps it.
    assert not mass_silence([*heard, at], at, timeout)
    if silent or (len(heard) == 1 and at - heard[0] > timeout / 2):
        assert mass_silence([*heard, min(heard)], at, timeout)


@SETTINGS
@given(stamps=st.lists(st.sampled_from([0.0, 1.0, 2.0, -3600.0]), min_size=1, max_size=12),
       lost_after=lost_afters)
def test_a_followed_heartbeat_is_timed_by_its_first_read_whatever_its_stamp(
        stamps: list[float], lost_after: float) -> None:
    """Reads one second apart, of a node whose stamps may repeat (a record rewritten) or
    lie: each heartbeat is heard at the first read that held it, and the view judges the
    node by that alone."""
    known = None
    for now, stamp in enumerate(stamps):
        record = NodeRecord(node=NodeInfo(node_id="n", host="h", slots=1, failure_domain="d"),
                            heartbeat_at=stamp)
        before, known = known, heard(known, record, float(now))
        assert known.stamp == stamp
        if before is not None and before.stamp == stamp:
            assert known is before
        else:
            assert known.at == now
        seen = view(record, known.at + lost_after / 2, lost_after, heard_at=known.at)
        assert seen.state is NodeState.ALIVE
        assert seen.heartbeat_age_s == pytest.approx(lost_after / 2)
        late = view(record, known.at + 2 * lost_after, lost_after, heard_at=known.at)
        assert late.state is NodeState.LOST
