"""The largest job the schema admits fits every message and stored state that lists it.

A job's record, each of its generations, its history and the health and elasticity
leaders' snapshots of it each list its replicas. Up to 512 replicas each fits one NATS
payload (``MAX_PAYLOAD_BYTES``) whatever its ids; past one payload a value is stored in
chunks behind a pointer (:mod:`phalanx.bus.spill`, ``tests/integration/test_spill.py``)
up to ``MAX_SPILLED_BYTES``, which every value of a ``MAX_REPLICAS`` job must fit: one
that does not cannot be stored, and a leader that cannot store its state steps down (a
fuzz run's 60,000-replica record did that to health). Built with 128-character ids,
300-character endpoints and, for elasticity, generations of mass failures whose every
replica reports 4 KB of last output (hundreds of them at 512 replicas).
"""

from __future__ import annotations

import time

import pytest

from phalanx.schemas.codec import MAX_PAYLOAD_BYTES, encode
from phalanx.schemas.messages import (
    DETAIL_CHARS,
    HISTORY_LIMIT,
    MAX_REPLICAS,
    MAX_SPILLED_BYTES,
    GenerationReason,
    JobRecord,
    JobSnapshot,
    JobSpec,
    JobState,
    ReasonCode,
    ReplicaRange,
)
from phalanx.services.elasticity import core as elasticity
from phalanx.services.health import core as health

#: The sizes built: the largest every value of which fits one payload, and the largest
#: the schema admits, every value of which fits what chunks may hold.
SIZES = [pytest.param(512, MAX_PAYLOAD_BYTES, id="512-one-payload"),
         pytest.param(MAX_REPLICAS, MAX_SPILLED_BYTES, id=f"{MAX_REPLICAS}-in-chunks")]
OUTPUT = "Traceback (most recent call last):\n" + "x" * (DETAIL_CHARS - 40)


def nodes(n: int) -> list[str]:
    return [f"n{i}-".ljust(128, "x") for i in range(n)]


def fits(message, limit: int) -> int:
    size = len(encode(message, limit=limit))  # raises WireError past the limit
    assert size <= limit
    return size


@pytest.mark.parametrize(("n", "limit"), SIZES)
def test_the_largest_job_record_fits(n: int, limit: int) -> None:
    spec = JobSpec(name="big", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=n, max=n), command=["python", "train.py"])
    fits(JobRecord(job_id="big".ljust(128, "x"), spec=spec, state=JobState.ADMITTED,
                   reason_code=ReasonCode.ADMITTED, nodes=nodes(n), submitted_at=time.time(),
                   updated_at=time.time()), limit)


@pytest.mark.parametrize(("n", "limit"), SIZES)
def test_health_state_of_the_largest_job_fits_one_snapshot(n: int, limit: int) -> None:
    core = health.HealthCore(health.HealthPolicy())
    now = time.time()
    placed = nodes(n)
    core.handle(health.JobWatched("big", tuple(placed), 2.0), now)
    for rank in range(n):  # replica ids as long as the wire allows
        core.handle(health.RankStartSeen("big", rank, placed[rank], 2**22,
                                       f"r{rank}-".ljust(128, "9")), now)
    fits(JobSnapshot(job_id="big", seq=2**40, format=1,
                     state=health.snapshot(core.jobs["big"])), limit)


@pytest.mark.parametrize(("n", "limit"), SIZES)
def test_elasticity_state_generations_and_history_of_the_largest_job_fit(
        n: int, limit: int) -> None:
    N = n
    NODES = nodes(n)
    # Hundreds of generations at 512 (the history's bounds), half the members failing at
    # once; a start and a fault at 16,384, two failing at once (each failure is a
    # generation of its own, and one takes 0.2 s to decide at this size).
    generations = HISTORY_LIMIT + 20 if n <= 512 else 2
    core = elasticity.ElasticityCore(wait_timeout_s=60.0)
    now = time.time()
    endpoint = "h" * 294 + ":65535"
    core.handle(elasticity.JobAdmitted("big", dict(enumerate(NODES)), 1, N,
                                       max_replacements=10**9), now)
    published = []

    def handle(event) -> None:
        for decision in core.handle(event, now):
            if isinstance(decision, elasticity.PublishGeneration):
                published.append(decision.generation)
            # Cold starts only (no spares): the replacements join together, after a fault.
            if isinstance(decision, elasticity.LaunchReplacement) and not decision.warm_only:
                handle(elasticity.ReplicaReadySeen("big", decision.replica_id, decision.node_id,
                                               decision.slot, endpoint))

    def apply_all() -> None:
        job = core.jobs["big"]
        for replica in list(job.members):
            handle(elasticity.GenerationAppliedSeen("big", job.current.generation, replica,
                                                len(published)))

    for slot in range(N):
        handle(elasticity.ReplicaReadySeen("big", f"r{slot}-0", NODES[slot], slot, endpoint))
    apply_all()
    while len(published) < generations:
        # Half the members fail at once, each with its last output; their replacements
        # are ready at once: a fault generation, then a join.
        members = core.jobs["big"].members
        for replica in members[::2] if n <= 512 else members[::n // 2]:
            handle(elasticity.MemberFailed("big", replica, OUTPUT))
        apply_all()
        apply_all()
    job = core.jobs["big"]
    assert job.current.world_size == N and len(published) >= min(generations, HISTORY_LIMIT)
    largest = max(fits(g, limit) for g in published)
    [history] = core.take_histories()
    sizes = {"generation": largest, "history": fits(history, limit),
             "snapshot": fits(JobSnapshot(job_id="big", seq=2**40, format=1,
                                          state=elasticity.snapshot(job)), limit)}
    # Each cause says what happened in brief: the first line of each failure quoted, the
    # first of many replicas named, and how many more.
    faults = [g.cause for g in published if g.reason is GenerationReason.FAULT]
    assert faults and all("(Traceback (most recent call last):)" in c for c in faults)
    assert n > 512 or any(" more" in g.cause for g in published)
    print(sizes)
