"""Generations: gang formation, faults, replacements, joins, one change at a time, waiting."""

from __future__ import annotations

import pytest

from phalanx.schemas.errors import StoredStateError
from phalanx.schemas.messages import GenerationReason
from phalanx.services.elasticity.core import (
    EARLY_TTL_S,
    GATHER_S,
    ElasticityCore,
    GenerationAppliedSeen,
    JobAdmitted,
    JobStopped,
    LaunchReplacement,
    MemberFailed,
    MemberFinished,
    PublishGeneration,
    ReplicaExited,
    ReplicaReadySeen,
    Requeue,
    RetireReplica,
    snapshot,
)


def ready(core: ElasticityCore, replica: str, now: float = 0.0) -> list:
    slot = int(replica[1:].split("-")[0])
    seen = ReplicaReadySeen("j", replica, f"n{slot % 2}", slot, f"h:{9000 + slot}")
    return core.handle(seen, now)


def start(core: ElasticityCore, n: int = 4, lo: int = 2, hi: int = 4) -> PublishGeneration:
    assert core.handle(JobAdmitted("j", {i: f"n{i % 2}" for i in range(n)}, lo, hi), 0.0) == []
    out = []
    for slot in reversed(range(n)):  # readiness order does not decide ranks
        out += ready(core, f"r{slot}-0")
    [published] = out
    assert isinstance(published, PublishGeneration)
    return published


def apply_all(core: ElasticityCore, step: int = 10, now: float = 0.0) -> list:
    job = core.jobs["j"]
    out = []
    for replica in job.members:
        if replica not in job.failed:
            out += core.handle(GenerationAppliedSeen("j", job.current.generation, replica,
                                                 step), now)
    return out


def generations(decisions: list) -> list:
    return [d.generation for d in decisions if isinstance(d, PublishGeneration)]


def test_generation_zero_forms_once_every_replica_is_ready_in_slot_order() -> None:
    core = ElasticityCore()
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1", 2: "n0"}, 2, 3), 0.0)
    assert ready(core, "r2-0") == [] and ready(core, "r0-0") == []
    [g] = generations(ready(core, "r1-0"))
    assert (g.generation, g.world_size, g.reason) == (0, 3, GenerationReason.START)
    assert [(m.replica_id, m.rank, m.endpoint) for m in g.members] == [
        ("r0-0", 0, "h:9000"), ("r1-0", 1, "h:9001"), ("r2-0", 2, "h:9002")]
    assert g.rendezvous == "j-g0" and g.resume_step == 0


def test_a_replica_failing_at_start_up_is_replaced_and_the_rest_form_the_gang() -> None:
    core = ElasticityCore()
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1", 2: "n0"}, 2, 3), 0.0)
    ready(core, "r0-0")
    ready(core, "r1-0")
    out = core.handle(MemberFailed("j", "r2-0", "exit 1"), 1.0)
    [g] = generations(out)
    assert [m.replica_id for m in g.members] == ["r0-0", "r1-0"]
    # The replacement starts once the members have applied generation 0.
    assert apply_all(core) == [LaunchReplacement("j", 2, "n0", "r2-1")]
    [g1] = generations(ready(core, "r2-1"))
    assert g1.reason is GenerationReason.JOIN and g1.members[-1].replica_id == "r2-1"


def test_a_fault_drops_the_member_keeps_order_and_launches_a_replacement() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core, step=20)
    out = core.handle(MemberFailed("j", "r1-0", "SIGKILL", event_id="f1"), 1.0)
    # During recovery only from a warm spare; cold once the survivors have recovered.
    assert [d for d in out if isinstance(d, LaunchReplacement)] == [
        LaunchReplacement("j", 1, "n1", "r1-1", "f1", warm_only=True)]
    [g] = generations(out)
    assert [(m.replica_id, m.rank) for m in g.members] == [("r0-0", 0), ("r2-0", 1), ("r3-0", 2)]
    assert (g.generation, g.reason, g.resume_step) == (1, GenerationReason.FAULT, 20)
    assert g.rendezvous == "j-g1" and "r1-0 (SIGKILL)" in g.cause
    assert next(d for d in out if isinstance(d, PublishGeneration)).cause == "f1"
    assert apply_all(core) == [LaunchReplacement("j", 1, "n1", "r1-1", "f1")]


