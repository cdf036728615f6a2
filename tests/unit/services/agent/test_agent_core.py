"""The agent's rules: who may take a node id, what a heartbeat writes, which replica a
slot may run."""

from __future__ import annotations

import pytest

from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import ExitCause, NodeInfo, NodeRecord
from phalanx.services.agent.core import (
    LaunchVerdict,
    NodeIdTaken,
    StopReason,
    exit_cause,
    first_replica,
    heartbeat,
    launch_verdict,
    register,
)

T0 = 1_717_000_000.0
LOST = 3.0


def info(pid: int = 100, host: str = "host-a", node_id: str = "gpu-07", slots: int = 8,
         **extra) -> NodeInfo:
    return NodeInfo(node_id=node_id, host=host, slots=slots, failure_domain="rack-1",
                    agent_pid=pid, **extra)


def held(by: NodeInfo, at: float = T0, *, seq: int = 9, used: int = 2,
         cordoned: bool = False) -> NodeRecord:
    return NodeRecord(node=by, heartbeat_seq=seq, heartbeat_at=at, slots_used=used,
                      cordoned=cordoned)


# --- register ------------------------------------------------------------------------------


def test_register_when_absent() -> None:
    me = info()
    assert register(None, me, T0) == NodeRecord(node=me, heartbeat_seq=0,
                                                      heartbeat_at=T0, slots_used=0,
                                                      cordoned=False)


def test_re_register_by_the_same_host_and_pid_while_alive() -> None:
    me = info()
    new = register(held(me, T0), info(labels={"gpu": "h100"}), T0 + 1.0)
    assert new.node == info(labels={"gpu": "h100"})
    assert new.heartbeat_seq == 0
    assert new.heartbeat_at == T0 + 1.0
    assert new.slots_used == 0


@pytest.mark.parametrize(
    "other",
    [info(pid=200), info(host="host-b"), info(pid=200, host="host-b")],
    ids=["same-host-other-pid", "other-host-same-pid", "other-host-other-pid"],
)
@pytest.mark.parametrize("stamped", [T0 - 3600.0, T0 + 3600.0], ids=["an-hour-old", "ahead"])
def test_refused_when_a_different_agent_holds_the_id_however_old_its_stamp(
        other: NodeInfo, stamped: float) -> None:
    """Without a watch the holder's stamp proves nothing: its clock may be off."""
    with pytest.raises(NodeIdTaken) as excinfo:
        register(held(info(), stamped), other, T0)
    text = str(excinfo.value)
    assert "'gpu-07'" in text
    assert "pid 100" in text
    assert "host-a" in text
    assert "watched" not in text


def test_taken_when_the_record_watched_for_a_timeout_is_still_the_one_held() -> None:
    newcomer = info(pid=200, host="host-b")
    watched = held(info(), T0 + 3600.0, seq=77, used=5)  # its clock an hour ahead
    new = register(watched, newcomer, T0 + LOST, silent=watched)
    assert new.node == newcomer
    assert new.heartbeat_seq == 0
    assert new.heartbeat_at == T0 + LOST
    assert new.slots_used == 0


@pytest.mark.parametrize("now_held", [
    held(info(), T0 + 1.0, seq=78),  # it beat
    held(info(), T0, seq=78),  # it beat, its clock stood still
    held(info(pid=300, host="host-c"), T0, seq=77),  # a third agent took it
], ids=["beat", "beat-same-stamp", "another-holder"])
def test_refused_when_the_held_record_changed_during_the_watch(now_held: NodeRecord) -> None:
    watched = held(info(), T0, seq=77)
    with pytest.raises(NodeIdTaken, match="beat while this agent watched"):
        register(now_held, info(pid=200, host="host-b"), T0 + LOST, silent=watched)


def test_a_holder_gone_from_this_host_is_replaced_at_once() -> None:
    restarted = info(pid=200)
    assert register(held(info(), T0), restarted, T0 + 0.1, holder_dead=True).node == restarted
    with pytest.raises(NodeIdTaken):  # gone from another host proves nothing here
        register(held(info(host="host-b"), T0), restarted, T0 + 0.1, holder_dead=True)


@pytest.mark.parametrize("cordoned", [True, False])
def test_register_preserves_cordoned(cordoned: bool) -> None:
    me = info()
    assert register(held(me, cordoned=cordoned), me, T0 + 1.0).cordoned is cordoned
    holder = held(info(pid=1), cordoned=cordoned)
    taken_over = register(holder, me, T0 + 60.0, silent=holder)
    assert taken_over.cordoned is cordoned


def test_node_id_taken_is_a_phalanx_runtime_error() -> None:
    assert issubclass(NodeIdTaken, PhalanxError)
    assert issubclass(NodeIdTaken, RuntimeError)


# --- heartbeat -----------------------------------------------------------------------------


