"""The largest job the schema admits fits every message and stored state that lists it.

A job's record, each of its generations, its history and the health and elasticity
leaders' snapshots of it each list its replicas and must each fit one NATS payload
(``MAX_PAYLOAD_BYTES``): one that does not cannot be published or stored, and a leader
that cannot store its state steps down (a fuzz run's 60,000-replica record did that to
health). Built here at ``MAX_REPLICAS`` with 128-character ids, 300-character
endpoints and, for elasticity, hundreds of generations of mass failures whose every
replica reports 4 KB of last output.
"""

from __future__ import annotations

import time

from phalanx.schemas.codec import MAX_PAYLOAD_BYTES, encode
from phalanx.schemas.messages import (
    DETAIL_CHARS,
    HISTORY_LIMIT,
    MAX_REPLICAS,
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

N = MAX_REPLICAS
NODES = [f"n{i}-".ljust(128, "x") for i in range(N)]
OUTPUT = "Traceback (most recent call last):\n" + "x" * (DETAIL_CHARS - 40)


def fits(message) -> int:
    size = len(encode(message))  # raises WireError past the limit
    assert size <= MAX_PAYLOAD_BYTES
    return size


def test_the_largest_job_record_fits() -> None:
    spec = JobSpec(name="big", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=N, max=N), command=["python", "train.py"])
    fits(JobRecord(job_id="big".ljust(128, "x"), spec=spec, state=JobState.ADMITTED,
                   reason_code=ReasonCode.ADMITTED, nodes=NODES, submitted_at=time.time(),
                   updated_at=time.time()))


def test_health_state_of_the_largest_job_fits_one_snapshot() -> None:
    core = health.HealthCore(health.HealthPolicy())
    now = time.time()
    core.handle(health.JobWatched("big", tuple(NODES), 2.0), now)
    for rank in range(N):  # replica ids as long as the wire allows
        core.handle(health.RankStartSeen("big", rank, NODES[rank], 2**22,
                                       f"r{rank}-".ljust(128, "9")), now)
    fits(JobSnapshot(job_id="big", seq=2**40, format=1,
                     state=health.snapshot(core.jobs["big"])))


def test_elasticity_state_generations_and_history_of_the_largest_job_fit() -> None:
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
    while len(published) < HISTORY_LIMIT + 20:
        # Half the members fail at once, each with its last output; their replacements
        # are ready at once: a fault generation, then a join.
        for replica in core.jobs["big"].members[::2]:
            handle(elasticity.MemberFailed("big", replica, OUTPUT))
        apply_all()
        apply_all()
    job = core.jobs["big"]
    assert job.current.world_size == N and len(published) >= HISTORY_LIMIT
    largest = max(fits(g) for g in published)
    [history] = core.take_histories()
    sizes = {"generation": largest, "history": fits(history),
             "snapshot": fits(JobSnapshot(job_id="big", seq=2**40, format=1,
                                          state=elasticity.snapshot(job)))}
    # Each cause says what happened in brief: the first line of each failure quoted, the
    # first of many replicas named, and how many more.
    faults = [g.cause for g in published if g.reason is GenerationReason.FAULT]
    assert faults and all("(Traceback (most recent call last):)" in c for c in faults)
    assert any(" more" in g.cause for g in published)
    print(sizes)
