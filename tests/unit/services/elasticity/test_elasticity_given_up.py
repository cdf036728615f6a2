"""A generation its members gave up is decided again: once, and only on a report that
counts (the current generation, by one of its members, while it is in flight)."""

from __future__ import annotations

import msgspec
import pytest
from test_elasticity_core import apply_all, generations, ready, start  # the same job

from phalanx.schemas.messages import GenerationReason
from phalanx.services.elasticity.core import (
    ElasticityCore,
    GenerationAppliedSeen,
    GenerationGivenUpSeen,
    JobAdmitted,
    LaunchReplacement,
    MemberFailed,
    MemberFinished,
    PublishGeneration,
    snapshot,
)
from phalanx.services.elasticity.generations import cut_off

TIMED_OUT = "timed out connecting to h:9000\nTraceback ..."


def gave_up(core: ElasticityCore, replica: str, generation: int, now: float = 5.0) -> list:
    return core.handle(GenerationGivenUpSeen("j", generation, replica, TIMED_OUT,
                                             event_id=f"given-up:{replica}"), now)


def after_a_fault(core: ElasticityCore) -> None:
    """Generation 1 of r0-0, r1-0, r2-0 (r3-0 failed after step 20) is in flight."""
    start(core)
    apply_all(core, step=20)
    [g1] = generations(core.handle(MemberFailed("j", "r3-0", "SIGKILL"), 1.0))
    assert [m.replica_id for m in g1.members] == ["r0-0", "r1-0", "r2-0"]


def test_a_generation_its_members_gave_up_is_decided_again_with_them_once() -> None:
    core = ElasticityCore()
    after_a_fault(core)
    out = gave_up(core, "r1-0", 1)
    [g2] = generations(out)
    assert [(m.replica_id, m.rank, m.endpoint) for m in g2.members] == [
        ("r0-0", 0, "h:9000"), ("r1-0", 1, "h:9001"), ("r2-0", 2, "h:9002")]
    assert (g2.generation, g2.reason, g2.resume_step, g2.rendezvous) == (
        2, GenerationReason.FAULT, 20, "j-g2")
    # Its cause quotes the first line of what the rendezvous failed with.
    assert g2.cause == "r1-0 gave up generation 1 (timed out connecting to h:9000)"
    assert next(d for d in out if isinstance(d, PublishGeneration)).cause == "given-up:r1-0"
    assert core.jobs["j"].history[-1].cause == g2.cause
    # The other member's report, and the first one repeated, name a generation decided
    # again already: nothing more.
    assert gave_up(core, "r0-0", 1) == [] and gave_up(core, "r1-0", 1) == []
    assert not generations(apply_all(core, step=20))
    core.check_invariants()


def test_reports_that_do_not_name_the_current_generation_by_a_member_are_ignored() -> None:
    core = ElasticityCore()
    assert gave_up(core, "r0-0", 0) == []  # a job not admitted yet: kept, then stale
    core.handle(JobAdmitted("j", {i: f"n{i % 2}" for i in range(4)}, 2, 4), 0.0)
    assert ready(core, "r0-0") == []
    assert gave_up(core, "r0-0", 0) == []  # no generation yet
    for replica in ("r1-0", "r2-0"):
        ready(core, replica)
    assert len(generations(ready(core, "r3-0"))) == 1
    assert gave_up(core, "r9-0", 0) == []  # not a member
    assert gave_up(core, "r0-0", 1) == []  # a generation not decided (a bad report)
    apply_all(core)
    core.handle(MemberFailed("j", "r3-0"), 1.0)
    core.handle(MemberFinished("j", "r0-0"), 2.0)
    assert gave_up(core, "r1-0", 1) == []  # the training is over
    core.check_invariants()


