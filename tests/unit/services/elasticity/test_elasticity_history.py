"""The history says what the members resumed after, not only what elasticity estimated,
and the stored history keeps the job's earlier admissions' generations: a requeued job's
``phalanx job`` still shows what happened before it was admitted again."""

from __future__ import annotations

import msgspec

from phalanx.schemas.messages import (
    HISTORY_LIMIT,
    GenerationReason,
    GenerationRecord,
    JobHistory,
    StateSource,
)
from phalanx.services.elasticity.core import (
    ElasticityCore,
    GenerationAppliedSeen,
    JobAdmitted,
    JobStopped,
    MemberFailed,
    ReplicaReadySeen,
)
from phalanx.services.elasticity.history import carried


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


# --- across admissions (services/elasticity/history.py) ----------------------------

T0 = 1_795_700_000.0


def g(number: int, at: float, reason: GenerationReason = GenerationReason.FAULT,
      applied: int | None = None) -> GenerationRecord:
    return GenerationRecord(generation=number, reason=reason, world_size=2,
                            members=["r0-0", "r1-0"], resume_step=number, decided_at=at,
                            cause="admitted", applied_resume_step=applied)


START = GenerationReason.START


def history(*generations: GenerationRecord, earlier: tuple = ()) -> JobHistory:
    return JobHistory(job_id="j", generations=list(generations), earlier=list(earlier))


def test_the_first_history_is_stored_as_it_is() -> None:
    new = history(g(0, T0, START))
    assert carried(None, new) == new


def test_the_same_admission_keeps_what_was_earlier_and_replaces_its_own() -> None:
    before = history(g(0, T0, START), earlier=(g(0, T0 - 100, START),))
    # The core's next history: a generation more, and the first one's report arrived.
    new = history(g(0, T0, START, applied=0), g(1, T0 + 5))
    assert carried(before, new) == msgspec.structs.replace(new, earlier=before.earlier)


def test_a_new_admission_moves_the_stored_generations_to_earlier() -> None:
    first = [g(0, T0 - 100, START), g(1, T0 - 90)]
    second = [g(0, T0 - 50, START), g(1, T0 - 40), g(2, T0 - 30)]
    stored = history(*second, earlier=tuple(first))
    new = history(g(0, T0, START))
    assert carried(stored, new).earlier == [*first, *second]
    assert carried(stored, new).generations == new.generations
    # Admitted again, no generation decided yet: what was stored is another admission's.
    assert carried(stored, history()).earlier == [*first, *second]


def test_the_core_trimming_its_old_end_is_still_the_same_admission() -> None:
    stored = history(*(g(n, T0 + n) for n in range(5)), earlier=(g(0, T0 - 9, START),))
    trimmed = history(*(g(n, T0 + n) for n in range(2, 7)))
    assert carried(stored, trimmed).earlier == stored.earlier


def test_earlier_generations_are_bounded_keeping_the_latest() -> None:
    many = tuple(g(n, T0 + n) for n in range(HISTORY_LIMIT + 10))
    stored = history(g(0, T0 + 1000, START), earlier=many)
    kept = carried(stored, history(g(0, T0 + 2000, START))).earlier
    assert len(kept) == HISTORY_LIMIT and kept[-1] == stored.generations[0]


def test_a_requeued_job_admitted_again_keeps_its_first_admissions_generations() -> None:
    """The core forgets a stopped job; what the shell stores carries it on."""
    core = ElasticityCore()
    started(core)
    [first] = core.take_histories()
    stored = carried(None, first)
    core.handle(JobStopped("j"), 5.0)
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1"}, 2, 3), 9.0)
    for slot in range(2):
        core.handle(ReplicaReadySeen("j", f"r{slot}-0", f"n{slot}", slot, f"h:{slot}"), 9.0)
    [second] = core.take_histories()
    stored = carried(stored, second)
    assert [(r.generation, r.world_size) for r in stored.earlier] == [(0, 3)]
    assert [(r.generation, r.world_size) for r in stored.generations] == [(0, 2)]


def test_an_earlier_admissions_events_never_reach_the_next_one() -> None:
    """Found by the failover test of a requeued job: a leader that took over while the job
    was pending read its earlier admission's readiness from the stream, kept it as early,
    and formed the next admission's generation 0 with the dead replicas' endpoints."""
    core = ElasticityCore()  # a new leader: it never ran the job
    core.handle(JobStopped("j"), 1.0)  # its record, pending
    for slot in range(2):  # read from the stream: the earlier admission's
        core.handle(ReplicaReadySeen("j", f"r{slot}-0", "old", slot, f"old:{slot}"), 1.0)
    assert core.handle(JobAdmitted("j", {0: "n1", 1: "n0"}, 2, 2), 2.0) == []
    decisions = [d for slot in range(2) for d in core.handle(
        ReplicaReadySeen("j", f"r{slot}-0", f"n{1 - slot}", slot, f"new:{slot}"), 3.0)]
    [published] = [d.generation for d in decisions if hasattr(d, "generation")]
    assert [m.endpoint for m in published.members] == ["new:0", "new:1"]


def test_a_job_admitted_again_resumes_at_the_step_it_had_reached() -> None:
    """Its first generation tells the members the step the earlier admissions reached
    (health's ``JobProgress.reached``), so that they fetch and restore it or say what
    was lost; a first admission knows of no such step."""
    for admission, reached, expected in ((2, 300, 300), (1, 300, 0), (3, 0, 0)):
        core = ElasticityCore()
        core.handle(JobAdmitted("j", {0: "n0", 1: "n1"}, 2, 2, admission=admission,
                                reached=reached), 0.0)
        decisions = [d for slot in range(2) for d in core.handle(
            ReplicaReadySeen("j", f"r{slot}-0", f"n{slot}", slot, f"h:{slot}",
                             admission=admission), 1.0)]
        [first] = [d.generation for d in decisions if hasattr(d, "generation")]
        assert (first.generation, first.resume_step) == (0, expected), admission