def test_a_spare_taken_during_recovery_joins_at_once_and_is_not_asked_for_again() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    [warm] = [d for d in core.handle(MemberFailed("j", "r1-0"), 1.0)
              if isinstance(d, LaunchReplacement)]
    assert warm.warm_only and warm.replica_id == "r1-1"
    # Ready while generation 1 is in flight: it supersedes it, the survivors rebuilding
    # once more with the spare instead of training a step without it.
    [g] = generations(ready(core, "r1-1"))
    assert (g.generation, g.reason) == (2, GenerationReason.JOIN)
    assert [m.replica_id for m in g.members] == ["r0-0", "r2-0", "r3-0", "r1-1"]
    out = apply_all(core)
    assert not generations(out)
    assert not [d for d in out if isinstance(d, LaunchReplacement)]  # not asked for cold
    core.check_invariants()


def test_a_replacement_not_started_from_a_spare_is_asked_for_cold_once_after_recovery(
        ) -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r1-0"), 1.0)
    # Nothing more is asked of a spare while the change stays in flight.
    job = core.jobs["j"]
    assert not [d for d in core.handle(GenerationAppliedSeen("j", 1, job.members[0], 10), 1.0)
                if isinstance(d, LaunchReplacement)]
    assert apply_all(core) == [LaunchReplacement("j", 1, "n1", "r1-1")]
    assert apply_all(core) == []


def test_a_cold_replacement_joins_only_when_ready_and_after_the_change_in_flight() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r1-0"), 1.0)  # no spare took it: asked cold once applied
    assert apply_all(core, step=30) == [LaunchReplacement("j", 1, "n1", "r1-1")]
    core.handle(MemberFailed("j", "r3-0"), 2.0)  # generation 2 in flight
    assert generations(ready(core, "r1-1")) == []  # a cold start waits for the change
    [g] = generations(apply_all(core, step=31))
    assert [m.replica_id for m in g.members] == ["r0-0", "r2-0", "r1-1"]
    assert (g.generation, g.reason, g.resume_step) == (3, GenerationReason.JOIN, 31)


def test_the_history_keeps_every_generation_its_pause_and_the_replacements() -> None:
    core = ElasticityCore()
    start(core)
    assert [(h.job_id, [g.generation for g in h.generations], h.replacements)
            for h in core.take_histories()] == [("j", [0], 0)]
    apply_all(core)
    assert core.take_histories() == []  # generation 0 cost no survivor anything
    core.handle(MemberFailed("j", "r1-0", "crash: killed"), 5.0)
    # Survivors report what the change cost each; the history keeps the longest.
    for replica, pause in (("r0-0", 0.25), ("r2-0", 0.5), ("r3-0", 0.125)):
        core.handle(GenerationAppliedSeen("j", 1, replica, 41, pause_s=pause), 6.0)
    ready(core, "r1-1", 9.0)
    core.handle(GenerationAppliedSeen("j", 2, "r1-1", 50, pause_s=None), 10.0)  # a joiner
    [history] = core.take_histories()
    assert history.replacements == 1 and history.updated_at == 9.0  # the last change
    assert [(g.generation, g.reason, g.world_size, g.members, g.decided_at, g.pause_s)
            for g in history.generations] == [
        (0, GenerationReason.START, 4, ["r0-0", "r1-0", "r2-0", "r3-0"], 0.0, None),
        (1, GenerationReason.FAULT, 3, ["r0-0", "r2-0", "r3-0"], 5.0, 0.5),
        (2, GenerationReason.JOIN, 4, ["r0-0", "r2-0", "r3-0", "r1-1"], 9.0, None)]
    assert history.generations[1].cause == "dropped r1-0 (crash: killed)"
    restored = ElasticityCore()
    restored.restore(snapshot(core.jobs["j"]))
    assert restored.jobs["j"].history == core.jobs["j"].history


