"""Random event sequences: every phase change the core makes is one :class:`Phase` lists.

Each step feeds one event (or a tick) to a core running one job and compares the job's
phase before and after with :data:`TRANSITIONS`. Targets are drawn from the job's state
(a launched replica reports ready, a member applies or fails), so the sequences reach
every phase; a seeded walk of the same kind checks the converse: every transition the
table lists is one the core makes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from hypothesis import example, given, settings
from hypothesis import strategies as st

from phalanx.services.elasticity.core import (
    TRANSITIONS,
    ElasticityCore,
    Event,
    GenerationAppliedSeen,
    GenerationGivenUpSeen,
    JobAdmitted,
    JobMembership,
    MemberFailed,
    MemberFinished,
    Phase,
    ReplicaExited,
    ReplicaReadySeen,
)

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)
KINDS = ("fail", "ready", "ready", "ready", "apply", "apply", "apply", "giveup", "admit",
         "finish", "exit", "tick")
ops = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 40), st.integers(0, 50)),
               min_size=30, max_size=80)
#: A job's shape: min, max above it, every other size from min allowed only (ready replicas then
#: wait for room), a declared session, admitted again (with a step reached, so that
#: replacements alone gather the state from the start).
shapes = st.tuples(st.integers(1, 3), st.integers(0, 2), st.booleans(), st.booleans(),
                   st.booleans())


#: Sequences too deep for random steps to find often: training with one member (sizes
#: 1 and 3: a ready replica waits for room), it fails, and the one ready joins alone:
#: no member holds the state, so the job gathers its replacements.
DEEP = [((1, 2, True, True, False),
         [("fail", 1, 1), ("fail", 2, 1), ("ready", 0, 0), ("apply", 0, 5), ("ready", 0, 0),
          ("fail", 0, 1)])]


def pick(items: list[str], n: int) -> str | None:
    return items[n % len(items)] if items else None


def event_for(job: JobMembership, kind: str, n: int, step: int) -> Event | None:
    """The event of ``kind`` about a replica the job knows (None: none fits)."""
    members = job.members
    known = sorted({*members, *job.ready, *job.launched, f"r{n % 4}-0"})
    current = job.current
    match kind:
        case "fail":
            replica = pick(known, n)
            return None if replica is None else MemberFailed(
                "j", replica, "crash", replaceable=step % 5 != 0, event_id=f"f{n}")
        case "ready":
            replica = pick(sorted(job.launched), n) or pick(known, n)
            if replica is None:
                return None
            slot = int(replica[1:].split("-")[0])
            return ReplicaReadySeen("j", replica, job.slots.get(slot, "gone"), slot, "h:1")
        case "apply" if current is not None:
            replica = pick(members, n)
            generation = current.generation - (step % 4 == 0)
            return None if replica is None else GenerationAppliedSeen(
                "j", generation, replica, step, pause_s=0.1)
        case "giveup" if current is not None:
            replica = pick(members, n)
            return None if replica is None else GenerationGivenUpSeen(
                "j", current.generation, replica, "timed out")
        case "admit":  # admission places an allowed size, min <= slots <= max
            slots = dict(job.slots)
            slot = n % (job.max_members + 2)
            if slot in slots:
                del slots[slot]
            else:
                slots[slot] = f"n{slot}"
            if not job.min_members <= len(slots) <= job.max_members \
                    or (job.sizes and len(slots) not in job.sizes):
                return None
            return JobAdmitted("j", slots, job.min_members, job.max_members,
                               sizes=tuple(job.sizes), session=job.session,
                               admission=job.admission, reached=job.high_water)
        case "finish":
            replica = pick(members, n)
            return None if replica is None else MemberFinished("j", replica)
        case "exit":
            replica = pick([*job.leaving, *job.departing, *members], n)
            return None if replica is None else ReplicaExited("j", replica, "stopped")
    return None


def walk(shape: tuple[int, int, bool, bool, bool],
         steps: list[tuple[str, int, int]]) -> Iterator[tuple[Phase, ElasticityCore, object]]:
    """The core after each step of a job of ``shape``, with the job's phase before and
    what the step fed it."""
    lo, extra, stepped, session, again = shape
    hi = lo + extra
    sizes = tuple(range(lo, hi + 1, 2)) if stepped else (hi,)
    core = ElasticityCore(wait_timeout_s=10, max_replacements=3)
    core.handle(JobAdmitted("j", {i: f"n{i}" for i in range(sizes[-1])}, lo, hi,
                            sizes=sizes if stepped else (),
                            session=session, admission=2 if again else 0,
                            reached=40 if again else 0), 0.0)
    now = 0.0
    for kind, n, step in steps:
        job = core.jobs["j"]
        before = job.phase
        now += 1
        cause: object
        if kind == "tick":
            now += step
            cause = f"tick at {now}"
            core.tick(now)
        else:
            cause = event_for(job, kind, n, step)
            if cause is None:
                continue
            core.handle(cause, now)
        core.check_invariants()
        yield before, core, cause
        if "j" not in core.jobs or before is Phase.COMPLETE:
            return  # nothing happens to a complete job any more: one step shows it


def moves(shape: tuple[int, int, bool, bool, bool],
          steps: list[tuple[str, int, int]]) -> Iterator[tuple[Phase, Phase | None, object]]:
    """Each step's phase before, after (None: the job left the core) and what caused it."""
    for before, core, cause in walk(shape, steps):
        after = core.jobs.get("j")
        yield before, None if after is None else after.phase, cause


@SETTINGS
@given(shapes, ops)
@example(*DEEP[0])
def test_every_phase_change_is_one_the_table_lists(shape, steps) -> None:
    for before, after, cause in moves(shape, steps):
        if after is None:  # requeued: only a tick ends a job here, and only a waiting one
            assert before is Phase.WAITING, (before, cause)
        else:
            assert after in TRANSITIONS[before], f"{before} -> {after} on {cause}"


def test_every_transition_the_table_lists_is_one_the_core_makes() -> None:
    """The converse, over a seeded walk of the same sequences: no entry is dead."""
    rnd = random.Random(51)
    walk = [((rnd.randint(1, 3), rnd.randint(0, 2), rnd.random() < 0.5, rnd.random() < 0.5,
              rnd.random() < 0.5),
             [(rnd.choice(KINDS), rnd.randint(0, 40), rnd.randint(0, 50))
              for _ in range(rnd.randint(0, 80))]) for _ in range(3000)]
    seen = {(before, after) for shape, steps in [*walk, *DEEP]
            for before, after, _ in moves(shape, steps) if after is not None}
    listed = {(before, after) for before, afters in TRANSITIONS.items() for after in afters}
    assert listed - seen == set(), "listed, never made"
    assert seen <= listed
