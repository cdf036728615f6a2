"""A cluster restart under a running job: every member lost, the same job comes back.

``phalanx down`` stops every rank (its agents report them lost, health faults them);
``phalanx up`` brings the control plane back with elasticity restored from its
snapshots, at any point of that sequence. Whatever the order of the faults, of the
restore and of the replacements' readiness, the core launches one new replica per
slot (never a replica id twice), keeps waiting for each (so the shell keeps asking
an agent that is not up yet) until it reports ready, never waits on a member that is
gone, and forms the next generation of the replacements alone, resuming at the step
the job had reached (the members restore it from the nearest tier that holds it).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import GenerationReason
from phalanx.services.elasticity.core import (
    ElasticityCore,
    GenerationAppliedSeen,
    JobAdmitted,
    LaunchReplacement,
    MemberFailed,
    PublishGeneration,
    ReplicaReadySeen,
    snapshot,
)

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=200)


def running(hi: int, lo: int, step: int) -> tuple[ElasticityCore, float]:
    """A core whose job trains in generation 0 with ``hi`` members at ``step``."""
    core = ElasticityCore(wait_timeout_s=1000, max_replacements=16)
    core.handle(JobAdmitted("j", {s: f"n{s % 2}" for s in range(hi)}, lo, hi), 0.0)
    for s in range(hi):
        core.handle(ReplicaReadySeen("j", f"r{s}-0", f"n{s % 2}", s, f"h:{s}"), 1.0)
    for s in range(hi):
        core.handle(GenerationAppliedSeen("j", 0, f"r{s}-0", step), 2.0)
    return core, 3.0


def restarted(core: ElasticityCore) -> ElasticityCore:
    """The core a new leader builds from the stored snapshots."""
    fresh = ElasticityCore(wait_timeout_s=1000, max_replacements=16)
    for job in core.jobs.values():
        fresh.restore(snapshot(job))
    return fresh


@SETTINGS
@given(st.integers(1, 4), st.integers(0, 3), st.integers(1, 500), st.randoms(),
       st.integers(0, 20))
def test_every_member_lost_the_job_comes_back_with_new_replicas_only(
        lo: int, extra: int, step: int, rnd, cut: int) -> None:
    hi = lo + extra
    core, now = running(hi, lo, step)
    lost = [f"r{s}-0" for s in range(hi)]
    rnd.shuffle(lost)
    ready_order = list(range(hi))
    rnd.shuffle(ready_order)
    events = [MemberFailed("j", r, f"crash: {r} lost with its agent", event_id=f"f-{r}")
              for r in lost]
    events += [ReplicaReadySeen("j", f"r{s}-1", f"n{s % 2}", s, f"h2:{s}") for s in ready_order]
    cut = min(cut, len(events))
    launches: list[LaunchReplacement] = []
    published = []
    for i, event in enumerate(events):
        if i == cut:
            core = restarted(core)
        out = core.handle(event, now + i)
        faulted = {e.replica_id for e in events[:i + 1] if isinstance(e, MemberFailed)}
        while out:
            core.check_invariants()
            launches += [d for d in out if isinstance(d, LaunchReplacement)]
            new = [d.generation for d in out if isinstance(d, PublishGeneration)]
            published += new
            out = []
            for generation in new:
                # Never waited on once reported gone (before, it is not known to be).
                assert not {m.replica_id for m in generation.members} & faulted, generation
                for member in generation.members:  # the living apply it, as ranks do
                    if member.replica_id not in set(lost):
                        out += core.handle(GenerationAppliedSeen(
                            "j", generation.generation, member.replica_id, step), now + i)
        # Each launch is awaited until its replica reports ready, and no longer.
        for launch in launches:
            ready = any(isinstance(e, ReplicaReadySeen) and e.replica_id == launch.replica_id
                        for e in events[:i + 1])
            assert core.awaits(launch) is not ready, (launch, i)
    # Each replacement asked for at most once from a spare and at most once cold.
    assert {d.replica_id for d in launches} == {f"r{s}-1" for s in range(hi)}
    for warm in (True, False):
        asked = [d.replica_id for d in launches if d.warm_only is warm]
        assert len(set(asked)) == len(asked), "a replica launched twice"
    assert all(d.node_id == f"n{d.slot % 2}" for d in launches)
    last = published[-1]
    assert {m.replica_id for m in last.members} == {f"r{s}-1" for s in range(hi)}
    assert last.resume_step == step, "the step the job had reached"
    # The history says why: the lost members dropped (a fault), the replacements joined.
    causes = [h.cause for h in core.jobs["j"].history
              if h.reason is GenerationReason.FAULT]
    assert causes and all(c.startswith("dropped ") for c in causes), causes