def test_heartbeat_increments_seq_and_sets_time_and_slots() -> None:
    me = info()
    new = heartbeat(held(me, T0, seq=9, used=2), me, T0 + 0.5, slots_used=4)
    assert new == NodeRecord(node=me, heartbeat_seq=10, heartbeat_at=T0 + 0.5, slots_used=4)


def test_heartbeats_count_up_from_registration() -> None:
    me = info()
    record = register(None, me, T0)
    for i in range(1, 6):
        record = heartbeat(record, me, T0 + i * 0.5)
        assert record.heartbeat_seq == i
        assert record.heartbeat_at == T0 + i * 0.5


def test_heartbeat_defaults_slots_used_to_zero() -> None:
    me = info()
    assert heartbeat(held(me, used=6), me, T0 + 1.0).slots_used == 0


@pytest.mark.parametrize("cordoned", [True, False])
def test_heartbeat_keeps_cordoned(cordoned: bool) -> None:
    me = info()
    assert heartbeat(held(me, cordoned=cordoned), me, T0 + 1.0).cordoned is cordoned


def test_heartbeat_refreshes_the_node_info() -> None:
    me = info()
    updated = info(labels={"zone": "b"}, agent_version="0.2.0")
    assert heartbeat(held(me), updated, T0 + 1.0).node == updated


def test_heartbeat_re_creates_a_removed_record() -> None:
    me = info()
    new = heartbeat(None, me, T0 + 1.0, slots_used=3)
    assert new == NodeRecord(node=me, heartbeat_seq=0, heartbeat_at=T0 + 1.0, slots_used=3,
                             cordoned=False)


@pytest.mark.parametrize(
    "thief",
    [info(pid=200), info(host="host-b")],
    ids=["other-pid", "other-host"],
)
def test_heartbeat_raises_when_the_record_belongs_to_another_agent(thief: NodeInfo) -> None:
    with pytest.raises(NodeIdTaken) as excinfo:
        heartbeat(held(thief, T0 + 5.0), info(), T0 + 5.5)
    text = str(excinfo.value)
    assert "'gpu-07'" in text
    assert f"pid {thief.agent_pid}" in text
    assert thief.host in text


def test_heartbeat_succeeds_even_when_late() -> None:
    """A late agent whose record nobody took keeps its id."""
    me = info()
    new = heartbeat(held(me, T0, seq=3), me, T0 + 100.0)
    assert new.heartbeat_seq == 4
    assert new.heartbeat_at == T0 + 100.0


def test_take_over_then_old_agents_heartbeat_is_refused() -> None:
    old, new = info(pid=100), info(pid=200)
    record = register(None, old, T0)
    record = register(record, new, T0 + 10.0, silent=record)  # old agent was lost
    with pytest.raises(NodeIdTaken, match="taken over by pid 200 on host-a"):
        heartbeat(record, old, T0 + 10.5)
    assert heartbeat(record, new, T0 + 10.5).heartbeat_seq == 1



# --- which replica a slot may run ----------------------------------------------------------

@pytest.mark.parametrize(("last", "wanted", "verdict"), [
    (None, "r1-0", LaunchVerdict.LAUNCH),
    (None, "r1-3", LaunchVerdict.LAUNCH),  # a restarted elasticity's replacement, first here
    ("r1-0", "r1-1", LaunchVerdict.LAUNCH),
    ("r1-1", "r1-1", LaunchVerdict.ALREADY_LAUNCHED),  # re-sent, running or exited
    ("r1-2", "r1-1", LaunchVerdict.OUTDATED),
    ("r1-10", "r1-9", LaunchVerdict.OUTDATED),  # numbers, not strings, are compared
    ("r1-9", "r1-10", LaunchVerdict.LAUNCH),
    ("worker", "worker", LaunchVerdict.ALREADY_LAUNCHED),  # no incarnation: equality only
    ("worker", "r1-0", LaunchVerdict.LAUNCH),
])
def test_launch_verdict(last: str | None, wanted: str, verdict: LaunchVerdict) -> None:
    assert launch_verdict(last, wanted) is verdict


def test_a_slots_first_replica_is_incarnation_0() -> None:
    assert first_replica(3) == "r3-0"


@pytest.mark.parametrize(("stop", "known", "cause"), [
    (None, True, ExitCause.EXITED),  # it ended by itself
    (StopReason.JOB, True, ExitCause.STOPPED),  # its job no longer wants it: no fault
    (StopReason.JOB, False, ExitCause.STOPPED),  # an adopted rank its job let go
    # The agent shuts down (phalanx down, a restart): the job still wants it, it is lost.
    (StopReason.AGENT, True, ExitCause.LOST),
    (StopReason.AGENT, False, ExitCause.LOST),
    (None, False, ExitCause.LOST),  # found dead by a restarted agent
])
def test_exit_cause(stop: StopReason | None, known: bool, cause: ExitCause) -> None:
    assert exit_cause(stop, status_known=known) is cause
