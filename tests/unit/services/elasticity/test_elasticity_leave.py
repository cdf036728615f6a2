"""Planned shrinks: members whose slots admission took leave at a step boundary."""

from __future__ import annotations

from test_elasticity_core import (  # the same job and helpers
    apply_all,
    generations,
    ready,
    start,
)

from phalanx.schemas.messages import GenerationReason
from phalanx.services.elasticity.core import (
    ElasticityCore,
    JobAdmitted,
    MemberFailed,
    MemberFinished,
    ReplicaExited,
    RetireReplica,
    snapshot,
)

KEPT = {0: "n0", 1: "n1"}  # admission keeps slots 0 and 1 of 0..3


def test_members_of_taken_slots_leave_in_a_leave_generation_without_a_fault() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    [g] = generations(core.handle(JobAdmitted("j", KEPT, 1, 4), 1.0))
    assert (g.generation, g.reason, g.cause) == (1, GenerationReason.LEAVE,
                                                 "left: r2-0, r3-0")
    assert [m.replica_id for m in g.members] == ["r0-0", "r1-0"]
    assert core.jobs["j"].departing == ["r2-0", "r3-0"]
    # Leavers exit 0 after the boundary: not members, so the job is not complete.
    assert core.handle(MemberFinished("j", "r2-0"), 2.0) == []
    assert apply_all(core, 11) == []  # nothing launched where the slots are gone
    assert core.jobs["j"].departing == [] and not core.jobs["j"].complete
    core.check_invariants()


def test_a_leave_waits_for_the_change_in_flight() -> None:
    core = ElasticityCore()
    start(core)  # generation 0 not applied yet
    assert core.handle(JobAdmitted("j", KEPT, 1, 4), 1.0) == []
    [g] = generations(apply_all(core))
    assert g.reason is GenerationReason.LEAVE and g.world_size == 2


def test_a_leaver_stopped_before_the_boundary_is_handled_as_a_fault() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(JobAdmitted("j", KEPT, 1, 4), 1.0)
    # r3-0 overstayed its graceful shutdown timeout: the survivors may be stuck with it.
    [g] = generations(core.handle(ReplicaExited("j", "r3-0", "SIGKILL"), 30.0))
    assert (g.generation, g.reason) == (2, GenerationReason.FAULT)
    assert [m.replica_id for m in g.members] == ["r0-0", "r1-0"]
    assert core.handle(ReplicaExited("j", "r2-0", "SIGKILL"), 31.0) == []  # once is enough
    core.check_invariants()


def test_a_fault_before_the_leave_is_published_drops_the_leavers_too() -> None:
    core = ElasticityCore()
    start(core)  # in flight: the leave waits
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1", 2: "n0"}, 2, 4), 1.0)
    [g] = generations(core.handle(MemberFailed("j", "r1-0"), 2.0))
    assert g.reason is GenerationReason.FAULT
    assert [m.replica_id for m in g.members] == ["r0-0", "r2-0"]
    assert g.cause == "dropped r1-0 (failed); left r3-0"
    core.check_invariants()


def test_a_lost_nodes_members_leave_and_their_node_lost_fault_supersedes_the_leave() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    # Node n1 lost (slots 1 and 3): its members leave like any other; the leave is
    # published at once, though they cannot take part in it.
    [leave] = generations(core.handle(JobAdmitted("j", {0: "n0", 2: "n0"}, 1, 4), 3.0))
    assert leave.reason is GenerationReason.LEAVE
    assert [m.replica_id for m in leave.members] == ["r0-0", "r2-0"]
    # Health's node-lost faults: the survivors may be stuck in a step with the leavers, so
    # the same members start over in a fault generation, and nothing is replaced.
    [fault] = generations(core.handle(MemberFailed("j", "r1-0"), 3.5))
    assert (fault.reason, [m.replica_id for m in fault.members]) == (
        GenerationReason.FAULT, ["r0-0", "r2-0"])
    assert generations(core.handle(MemberFailed("j", "r3-0"), 3.5)) == []
    assert apply_all(core, 5) == []
    core.check_invariants()


