"""Random faults, joins and acknowledgements: generations stay sane."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.services.elasticity.core import (
    ElasticityCore,
    GenerationApplied,
    JobStarted,
    MemberFailed,
    PublishGeneration,
    ReplicaReady,
    Requeue,
)

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)
ops = st.lists(st.tuples(st.sampled_from(["fail", "ready", "apply", "tick"]),
                         st.integers(0, 11), st.integers(0, 50)), max_size=60)


@SETTINGS
@given(st.integers(1, 4), st.integers(0, 3), ops)
def test_generations_under_random_events(lo: int, extra: int, events) -> None:
    hi = lo + extra
    core = ElasticityCore(wait_timeout_s=10)
    [first] = core.handle(JobStarted("j", tuple((f"r{i}", "n") for i in range(hi)), lo, hi), 0)
    published = [first.generation]
    failed: set[str] = set()
    now = 0.0
    for kind, n, step in events:
        now += 1
        job = core.jobs.get("j")
        if job is None:
            break
        in_flight = job.in_flight
        if kind == "fail":
            out = core.handle(MemberFailed("j", f"r{n}"), now)
            failed.add(f"r{n}") if f"r{n}" in job.members else None
        elif kind == "ready":
            out = core.handle(ReplicaReady("j", f"r{n}", "n"), now)
        elif kind == "apply":
            out = core.handle(GenerationApplied("j", job.current.generation, f"r{n}", step), now)
        else:
            out = core.tick(now)
        core.check_invariants()
        new = [d.generation for d in out if isinstance(d, PublishGeneration)]
        assert len(new) <= 1
        if new and kind != "apply" and in_flight and kind != "fail":
            raise AssertionError("a generation was published while another was in flight")
        for g in new:
            assert g.generation == published[-1].generation + 1  # one step at a time
            members = {m.replica_id for m in g.members}
            assert not members & failed - {m.replica_id for m in published[-1].members
                                           if m.replica_id not in failed}
            assert lo <= g.world_size <= hi
            assert g.resume_step >= published[-1].resume_step or g.reason.value == "join"
            published.append(g)
        if any(isinstance(d, Requeue) for d in out):
            assert "j" not in core.jobs
