"""Generations: start, faults, joins, one change at a time, waiting below min."""

from __future__ import annotations

import pytest

from phalanx.schemas.messages import GenerationReason
from phalanx.services.elasticity.core import (
    ElasticityCore,
    GenerationApplied,
    JobStarted,
    JobStopped,
    MemberFailed,
    PublishGeneration,
    ReplicaReady,
    RequestReplacements,
    Requeue,
)


def start(core: ElasticityCore, n: int = 4, lo: int = 2, hi: int = 4) -> PublishGeneration:
    [published] = core.handle(JobStarted("j", tuple((f"r{i}", f"n{i % 2}") for i in range(n)),
                                         lo, hi), 0.0)
    assert isinstance(published, PublishGeneration)
    return published


def apply_all(core: ElasticityCore, step: int = 10, now: float = 0.0) -> list:
    job = core.jobs["j"]
    out = []
    for replica in job.members:
        if replica not in job.failed:
            out += core.handle(GenerationApplied("j", job.current.generation, replica,
                                                 step), now)
    return out


def test_start_is_generation_zero_with_ranks_in_order() -> None:
    g = start(ElasticityCore()).generation
    assert (g.generation, g.world_size, g.reason) == (0, 4, GenerationReason.START)
    assert [m.replica_id for m in g.members] == ["r0", "r1", "r2", "r3"]
    assert g.rendezvous == "j-g0"


def test_a_fault_drops_the_member_and_survivors_keep_their_order() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core, step=20)
    [published] = core.handle(MemberFailed("j", "r1", "crash"), 1.0)
    g = published.generation
    assert (g.generation, g.reason, g.resume_step) == (1, GenerationReason.FAULT, 20)
    assert [m.replica_id for m in g.members] == ["r0", "r2", "r3"]
    assert [m.rank for m in g.members] == [0, 1, 2]
    assert "r1 (crash)" in g.cause


def test_faults_during_a_change_fold_into_the_next_one() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r1"), 1.0)  # generation 1 in flight
    assert core.handle(MemberFailed("j", "r2"), 1.1) == []  # waits for g1 to complete
    out = apply_all(core)
    [published] = [d for d in out if isinstance(d, PublishGeneration)]
    assert [m.replica_id for m in published.generation.members] == ["r0", "r3"]
    assert published.generation.generation == 2


def test_resume_step_is_the_highest_committed_by_a_survivor() -> None:
    core = ElasticityCore()
    start(core)
    for replica, step in (("r0", 7), ("r1", 9), ("r2", 8), ("r3", 8)):
        core.handle(GenerationApplied("j", 0, replica, step), 0.0)
    [published] = core.handle(MemberFailed("j", "r0"), 1.0)
    assert published.generation.resume_step == 9
    [published] = [d for d in apply_all(core, step=9) + core.handle(
        MemberFailed("j", "r1"), 2.0) if isinstance(d, PublishGeneration)]
    assert published.generation.resume_step == 9  # r1 is gone, the others reached 9


def test_a_ready_replica_joins_at_the_end_up_to_max() -> None:
    core = ElasticityCore()
    start(core, n=3, lo=2, hi=4)
    apply_all(core)
    [published] = core.handle(ReplicaReady("j", "r9", "n5"), 1.0)
    g = published.generation
    assert g.reason is GenerationReason.JOIN and g.members[-1].replica_id == "r9"
    assert g.members[-1].node_id == "n5" and g.world_size == 4
    apply_all(core)
    assert core.handle(ReplicaReady("j", "r10", "n6"), 2.0) == []  # at max: waits


def test_below_min_waits_requests_replacements_then_requeues() -> None:
    core = ElasticityCore(wait_timeout_s=30)
    start(core, n=2, lo=2, hi=2)
    apply_all(core)
    out = core.handle(MemberFailed("j", "r1"), 5.0)
    assert out == [RequestReplacements("j", 1, "")]
    assert core.tick(20.0) == []
    [requeue] = core.tick(36.0)
    assert isinstance(requeue, Requeue) and "minimum of 2" in requeue.reason
    assert "j" not in core.jobs


def test_a_replacement_restores_the_job_before_the_timeout() -> None:
    core = ElasticityCore(wait_timeout_s=30)
    start(core, n=2, lo=2, hi=2)
    apply_all(core, step=3)
    core.handle(MemberFailed("j", "r1"), 5.0)
    [published] = core.handle(ReplicaReady("j", "r7", "n3"), 6.0)
    g = published.generation
    assert [m.replica_id for m in g.members] == ["r0", "r7"] and g.resume_step == 3
    assert core.tick(100.0) == []  # no longer waiting


def test_events_for_unknown_jobs_and_replays_are_ignored() -> None:
    core = ElasticityCore()
    assert core.handle(MemberFailed("nope", "r0"), 0.0) == []
    start(core)
    assert core.handle(JobStarted("j", (("x", "n"),), 1, 1), 0.0) == []
    core.handle(JobStopped("j"), 1.0)
    assert core.jobs == {}
    with pytest.raises(TypeError):
        core.handle("not an event", 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1 <= min <= max"):
        core.handle(JobStarted("k", (("x", "n"),), 3, 2), 0.0)