def test_a_fault_during_a_change_supersedes_it_at_once() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r1-0"), 1.0)
    # r2-0 dies while generation 1 is being built: nobody could finish it.
    [g] = generations(core.handle(MemberFailed("j", "r2-0"), 1.1))
    assert g.generation == 2 and [m.replica_id for m in g.members] == ["r0-0", "r3-0"]


def test_two_faults_at_once_fold_into_one_generation_when_reported_together() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    first = core.handle(MemberFailed("j", "r1-0"), 1.0)
    second = core.handle(MemberFailed("j", "r1-0"), 1.0)  # the same fault twice
    assert len(generations(first)) == 1 and second == []


def test_below_min_waits_for_replacements_then_resumes() -> None:
    core = ElasticityCore(wait_timeout_s=30)
    start(core, n=2, lo=2, hi=2)
    apply_all(core, step=7)
    out = core.handle(MemberFailed("j", "r1-0"), 1.0)
    assert generations(out) == [] and core.jobs["j"].waiting_since == 1.0
    assert [d.replica_id for d in out] == ["r1-1"]  # at once: nothing trains meanwhile
    assert core.tick(20.0) == []
    [g] = generations(ready(core, "r1-1", now=25.0))
    assert [m.replica_id for m in g.members] == ["r0-0", "r1-1"]
    assert g.reason is GenerationReason.FAULT and g.resume_step == 7
    assert core.jobs["j"].waiting_since is None


def test_a_job_short_for_too_long_is_requeued() -> None:
    core = ElasticityCore(wait_timeout_s=5, max_replacements=0)
    start(core, n=2, lo=2, hi=2)
    apply_all(core)
    assert core.handle(MemberFailed("j", "r1-0"), 1.0) == []  # no replacement budget
    assert core.tick(6.0) == []
    [requeue] = core.tick(6.5)
    assert isinstance(requeue, Requeue) and "minimum of 2" in requeue.reason
    assert "j" not in core.jobs


def test_a_lost_node_gets_no_replacement_and_budget_is_respected() -> None:
    core = ElasticityCore(max_replacements=1)
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r1-0", replaceable=False), 1.0)
    assert not [d for d in apply_all(core) if isinstance(d, LaunchReplacement)]
    core.handle(MemberFailed("j", "r2-0"), 2.0)
    assert [d.replica_id for d in apply_all(core) if isinstance(d, LaunchReplacement)] == [
        "r2-1"]
    core.handle(MemberFailed("j", "r3-0"), 3.0)
    assert not [d for d in apply_all(core) if isinstance(d, LaunchReplacement)]


def test_old_incarnations_and_unknown_replicas_are_ignored() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r1-0"), 1.0)
    apply_all(core)
    assert core.handle(MemberFailed("j", "r1-0"), 2.0) == []
    assert core.handle(MemberFailed("j", "r9-0"), 2.0) == []
    assert ready(core, "r1-0") == []  # a stale ready from the dead incarnation
    assert core.handle(ReplicaReadySeen("x", "r0-0", "n", 0, "h:1"), 2.0) == []


def test_joins_stop_at_max() -> None:
    core = ElasticityCore()
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1", 2: "n0"}, 1, 2), 0.0)
    out = []
    for r in ("r0-0", "r1-0", "r2-0"):
        out += ready(core, r)
    [g] = generations(out)
    assert [m.replica_id for m in g.members] == ["r0-0", "r1-0"]
    assert core.jobs["j"].ready == ["r2-0"]
    apply_all(core)
    [g1] = generations(core.handle(MemberFailed("j", "r0-0"), 1.0))
    assert [m.replica_id for m in g1.members] == ["r1-0", "r2-0"]