def test_a_fault_and_a_give_up_in_either_order_end_in_a_generation_of_the_survivors() -> None:
    endings = []
    for fault_first in (True, False):
        core = ElasticityCore()
        after_a_fault(core)
        fault = MemberFailed("j", "r2-0", "SIGKILL", event_id="f2")
        published = []
        if fault_first:
            published += generations(core.handle(fault, 6.0))
            published += generations(gave_up(core, "r0-0", 1))  # superseded: stale
        else:
            published += generations(gave_up(core, "r0-0", 1))
            published += generations(core.handle(fault, 6.0))
        # Every member's late or repeated report changes nothing.
        for generation in range(1, published[-1].generation):
            for replica in ("r0-0", "r1-0"):
                assert gave_up(core, replica, generation) == []
        last = published[-1]
        assert [m.replica_id for m in last.members] == ["r0-0", "r1-0"]
        assert last.reason is GenerationReason.FAULT and last.resume_step == 20
        assert len(published) == (1 if fault_first else 2)
        assert not generations(apply_all(core, step=20))
        core.check_invariants()
        endings.append([m.replica_id for m in last.members])
    assert endings[0] == endings[1]


def test_a_joiner_ready_when_the_generation_is_given_up_joins_the_one_decided_again() -> None:
    core = ElasticityCore()
    start(core, n=4, lo=2, hi=5)
    # Admission grows the job while generation 0 is still in flight: the newcomer,
    # ready, waits for the change in flight.
    assert core.handle(JobAdmitted("j", {i: f"n{i % 2}" for i in range(5)}, 2, 5), 1.0) == []
    assert ready(core, "r4-0", 2.0) == []
    [g1] = generations(gave_up(core, "r0-0", 0))
    assert [m.replica_id for m in g1.members] == ["r0-0", "r1-0", "r2-0", "r3-0", "r4-0"]
    assert g1.reason is GenerationReason.FAULT
    assert g1.cause == ("r0-0 gave up generation 0 (timed out connecting to h:9000); "
                        "joined r4-0")
    core.check_invariants()


def test_given_up_below_min_waits_and_is_decided_when_enough_are_ready() -> None:
    core = ElasticityCore(wait_timeout_s=60)
    start(core, n=3, lo=3, hi=3)
    # r2-0 fails while generation 0 forms: below min, nothing can be decided yet.
    assert not generations(core.handle(MemberFailed("j", "r2-0", "SIGKILL"), 1.0))
    assert gave_up(core, "r0-0", 0) == []
    [g1] = generations(ready(core, "r2-1", 3.0))
    assert [m.replica_id for m in g1.members] == ["r0-0", "r1-0", "r2-1"]
    assert g1.cause == ("r0-0 gave up generation 0 (timed out connecting to h:9000); "
                        "dropped r2-0 (SIGKILL); joined r2-1")
    assert core.jobs["j"].given_up == ""
    core.check_invariants()


def test_a_snapshot_taken_before_the_report_existed_restores() -> None:
    core = ElasticityCore()
    after_a_fault(core)
    fields = msgspec.msgpack.decode(snapshot(core.jobs["j"]))
    del fields["given_up"]
    restored = ElasticityCore()
    restored.restore(msgspec.msgpack.encode(fields))
    assert restored.jobs["j"].given_up == ""
    [g2] = generations(restored.handle(GenerationGivenUpSeen("j", 1, "r0-0"), 5.0))
    assert g2.generation == 2 and g2.cause == "r0-0 gave up generation 1 (rendezvous failed)"


def test_a_generation_trained_in_whose_collectives_failed_unfaulted_is_formed_again() -> None:
    """Every member applied generation 1, then a link between members was cut (or lost
    packets): their collectives failed, nobody died, no fault comes. A member's report
    is the only news; without it the job deadlocked (issue 53, 20 % loss)."""
    core = ElasticityCore()
    after_a_fault(core)
    for replica in ("r0-0", "r1-0", "r2-0"):
        core.handle(GenerationAppliedSeen("j", 1, replica, 21), 3.0)
    [g2] = generations(gave_up(core, "r2-0", 1))
    assert g2.generation == 2 and g2.reason is GenerationReason.FAULT
    assert [m.replica_id for m in g2.members] == ["r0-0", "r1-0", "r2-0"]
    assert gave_up(core, "r0-0", 1) == []  # the same news again: re-formed once
    core.check_invariants()


