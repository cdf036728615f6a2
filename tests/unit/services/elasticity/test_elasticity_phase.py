"""A job's phase: computed from its fields, and the enum's docstring is its table."""

from __future__ import annotations

import re

from test_elasticity_core import apply_all, start  # the same job

from phalanx.services.elasticity.core import (
    TRANSITIONS,
    ElasticityCore,
    JobAdmitted,
    MemberFailed,
    MemberFinished,
    Phase,
    ReplicaReadySeen,
)


def test_the_docstring_lists_the_tables_transitions() -> None:
    listed = {(Phase[a], Phase[b])
              for a, b in re.findall(r"``(\w+)`` → ``(\w+)``", Phase.__doc__ or "")}
    table = {(a, b) for a, afters in TRANSITIONS.items() for b in afters if a is not b}
    assert listed == table


def test_a_job_goes_from_gang_to_training_to_complete() -> None:
    core = ElasticityCore()
    core.handle(JobAdmitted("j", {0: "n0", 1: "n1"}, 1, 2), 0.0)
    job = core.jobs["j"]
    assert job.phase is Phase.GANG
    core.handle(ReplicaReadySeen("j", "r0-0", "n0", 0, "h:0"), 1.0)
    assert job.phase is Phase.FORMING  # r1-0 still awaited
    core.handle(ReplicaReadySeen("j", "r1-0", "n1", 1, "h:1"), 1.0)
    assert job.phase is Phase.IN_FLIGHT
    apply_all(core)
    assert job.phase is Phase.TRAINING
    core.handle(MemberFinished("j", "r0-0"), 2.0)
    assert job.phase is Phase.COMPLETE


def test_below_min_is_waiting_even_while_gathering() -> None:
    core = ElasticityCore()
    start(core)  # four members, min 2
    apply_all(core)
    core.handle(MemberFailed("j", "r0-0"), 1.0)
    job = core.jobs["j"]
    assert job.phase is Phase.IN_FLIGHT
    job.gather_since = 1.0
    assert job.phase is Phase.GATHERING
    for replica in ("r1-0", "r2-0"):
        core.handle(MemberFailed("j", replica), 2.0)
    assert job.waiting_since is not None and job.phase is Phase.WAITING
