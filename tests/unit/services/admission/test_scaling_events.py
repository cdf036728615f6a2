"""Admission announces every size change, pin and release, and follows a planned change to
done (the runtime runs at its size) or abandons it at its ``scaling_timeout_s`` deadline."""

from __future__ import annotations

from phalanx.schemas.messages import (
    JobSpec,
    ReasonCode,
    ReplicaRange,
    ScalingEventKind,
    ScalingPolicy,
)
from phalanx.services.admission.changes import Announce
from phalanx.services.admission.core import AdmissionCore
from phalanx.services.admission.events import (
    Decision,
    Grow,
    JobFinished,
    JobSubmitted,
    MembershipChanged,
    NodeUpdated,
    ScalePinned,
    Shrink,
)
from phalanx.services.admission.policy import AdmissionPolicy

T0 = 1_717_000_000.0
GROW, SHRINK, DONE, TIMEOUT = (ScalingEventKind.GROW, ScalingEventKind.SHRINK,
                               ScalingEventKind.DONE, ScalingEventKind.TIMEOUT)


def elastic(timeout_s: float = 60.0) -> JobSpec:
    return JobSpec(name="e", team="t", priority_class="low",
                   replicas=ReplicaRange(min=1, max=4), command=["x"],
                   scaling=ScalingPolicy(scaling_timeout_s=timeout_s))


def rigid(size: int) -> JobSpec:
    return JobSpec(name="r", team="t", priority_class="high",
                   replicas=ReplicaRange(min=size, max=size), command=["x"])


def cluster(slots: int = 4) -> AdmissionCore:
    core = AdmissionCore(AdmissionPolicy())
    core.handle(NodeUpdated("n0", slots, "d0", {}), T0)
    return core


def run(core: AdmissionCore, events: list, now: float) -> list[Decision]:
    decisions = core.step(events, now)
    core.check_invariants()
    return decisions


def told(decisions: list[Decision]) -> list[tuple[ScalingEventKind, int, int, float | None]]:
    return [(d.kind, d.from_replicas, d.to_replicas, d.deadline) for d in decisions
            if isinstance(d, Announce)]


def running_at_four(core: AdmissionCore, *, managed: bool = True) -> None:
    run(core, [JobSubmitted("e", elastic(), T0)], T0)
    if managed:  # its runtime reports the membership of its placement
        run(core, [MembershipChanged("e", 4)], T0)


def test_a_preemption_shrink_is_followed_until_the_runtime_runs_at_its_size() -> None:
    core = cluster()
    running_at_four(core)
    decisions = run(core, [JobSubmitted("r", rigid(2), T0 + 1)], T0 + 1)
    assert told(decisions) == [(SHRINK, 4, 2, T0 + 61)]
    change = core.gangs["e"].change
    assert change is not None and (change.from_replicas, change.to_replicas) == (4, 2)
    assert "preempted for r" in change.reason
    assert told(run(core, [MembershipChanged("e", 3)], T0 + 2)) == []  # not its size
    assert told(run(core, [MembershipChanged("e", 2)], T0 + 3)) == [(DONE, 4, 2, T0 + 61)]
    assert core.gangs["e"].change is None
    assert told(run(core, [], T0 + 100)) == []  # nothing left to abandon


def test_a_growth_not_done_by_its_deadline_is_abandoned_and_gives_its_slots_back() -> None:
    core = cluster()
    running_at_four(core)
    run(core, [JobSubmitted("r", rigid(2), T0 + 1), MembershipChanged("e", 2)], T0 + 1)
    grown = run(core, [JobFinished("r")], T0 + 2)
    assert [type(d) for d in grown if d.job_id == "e" and not isinstance(d, Announce)] \
        == [Grow]
    assert told(grown) == [(GROW, 2, 4, T0 + 62)]
    assert told(run(core, [], T0 + 61.9)) == []  # before the deadline: still waiting
    abandoned = run(core, [], T0 + 62)
    assert told(abandoned)[:2] == [(TIMEOUT, 2, 4, T0 + 62), (SHRINK, 4, 2, T0 + 122)]
    shrinks = [d for d in abandoned if isinstance(d, Shrink)]
    assert len(shrinks[0].nodes) == 2 and shrinks[0].reason.code is ReasonCode.SCALED
    assert "not done within scaling_timeout_s = 60 s" in shrinks[0].reason.message
    # The runtime runs at 2 already (the joiners never joined): that shrink is done at once,
    # and the free slots are grown into again with fresh replicas (cooldown 0).
    assert told(abandoned)[2:] == [(DONE, 4, 2, T0 + 122), (GROW, 2, 4, T0 + 122)]
    assert len(core.gangs["e"].nodes) == 4


def test_a_pin_and_its_release_are_announced_and_the_pin_shrink_is_planned() -> None:
    core = cluster()
    running_at_four(core)
    pinned = run(core, [ScalePinned("e", 2)], T0 + 1)
    assert told(pinned) == [(ScalingEventKind.PIN, 4, 2, None), (SHRINK, 4, 2, T0 + 61)]
    assert [d.reason.code for d in pinned if isinstance(d, Shrink)] == [ReasonCode.SCALED]
    run(core, [MembershipChanged("e", 2)], T0 + 1)  # the leavers left
    released = run(core, [ScalePinned("e", None)], T0 + 2)
    assert told(released) == [(ScalingEventKind.RELEASE, 2, 2, None),
                              (GROW, 2, 4, T0 + 62)]


def test_a_node_lost_shrink_is_announced_but_not_a_planned_change() -> None:
    core = AdmissionCore(AdmissionPolicy())
    for node in ("n0", "n1"):
        core.handle(NodeUpdated(node, 2, node, {}), T0)
    running_at_four(core)
    lost = run(core, [NodeUpdated("n1", 2, "n1", {}, alive=False)], T0 + 1)
    assert told(lost) == [(SHRINK, 4, 2, None)]
    assert core.gangs["e"].change is None


def test_a_job_not_under_the_runtime_is_announced_but_never_abandoned() -> None:
    core = cluster()
    running_at_four(core, managed=False)
    run(core, [JobSubmitted("r", rigid(2), T0 + 1)], T0 + 1)
    grown = run(core, [JobFinished("r")], T0 + 2)
    assert told(grown) == [(GROW, 2, 4, None)]
    assert told(run(core, [], T0 + 1000)) == []


def test_a_restored_leader_abandons_the_stored_change_at_the_same_deadline() -> None:
    core = cluster()
    running_at_four(core)
    run(core, [JobSubmitted("r", rigid(2), T0 + 1), MembershipChanged("e", 2)], T0 + 1)
    run(core, [JobFinished("r")], T0 + 2)
    gang = core.gangs["e"]
    restored = cluster()
    restored.restore(JobSubmitted("e", gang.spec, T0, change=gang.change), list(gang.nodes),
                     T0 + 30)
    restored.check_invariants()
    assert told(restored.schedule(T0 + 61)) == []
    abandoned = restored.schedule(T0 + 62)
    assert told(abandoned)[0] == (TIMEOUT, 2, 4, T0 + 62)
    assert [len(d.nodes) for d in abandoned if isinstance(d, Shrink)] == [2]
