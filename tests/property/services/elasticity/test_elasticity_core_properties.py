"""Random faults, readiness, acknowledgements, given-up reports and ticks: generations stay
sane."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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
    ReplicaReadySeen,
    Requeue,
    snapshot,
)

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)
ops = st.lists(st.tuples(st.sampled_from(["fail", "ready", "apply", "giveup", "giveup", "cut",
                                          "tick"]),
                         st.integers(0, 40), st.integers(0, 50)), max_size=80)


@SETTINGS
@given(st.integers(1, 4), st.integers(0, 3), ops)
def test_generations_under_random_events(lo: int, extra: int, events) -> None:
    hi = lo + extra
    core = ElasticityCore(wait_timeout_s=10, max_replacements=6)
    core.handle(JobAdmitted("j", {i: f"n{i}" for i in range(hi)}, lo, hi), 0)
    published = []
    dead: set[str] = set()
    known = [f"r{i}-0" for i in range(hi)]  # every replica ever launched
    warm: set[str] = set()  # asked of a warm spare (while a change was in flight)
    now = 0.0
    for kind, n, step in events:
        now += 1
        named_unreachable: set[str] = set()
        job = core.jobs.get("j")
        if job is None:
            break
        failed_before = set(job.failed)
        # A change is waited for only while none of its members has died.
        in_flight = job.current is not None and job.in_flight and not set(job.members) & dead
        replica = known[n % len(known)]
        slot = int(replica[1:].split("-")[0])
        if kind == "fail":
            out = core.handle(MemberFailed("j", replica), now)
            dead.add(replica)
        elif kind == "ready":
            if replica in dead:
                continue  # a dead process reports nothing
            out = core.handle(ReplicaReadySeen("j", replica, f"n{slot}", slot, "h:1"), now)
        elif kind == "apply":
            if job.current is None or replica in dead:
                continue
            applied = GenerationAppliedSeen("j", job.current.generation, replica, step)
            out = core.handle(applied, now)
        elif kind in ("giveup", "cut"):
            if job.current is None:
                continue
            if n % 4:  # mostly a member's report (else any replica's)
                replica = job.current.members[n % job.current.world_size].replica_id
            if replica in dead:
                continue
            # Of the current generation, or a late report of the one before.
            named = job.current.generation - step % 2
            given_up = job.current
            if kind == "cut":  # the members it cannot reach: those the bits of step pick
                named_unreachable = {m.replica_id for i, m in enumerate(job.current.members)
                                     if step >> i & 1}
            out = core.handle(GenerationGivenUpSeen(
                "j", named, replica, "timed out",
                unreachable=tuple(sorted(named_unreachable))), now)
        else:
            out = core.tick(now)
        core.check_invariants()
        known += [d.replica_id for d in out if isinstance(d, LaunchReplacement)]
        warm |= {d.replica_id for d in out if isinstance(d, LaunchReplacement) and d.warm_only}
        new = [d.generation for d in out if isinstance(d, PublishGeneration)]
        assert len(new) <= 1
        # Only a warm spare's replacement, ready, may supersede a change in flight.
        spare_joins = kind == "ready" and replica in warm and all(
            g.reason is GenerationReason.JOIN and replica in {m.replica_id for m in g.members}
            for g in new)
        # A generation a member gave up is decided again at once, from its report alone.
        reformed = kind in ("giveup", "cut") and bool(new)
        if reformed:
            assert named == given_up.generation, "a stale report re-formed a generation"
            assert replica in {m.replica_id for m in given_up.members}
            kept = {m.replica_id for m in given_up.members} - dead - named_unreachable
            assert kept <= {m.replica_id for m in new[0].members}, "a live member was lost"
            assert replica in {m.replica_id for m in new[0].members}, "a reporter dropped"
            assert new[0].reason is GenerationReason.FAULT
            # A report drops only members it named, never more than stay, and on a tie
            # it keeps rank 0.
            old = [m.replica_id for m in given_up.members]
            gone = set(old) - {m.replica_id for m in new[0].members} - dead - failed_before
            assert gone <= named_unreachable, gone
            assert len(gone) < len(old) - len(gone) or (
                len(gone) == len(old) - len(gone) and old[0] not in gone), gone
        if new and in_flight and kind not in ("apply", "fail") and not spare_joins \
                and not reformed:
            raise AssertionError("a generation was published while another was in flight")
        for g in new:
            expected = published[-1].generation + 1 if published else 0
            assert g.generation == expected  # one step at a time
            members = {m.replica_id for m in g.members}
            assert not members & dead, "a dead replica is a member"
            assert lo <= g.world_size <= hi
            if published:
                previous = {m.replica_id for m in published[-1].members}
                survivors = [m.replica_id for m in g.members if m.replica_id in previous]
                assert survivors == [m.replica_id for m in published[-1].members
                                     if m.replica_id in survivors], "survivors reordered"
            published.append(g)
        if any(isinstance(d, Requeue) for d in out):
            assert "j" not in core.jobs
        elif published:  # the history is every generation published, as published
            assert [(h.generation, h.world_size, h.members, h.reason) for h in job.history] \
                == [(g.generation, g.world_size, [m.replica_id for m in g.members], g.reason)
                    for g in published]


def random_events(hi: int, events, session: bool = False) -> list:
    """A replayable event list over slots ``0..hi+1`` (two slots admission may grow into)."""
    out = []
    slots = {i: f"n{i}" for i in range(hi)}
    for kind, n, step in events:
        slot = n % (hi + 2)
        replica = f"r{slot}-{(n // (hi + 2)) % 3}"
        match kind:
            case "fail":
                out.append(MemberFailed("j", replica, replaceable=step % 5 != 0,
                                        event_id=f"f{len(out)}"))
            case "ready":
                out.append(ReplicaReadySeen("j", replica, f"n{slot}", slot, f"h:{slot}"))
            case "apply":
                out.append(GenerationAppliedSeen("j", step % 4, replica, step))
            case "giveup":
                out.append(("giveup", n, step))  # of the generation then: see feed()
            case "admit":
                slots = dict(slots)
                if slot in slots and len(slots) > 1:
                    del slots[slot]
                else:
                    slots[slot] = f"n{slot}"
                out.append(JobAdmitted("j", slots, 1, hi, session=session))
            case "finish":
                out.append(MemberFinished("j", replica))
            case _:
                out.append("tick")
    return out


restart_ops = st.lists(st.tuples(
    st.sampled_from(["fail", "ready", "ready", "apply", "apply", "giveup", "admit", "finish",
                     "tick"]),
    st.integers(0, 40), st.integers(0, 50)), max_size=60)


def given_up(core: ElasticityCore, n: int, step: int, i: int) -> GenerationGivenUpSeen:
    """A member's report of the job's generation when it is fed (a third of them late,
    of the one before), so that reports count often enough to matter. A restored core
    and one that never stopped hold the same generation here, or they already differ."""
    job = core.jobs.get("j")
    current = None if job is None else job.current
    if current is None:
        return GenerationGivenUpSeen("j", step % 4, f"r{n % 3}-0", event_id=f"g{i}")
    member = current.members[n % current.world_size].replica_id
    return GenerationGivenUpSeen("j", current.generation - step % 3 // 2, member,
                                 "timed out", event_id=f"g{i}")


def feed(core: ElasticityCore, events: list, t0: float) -> list:
    decisions = []
    for i, event in enumerate(events):
        now = t0 + i
        if isinstance(event, tuple):
            event = given_up(core, event[1], event[2], int(t0) + i)
        decisions.append(core.tick(now) if event == "tick" else core.handle(event, now))
    return decisions


@SETTINGS
@given(st.integers(1, 4), restart_ops, st.integers(0, 60), st.booleans(), st.booleans())
def test_a_core_restored_at_any_point_decides_what_one_that_never_stopped_decides(
        hi: int, ops, cut: int, formed: bool, session: bool) -> None:
    # formed: every replica is ready first, so the events act on a running generation
    # (random readiness alone seldom forms one); else early faults restart a gang, or are
    # kept for a declared session.
    first = [ReplicaReadySeen("j", f"r{i}-0", f"n{i}", i, f"h:{i}") for i in range(hi)]
    events = [JobAdmitted("j", {i: f"n{i}" for i in range(hi)}, 1, hi, session=session),
              *(first if formed else []), *random_events(hi, ops, session)]
    cut = min(cut, len(events))
    steady = ElasticityCore(wait_timeout_s=5, max_replacements=4)
    expected = feed(steady, events, 0.0)
    before = ElasticityCore(wait_timeout_s=5, max_replacements=4)
    assert feed(before, events[:cut], 0.0) == expected[:cut]
    restored = ElasticityCore(wait_timeout_s=5, max_replacements=4)
    for job in before.jobs.values():
        restored.restore(snapshot(job))
    assert feed(restored, events[cut:], float(cut)) == expected[cut:]
    assert restored.jobs == steady.jobs
    restored.check_invariants()
