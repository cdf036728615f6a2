"""The history says what the members resumed after, not only what elasticity estimated."""

from __future__ import annotations

from phalanx.schemas.messages import StateSource
from phalanx.services.elasticity.core import (
    ElasticityCore,
    GenerationAppliedSeen,
    JobAdmitted,
    MemberFailed,
    ReplicaReadySeen,
)


def started(core: ElasticityCore) -> None:
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1", 2: "n0"}, 2, 3), 0.0)
    for slot in range(3):
        core.handle(ReplicaReadySeen("j", f"r{slot}-0", f"n{slot % 2}", slot, f"h:{9000 + slot}"),
                    0.0)


def test_the_members_report_of_the_resume_step_is_kept_beside_the_estimate() -> None:
    core = ElasticityCore()
    started(core)
    for replica in ("r0-0", "r1-0", "r2-0"):
        core.handle(GenerationAppliedSeen("j", 0, replica, 1, resume_step=0), 1.0)
    core.take_histories()
    # Elasticity last heard of step 1; the members had committed 59 when one failed.
    core.handle(MemberFailed("j", "r2-0", "crash"), 2.0)
    [history] = core.take_histories()
    assert [(g.resume_step, g.applied_resume_step) for g in history.generations] == [
        (0, 0), (1, None)]
    core.handle(GenerationAppliedSeen("j", 1, "r0-0", 60, resume_step=59,
                                  restored_from=StateSource.MEMORY), 3.0)
    [history] = core.take_histories()
    assert [(g.resume_step, g.applied_resume_step) for g in history.generations] == [
        (0, 0), (1, 59)]
    # And where the members' state came from (a restore from the nodes' memory).
    assert [g.restored_from for g in history.generations] == [None, StateSource.MEMORY]
    # A second member's report of the same generation changes nothing.
    core.handle(GenerationAppliedSeen("j", 1, "r1-0", 61, resume_step=59), 3.5)
    assert core.take_histories() == []


def test_a_late_report_of_an_earlier_generation_still_lands_on_it() -> None:
    core = ElasticityCore()
    started(core)
    core.handle(MemberFailed("j", "r2-0", "crash"), 1.0)  # g1 decided before g0 applied
    core.take_histories()
    core.handle(GenerationAppliedSeen("j", 0, "r0-0", 5, resume_step=0), 2.0)
    [history] = core.take_histories()
    assert [g.applied_resume_step for g in history.generations] == [0, None]