def test_a_healthy_member_whose_slot_a_node_loss_gave_back_leaves_before_it_is_stopped() -> None:
    # Sizes [2, 4]: n1 lost (slot 3) leaves 3, not allowed, so admission also gives back
    # slot 2 on the healthy n0. Its member must leave, or the agent stops it after its
    # graceful timeout while the others still count it a member and wait for it.
    core = ElasticityCore()
    four = {0: "n0", 1: "n0", 2: "n0", 3: "n1"}
    core.handle(JobAdmitted("j", four, 2, 4, sizes=(2, 4)), 0.0)
    for replica in ("r0-0", "r1-0", "r2-0", "r3-0"):
        ready(core, replica)
    apply_all(core)
    [leave] = generations(core.handle(JobAdmitted("j", {0: "n0", 1: "n0"}, 2, 4,
                                                  sizes=(2, 4)), 3.0))
    assert (leave.reason, leave.world_size) == (GenerationReason.LEAVE, 2)
    assert core.jobs["j"].departing == ["r2-0", "r3-0"]
    core.check_invariants()


def test_waiting_replicas_of_taken_slots_are_stopped() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r0-0"), 1.0)
    apply_all(core)  # the fault generation applied: r0-1 is launched in slot 0
    decisions = core.handle(JobAdmitted("j", {1: "n1", 2: "n0", 3: "n1"}, 1, 4), 4.0)
    assert [d for d in decisions if isinstance(d, RetireReplica)] == [
        RetireReplica("j", 0, "n0", "r0-1", "")]
    core.check_invariants()


def test_the_leave_survives_a_restart_of_the_service() -> None:
    core = ElasticityCore()
    start(core)
    core.handle(JobAdmitted("j", KEPT, 1, 4), 1.0)  # waits: in flight
    restored = ElasticityCore()
    restored.restore(snapshot(core.jobs["j"]))
    [g] = generations(apply_all(restored))
    assert g.reason is GenerationReason.LEAVE


def test_joiners_wait_for_an_allowed_size() -> None:
    core = ElasticityCore()
    assert core.handle(JobAdmitted("j", {0: "n0", 1: "n1"}, 1, 4, sizes=(2, 4)), 0.0) == []
    ready(core, "r0-0")
    [g0] = generations(ready(core, "r1-0"))
    apply_all(core)
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1", 2: "n0", 3: "n1"}, 1, 4, sizes=(2, 4)), 1.0)
    assert generations(ready(core, "r2-0")) == []  # 3 is not an allowed size
    [g1] = generations(ready(core, "r3-0"))
    assert (g0.world_size, g1.reason, g1.world_size) == (2, GenerationReason.JOIN, 4)


def test_a_leave_below_min_then_a_join_takes_the_leaver_out_as_a_leaver() -> None:
    """Found by the phase walk (tests/property/services/elasticity/test_phase_properties.py):
    slot 0's member leaves while the others are below min, so no leave is published;
    a replica ready in slot 1 then makes min. Its join takes the leaver out in the same
    change (the leaver stayed among the leavers and the replicas, and a later fault of it
    raised ValueError in the core)."""
    core = ElasticityCore()
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1", 2: "n0"}, 2, 3, session=True), 0.0)
    core.handle(MemberFailed("j", "r1-0"), 0.0)  # kept until managed: r1-1 replaces it
    ready(core, "r2-0")
    ready(core, "r0-0")
    core.handle(JobAdmitted("j", {1: "n1", 2: "n0"}, 2, 3, session=True), 1.0)
    apply_all(core)
    [g] = generations(ready(core, "r1-1", 2.0))
    assert [m.replica_id for m in g.members] == ["r2-0", "r1-1"]
    assert g.reason is GenerationReason.JOIN and "left r0-0" in g.cause
    core.check_invariants()