def cut(core: ElasticityCore, replica: str, generation: int, *unreachable: str,
        now: float = 5.0) -> list:
    """``replica``'s report that its collectives in ``generation`` made no progress and
    the nodes of ``unreachable`` answered no connect."""
    return core.handle(GenerationGivenUpSeen(
        "j", generation, replica, "no progress for 3 s and no answer", unreachable=unreachable,
        event_id=f"given-up:{replica}:g{generation}"), now)


def test_a_cut_between_two_halves_drops_the_half_without_rank_0_whoever_reports_first(
        ) -> None:
    """Four members, r0-0 r1-0 | r2-0 r3-0 cut apart, the bus reaching all: both halves
    report the other unreachable. The half of rank 0 stays whichever report comes first,
    and the other half is not replaced (its node is cut off: a replacement there could
    not reach the rest either)."""
    endings = []
    for rank_0_first in (True, False):
        core = ElasticityCore()
        start(core)
        apply_all(core, step=30)
        published = []
        if not rank_0_first:
            assert cut(core, "r3-0", 0, "r0-0", "r1-0") == []  # the tie's other half
        out = cut(core, "r1-0", 0, "r2-0", "r3-0")
        published += generations(out)
        assert not [d for d in out if isinstance(d, LaunchReplacement)]
        # The other half's reports, late, name a generation decided again already.
        assert cut(core, "r2-0", 0, "r0-0", "r1-0") == []
        assert cut(core, "r0-0", 0, "r2-0", "r3-0") == []
        [g1] = published
        assert [m.replica_id for m in g1.members] == ["r0-0", "r1-0"]
        assert (g1.reason, g1.resume_step) == (GenerationReason.FAULT, 30)
        assert g1.cause == "dropped r2-0 (unreachable from r1-0), r3-0 (unreachable from r1-0)"
        # Their Dropped exits (faults, as health sees them) replace nothing.
        for replica in ("r2-0", "r3-0"):
            assert core.handle(MemberFailed("j", replica, "exit code 76"), 6.0) == []
        assert not generations(apply_all(core, step=30))
        core.check_invariants()
        endings.append(g1.members)
    assert endings[0] == endings[1]


def test_a_member_cut_off_from_the_rest_cannot_drop_the_rest() -> None:
    """r3-0's own link is down: it names the three others, and is the smaller side; the
    others' report drops it."""
    core = ElasticityCore()
    start(core)
    apply_all(core, step=30)
    assert cut(core, "r3-0", 0, "r0-0", "r1-0", "r2-0") == []
    [g1] = generations(cut(core, "r2-0", 0, "r3-0"))
    assert [m.replica_id for m in g1.members] == ["r0-0", "r1-0", "r2-0"]
    core.check_invariants()


@pytest.mark.parametrize(("members", "reporter", "unreachable", "dropped"), [
    (["a", "b", "c", "d"], "a", ("c", "d"), ["c", "d"]),    # a tie, with rank 0
    (["a", "b", "c", "d"], "c", ("a", "b"), []),            # a tie, without rank 0
    (["a", "b", "c"], "c", ("a",), ["a"]),                  # rank 0 alone on its side
    (["a", "b", "c"], "a", ("b", "c"), []),                 # the smaller side
    (["a", "b"], "a", ("a", "x"), []),                      # itself, a non-member
    (["a", "b"], "x", ("b",), []),                          # not a member's report
])
def test_the_larger_side_of_a_cut_stays(members: list[str], reporter: str,
                                       unreachable: tuple[str, ...], dropped: list[str]
                                       ) -> None:
    assert cut_off(members, reporter, unreachable) == dropped