def test_a_restored_snapshot_carries_on_where_the_job_was() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r1-0"), 1.0)
    [launch] = apply_all(core)  # r1-1 is starting when the instance dies
    other = ElasticityCore()
    assert other.restore(snapshot(core.jobs["j"])) == "j"
    assert other.jobs["j"] == core.jobs["j"]
    [g] = generations(ready(other, launch.replica_id))  # its ready is not lost on the new one
    assert [m.replica_id for m in g.members] == ["r0-0", "r2-0", "r3-0", "r1-1"]
    other.check_invariants()
    with pytest.raises(StoredStateError, match="not an elasticity job snapshot"):
        other.restore(b"\x81\xa1x\x01")


def test_a_declared_session_is_managed_from_its_first_ready_replica_and_earlier_faults_then_count(
        ) -> None:
    core = ElasticityCore()
    admitted = JobAdmitted("j", {0: "n0", 1: "n1", 2: "n0"}, 2, 3, session=True)
    core.handle(admitted, 0.0)
    assert core.handle(MemberFailed("j", "r2-0"), 0.5) == []  # kept: not managed yet
    assert core.handle(admitted, 0.6) == []
    out = ready(core, "r0-0", 1.0)
    assert [(d.slot, d.replica_id) for d in out if isinstance(d, LaunchReplacement)] == [
        (2, "r2-1")]  # below min while forming: the replacement starts at once
    [g] = generations(ready(core, "r1-0", 1.0))
    assert [m.replica_id for m in g.members] == ["r0-0", "r1-0"]


def test_a_gangs_replica_failing_before_any_is_ready_restarts_the_whole_gang() -> None:
    # Undeclared, the first processes are a torchrun gang: the others wait for r2-0 in
    # their init_process_group, so every slot starts again, on a rendezvous of its own.
    core = ElasticityCore()
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1", 2: "n0"}, 2, 3), 0.0)
    out = core.handle(MemberFailed("j", "r2-0", "exit 1", event_id="f1"), 0.5)
    assert out == [LaunchReplacement("j", 0, "n0", "r0-1", "f1", gang=True),
                   LaunchReplacement("j", 1, "n1", "r1-1", "f1", gang=True),
                   LaunchReplacement("j", 2, "n0", "r2-1", "f1", gang=True)]
    assert all(core.awaits(launch) for launch in out)
    # The restarted gang's members fail with it, or get ready before they are stopped.
    assert core.handle(MemberFailed("j", "r0-0"), 0.6) == []
    assert ready(core, "r1-0", 0.7) == [] and not core.jobs["j"].managed
    assert ready(core, "r0-1") == [] and ready(core, "r2-1") == []
    [g] = generations(ready(core, "r1-1"))
    assert [m.replica_id for m in g.members] == ["r0-1", "r1-1", "r2-1"]
    assert core.jobs["j"].replaced == 3


def test_a_gang_restarts_once_per_incarnation_and_from_r0_when_re_placed() -> None:
    core = ElasticityCore()
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1"}, 1, 2), 0.0)
    assert len(core.handle(MemberFailed("j", "r1-0"), 1.0)) == 2
    assert core.handle(MemberFailed("j", "r1-0"), 1.1) == []  # the same fault again
    assert [d.replica_id for d in core.handle(MemberFailed("j", "r0-1"), 2.0)] == [
        "r0-2", "r1-2"]
    # A node lost re-places the job: the agents start r<s>-0 in the new world.
    assert core.handle(MemberFailed("j", "r1-2", replaceable=False), 3.0) == []
    assert core.handle(JobAdmitted("j", {0: "n0", 2: "n2"}, 1, 2), 3.1) == []
    assert core.handle(MemberFailed("j", "r0-2"), 3.2) == []  # the gang before
    assert [d.replica_id for d in core.handle(MemberFailed("j", "r2-0"), 4.0)] == [
        "r0-1", "r2-1"]
    assert core.handle(MemberFailed("j", "r7-1"), 4.1) == []  # no such slot


def test_stopped_jobs_are_forgotten_and_bad_input_is_refused() -> None:
    core = ElasticityCore()
    start(core)
    assert core.handle(JobStopped("j"), 1.0) == [] and "j" not in core.jobs
    with pytest.raises(ValueError, match="min <= max"):
        core.handle(JobAdmitted("k", {0: "n"}, 3, 2), 0.0)
    with pytest.raises(TypeError):
        core.handle(object(), 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ElasticityCore(wait_timeout_s=0)


def test_a_member_exiting_zero_completes_the_job_and_stops_waiting_joiners() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r1-0"), 1.0)
    assert any(isinstance(d, LaunchReplacement) for d in apply_all(core))
    # r1-1 is still importing torch when the members finish the training.
    assert core.handle(MemberFinished("j", "r9-9"), 2.0) == []  # not a member: nothing
    [stop] = core.handle(MemberFinished("j", "r0-0"), 2.0)
    assert stop == RetireReplica("j", 1, "n1", "r1-1")
    assert ready(core, "r1-1") == []  # too late: no join generation
    assert core.handle(MemberFailed("j", "r2-0"), 3.0) == []  # no replacement either
    core.check_invariants()


def test_a_joiner_taken_in_as_the_training_ends_is_stopped_with_the_waiting() -> None:
    core = ElasticityCore()
    start(core, n=2, lo=1, hi=2)
    apply_all(core)
    core.handle(MemberFailed("j", "r1-0"), 1.0)
    apply_all(core)  # r0-0 trains alone; r1-1 is launched
    [join] = generations(ready(core, "r1-1", 2.0))
    assert [m.replica_id for m in join.members] == ["r0-0", "r1-1"]
    # r0-0 took the last step before it saw the join, and exited 0: r1-1, a member that
    # never trained, can form the join with nobody and finish nothing.
    [stop] = core.handle(MemberFinished("j", "r0-0"), 2.0)
    assert stop == RetireReplica("j", 1, "n1", "r1-1")
    core.check_invariants()


def test_a_shrunk_placement_keeps_slot_numbers_and_a_grown_one_gets_new_replicas() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    # n1 is lost: admission keeps slots 0 and 2 (on n0), r1-0 and r3-0 leave; health
    # reports them failed, and the same two members start over.
    [leave] = generations(core.handle(JobAdmitted("j", {0: "n0", 2: "n0"}, 2, 4), 1.0))
    [g] = generations(core.handle(MemberFailed("j", "r1-0", replaceable=False), 1.0))
    assert generations(core.handle(MemberFailed("j", "r3-0", replaceable=False), 1.0)) == []
    assert [m.replica_id for m in leave.members] == [m.replica_id for m in g.members] == [
        "r0-0", "r2-0"]
    assert apply_all(core) == []  # no replacement where the slots are gone
    core.handle(JobAdmitted("j", {0: "n0", 2: "n0", 4: "n2"}, 2, 4), 2.0)  # grown again
    [g1] = generations(ready(core, "r4-0"))
    assert [m.replica_id for m in g1.members] == ["r0-0", "r2-0", "r4-0"]
    core.check_invariants()


def test_ready_reports_before_the_admitted_record_are_applied_when_it_comes() -> None:
    # The record (a KV watch) and the reports (a stream) travel apart: a replica quick to
    # start can be ready before the record is seen; generation 0 must not wait for ever.
    core = ElasticityCore()
    for slot in range(4):
        assert ready(core, f"r{slot}-0", now=1.0) == []
    [g] = generations(core.handle(JobAdmitted("j", {i: f"n{i % 2}" for i in range(4)}, 2, 4),
                                  2.0))
    assert (g.generation, g.world_size) == (0, 4)
    core.check_invariants()


def test_early_reports_are_forgotten_after_their_time_and_an_ended_jobs_are_old_news() -> None:
    core = ElasticityCore()
    ready(core, "r0-0", now=0.0)
    core.tick(EARLY_TTL_S + 1)
    assert core.handle(JobAdmitted("j", {0: "n0"}, 1, 1), EARLY_TTL_S + 2) == []
    [g] = generations(ready(core, "r0-0", now=EARLY_TTL_S + 3))
    core.handle(JobStopped("j"), EARLY_TTL_S + 4)
    assert ready(core, "r0-0", now=EARLY_TTL_S + 5) == []  # late: the job ended
    assert core.handle(JobAdmitted("j", {0: "n0"}, 1, 1), EARLY_TTL_S + 6) == []
    assert g.world_size == 1


def test_progress_gives_the_replacement_budget_back() -> None:
    """The budget counts replacements without progress (as health's restart guard does): a
    job that commits past its high water between faults is replaced every time."""
    core = ElasticityCore(max_replacements=1)
    start(core, lo=1)
    apply_all(core, step=10)

    def fail(replica: str, now: float) -> None:
        core.handle(MemberFailed("j", replica), now)

    def launched(step: int) -> list[str]:
        return [d.replica_id for d in apply_all(core, step=step)
                if isinstance(d, LaunchReplacement)]

    fail("r3-0", 1.0)
    fail("r2-0", 1.5)  # before any progress: the budget of one is spent
    assert launched(10) == ["r3-1"]
    assert launched(20) == []  # progress gives it back, for the next failure
    fail("r1-0", 2.0)
    assert launched(20) == ["r1-1"]


def whole_job_lost(core: ElasticityCore) -> list:
    """Every member of a job that trained to step 10 fails: the launches asked for."""
    start(core)
    apply_all(core)
    out = []
    for slot in range(4):
        out += core.handle(MemberFailed("j", f"r{slot}-0"), 1.0 + slot)
    return out


def test_after_a_whole_job_loss_the_generation_waits_for_every_replacement() -> None:
    """Nobody holds the state: it comes back from each node's memory, whose shards are its
    own ranks'. A generation of the first two ready (min 2) might see one node's only."""
    core = ElasticityCore()
    launched = whole_job_lost(core)
    assert {d.replica_id for d in launched if isinstance(d, LaunchReplacement)} == {
        "r0-1", "r1-1", "r2-1", "r3-1"}
    for replica in ("r2-1", "r0-1", "r3-1"):
        assert generations(ready(core, replica, 5.0)) == []  # enough for min: still waits
    [g] = generations(ready(core, "r1-1", 6.0))
    assert sorted(m.replica_id for m in g.members) == ["r0-1", "r1-1", "r2-1", "r3-1"]
    assert g.resume_step == 10  # the step the tiers must give back
    core.check_invariants()


def test_a_replacement_that_never_comes_holds_the_job_at_most_gather_s() -> None:
    core = ElasticityCore()
    whole_job_lost(core)
    ready(core, "r0-1", 5.0)
    assert generations(ready(core, "r1-1", 5.0)) == []
    assert generations(core.tick(5.0 + GATHER_S - 1)) == []
    [g] = generations(core.tick(5.0 + GATHER_S))  # r2-1 and r3-1's nodes may be gone
    assert [m.replica_id for m in g.members] == ["r0-1", "r1-1"]


def test_survivors_that_hold_the_state_never_wait_for_replacements() -> None:
    core = ElasticityCore()
    start(core)
    apply_all(core)
    core.handle(MemberFailed("j", "r0-0"), 1.0)
    [g] = generations(core.handle(MemberFailed("j", "r1-0"), 2.0))
    assert [m.replica_id for m in g.members] == ["r2-0", "r3-0"]


def admitted(core: ElasticityCore, admission: int, n: int = 2) -> list:
    return core.handle(JobAdmitted("j", {i: f"n{i}" for i in range(n)}, n, n,
                                   admission=admission), 0.0)


def ready_of(admission: int, replica: str, port: int) -> ReplicaReadySeen:
    slot = int(replica[1:].split("-")[0])
    return ReplicaReadySeen("j", replica, f"n{slot}", slot, f"h:{port}", admission=admission)


def test_an_earlier_admissions_readiness_read_late_is_not_the_new_replicas() -> None:
    """A leader that took over at a requeue applies the next admission's record before
    reading the earlier admission's last readiness (the replica ids recur): the
    generation it forms must point at the new processes, not at the dead ones."""
    core = ElasticityCore()
    assert admitted(core, 2) == []
    assert core.handle(ready_of(1, "r0-0", 7000), 0.0) == []  # the first admission's
    assert core.handle(ready_of(1, "r1-0", 7001), 0.0) == []
    assert core.jobs["j"].current is None
    out = core.handle(ready_of(2, "r0-0", 8000), 1.0) + core.handle(ready_of(2, "r1-0", 8001), 1.0)
    [g] = generations(out)
    assert [m.endpoint for m in g.members] == ["h:8000", "h:8001"]
    # Its applied reports and given-up ones are dropped the same way.
    old = GenerationAppliedSeen("j", 0, "r0-0", 95, admission=1)
    assert core.handle(old, 2.0) == [] and core.jobs["j"].applied == set()


def test_readiness_kept_before_the_record_is_dropped_when_it_is_of_another_admission() -> None:
    core = ElasticityCore()
    assert core.handle(ready_of(1, "r0-0", 7000), 0.0) == []  # kept early
    assert core.handle(ready_of(2, "r1-0", 8001), 0.0) == []
    assert admitted(core, 2) == []  # only r1-0 of this admission is ready
    [g] = generations(core.handle(ready_of(2, "r0-0", 8000), 1.0))
    assert [m.endpoint for m in g.members] == ["h:8000", "h:8001"]


def test_a_record_of_another_admission_starts_the_membership_again() -> None:
    """A core that never saw the requeue between two admissions (the record changed twice
    while no leader read it) drops the earlier membership at the new record."""
    core = ElasticityCore()
    admitted(core, 1)
    generations(core.handle(ready_of(1, "r0-0", 7000), 0.0)
                + core.handle(ready_of(1, "r1-0", 7001), 0.0))
    assert core.jobs["j"].current is not None
    assert admitted(core, 2) == []
    assert core.jobs["j"].current is None and core.jobs["j"].admission == 2
    assert admitted(core, 2) == []  # the same record again: nothing changes


def test_events_that_name_no_admission_are_taken_as_the_current_ones() -> None:
    """A rank started by hand, or one older than the field, says 0."""
    core = ElasticityCore()
    admitted(core, 3)
    out = core.handle(ready_of(0, "r0-0", 9000), 0.0) + core.handle(ready_of(0, "r1-0", 9001), 0.0)
    assert len(generations(out)) == 1


def test_an_earlier_admissions_late_fault_and_exit_replace_nothing() -> None:
    """The first admission's r0-0 was killed at the preemption; its fault and exit, read
    after the second admission's record, are not the new r0-0's."""
    core = ElasticityCore()
    admitted(core, 2)
    assert core.handle(MemberFailed("j", "r0-0", "crash: SIGKILL", admission=1), 0.0) == []
    assert core.handle(ReplicaExited("j", "r0-0", "exited, signal SIGKILL", admission=1),
                       0.0) == []
    out = core.handle(ready_of(2, "r0-0", 8000), 1.0) + core.handle(ready_of(2, "r1-0", 8001), 1.0)
    [g] = generations(out)
    assert [m.replica_id for m in g.members] == ["r0-0", "r1-0"]
    assert not [d for d in out if isinstance(d, LaunchReplacement)]
    assert core.handle(MemberFinished("j", "r0-0", admission=1), 2.0) == []
    assert not core.jobs["j"].complete
