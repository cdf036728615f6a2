"""Elastic scaling as a policy, end to end: growth into freed slots, a graceful shrink for a
higher-priority job, growth back, on a real 4-slot local cluster with real torch ranks.

An elastic job (``replicas: {min: 1, max: 4}``) starts at 2 beside a 2-slot
filler and grows to 4 when the filler is cancelled. With increment 1 it then
shrinks gracefully to 2 when a high-priority rigid 2-slot job arrives (its ranks
start as soon as the leavers exit) and grows back to 4 when that job is
cancelled. With ``replica_discrete_values: [2, 4]`` the preemptor needs one
slot, and the job still goes from 4 straight to 2 (3 is not allowed; nor is
growing into the slot left free), then ``phalanx scale`` refuses a pin to 3
naming the allowed sizes, pins it to 2 (``phalanx job`` shows the pin and the
rules) and the job finishes at 2 — one growth fewer than the other variant,
which already proves growth back. Checked: the generations' reasons and sizes
(never 3 with ``[2, 4]``), no step aborted (every batch a replica recorded was
committed in its generation), the leavers left with status 0, every planned
size change announced on the bus and done (none abandoned), the final
parameters equal to the same script run alone (deterministic mode), every
sample exactly once per epoch. The preemptor's submit → ranks-running time is
printed, not asserted (speed lives in ``bench/elastic.py``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
from e2e_cli import next_of, phalanx
from test_elastic import (  # the same workload, reference run and cluster
    ARGS,
    RUN_ENV,
    SCRIPT,
    FaultFreeRuns,
    Watch,
    check_run,
    watched_cluster,
)

from phalanx.bus.client import Delivery
from phalanx.runtime import record
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Generation,
    GenerationReason,
    JobSpec,
    JobState,
    RankExited,
    RankStarted,
    ReplicaRange,
    ScalingEvent,
    ScalingEventKind,
    ScalingPolicy,
)
from phalanx.services.client import AdmissionClient

STEPS = 400
# The job trains at most 2 steps/s until the test has made its last change, so it cannot
# finish first whatever the machine's speed (a quiet one once trained all its steps while
# the replicas of the growth back were still importing torch): 200 s for its joins and its
# leave. Then it trains the steps left at full speed; more steps at a faster pace would
# give the same window and train thousands more steps that prove nothing more.
PACE_S = 0.5


@pytest.fixture(scope="module")
def reference(fault_free_runs: FaultFreeRuns) -> dict:
    return fault_free_runs(STEPS)


def aborted(records: dict[str, list[dict]]) -> list[tuple[str, int, int]]:
    """(replica, step, generation) of every batch a replica trained and did not commit in
    the same generation: a step given up."""
    out = []
    for replica, lines in records.items():
        committed = {(line["step"], line["generation"]) for line in lines
                     if line["kind"] == "commit"}
        out += [(replica, line["step"], line["generation"]) for line in lines
                if line["kind"] == "batch" and (line["step"], line["generation"]) not in committed]
    return out


@pytest.mark.timeout(600)  # a cluster, 400 paced steps on 2 to 4 ranks, up to three joins
@pytest.mark.parametrize("scaling", [
    ScalingPolicy(replica_increment_step=1),
    ScalingPolicy(replica_discrete_values=[2, 4]),
], ids=["increment-1", "discrete-2-4"])
async def test_grow_shrink_gracefully_for_a_preemptor_and_grow_back(
        scaling: ScalingPolicy, data_dir: Path, reference: dict,
        tmp_path: Path) -> None:
    async with watched_cluster(tmp_path / "cluster") as (data, bus, watch):
        await scenario(scaling, data, bus, watch, data_dir, reference, tmp_path)


async def scenario(scaling: ScalingPolicy, data: Path, bus, watch: Watch, mlp_data: Path,
                   reference: dict, tmp_path: Path) -> None:
    client = AdmissionClient(bus)
    started: asyncio.Queue[RankStarted] = asyncio.Queue()
    exited: asyncio.Queue[RankExited] = asyncio.Queue()

    async def put(queue: asyncio.Queue, message, _: Delivery) -> None:
        await queue.put(message)

    await bus.subscribe(subjects.job_events("started"), RankStarted,
                        lambda m, d: put(started, m, d))
    await bus.subscribe(subjects.job_events("exited"), RankExited,
                        lambda m, d: put(exited, m, d))
    announced: list[ScalingEvent] = []

    async def note(event: ScalingEvent, _: Delivery) -> None:
        announced.append(event)

    await bus.subscribe(subjects.job_scaling("elastic-1"), ScalingEvent, note)
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    filler = await client.submit(JobSpec(
        name="filler", team="t", priority_class="normal", replicas=ReplicaRange(min=2, max=2),
        command=sleeper, grace_period_s=1.0), "filler-1")
    await next_of(watch.states, lambda r: r.job_id == filler.job_id
                  and r.state is JobState.ADMITTED, 60)

    rec = tmp_path / "rec"
    release = tmp_path / "release"
    elastic = await client.submit(JobSpec(
        name="elastic", team="t", priority_class="low", replicas=ReplicaRange(min=1, max=4),
        scaling=scaling, command=[sys.executable, str(SCRIPT), "--data-dir", str(mlp_data),
                                  *ARGS, "--steps", str(STEPS),
                                  "--save", str(tmp_path / "final.pt")],
        env={"PHALANX_RECORD_DIR": str(rec), "PHALANX_CHAOS_PACE": f"{PACE_S}:{release}",
             **RUN_ENV}, hang_timeout_s=5.0,
        grace_period_s=3.0), "elastic-1")
    job_id = elastic.job_id
    generations: list[Generation] = []

    async def generation(reason: GenerationReason, size: int) -> Generation:
        """The next generation; joins may come one replica at a time (as each is ready),
        where the scaling rules allow that size."""
        while True:
            g = await next_of(watch.generations, lambda g: g.job_id == job_id, 180)
            generations.append(g)
            if g.reason is GenerationReason.JOIN and g.world_size < size:
                continue
            assert (g.reason, g.world_size) == (reason, size), g
            return g

    await generation(GenerationReason.START, 2)
    await client.cancel(filler.job_id)  # 2 slots free up: growth
    await generation(GenerationReason.JOIN, 4)

    discrete = scaling.replica_discrete_values == [2, 4]
    width = 1 if discrete else 2  # with [2, 4] one slot taken still takes the job to 2
    submitted = time.monotonic()
    urgent = await client.submit(JobSpec(
        name="urgent", team="t", priority_class="high",
        replicas=ReplicaRange(min=width, max=width), command=sleeper, grace_period_s=1.0),
        "urgent-1")
    leave = await generation(GenerationReason.LEAVE, 2)
    for _ in range(width):
        await next_of(started, lambda s: s.job_id == urgent.job_id, 60)
    print(f"preemptor submit -> {width} rank(s) running: {time.monotonic() - submitted:.2f} s")
    leavers = {"r2-0", "r3-0"} if "r2-0" not in {m.replica_id for m in leave.members} \
        else set()
    assert leavers, leave
    gone = [await next_of(exited, lambda e: e.job_id == job_id, 30) for _ in leavers]
    assert {e.replica_id for e in gone} == leavers
    assert all(e.exit_code == 0 and e.signal is None for e in gone), gone

    if discrete:
        where = ("--data-dir", str(data))
        refused = phalanx("scale", job_id, "--replicas", "3", *where, check=False)
        assert refused.returncode == 2 and "allowed: 2, 4" in refused.stderr, refused.stderr
        phalanx("scale", job_id, "--replicas", "2", *where)
        shown = json.loads(phalanx("job", job_id, "--json", *where).stdout)["scaling"]
        assert (shown["sizes"], shown["pinned_replicas"]) == ([2, 4], 2), shown
    else:
        await client.cancel(urgent.job_id)  # its slots free up: growth back
        await generation(GenerationReason.JOIN, 4)
    release.touch()  # the last change is made: the job may run to its end at full speed
    print(f"last planned change resumed after step {generations[-1].resume_step} of {STEPS}")
    finished = await next_of(watch.states, lambda r: r.job_id == job_id and r.state.terminal,
                             600)
    assert finished.state is JobState.FINISHED, finished.reason
    while not watch.generations.empty():
        g = watch.generations.get_nowait()
        if g.job_id == job_id:
            generations.append(g)
    assert all(g.reason is not GenerationReason.FAULT for g in generations), generations
    if scaling.replica_discrete_values == [2, 4]:
        assert {g.world_size for g in generations} <= {2, 4}
    records = record.read(rec)
    assert aborted(records) == [], "a step was aborted by a planned change"
    for replica in leavers:
        assert records[replica][-1]["kind"] == "left" and records[replica][-1]["planned"]
    check_run(rec, tmp_path / "final.pt", reference)
    planned = [(e.kind, e.from_replicas, e.to_replicas) for e in announced
               if e.kind in (ScalingEventKind.GROW, ScalingEventKind.SHRINK) and e.deadline]
    done = [(e.from_replicas, e.to_replicas) for e in announced
            if e.kind is ScalingEventKind.DONE]
    assert (ScalingEventKind.SHRINK, 4, 2) in planned, announced  # the preemption's leave
    assert [(f, t) for _, f, t in planned] == done, announced  # each done, in order
    assert not [e for e in announced if e.kind is ScalingEventKind.TIMEOUT], announced
    phalanx("cancel", job_id, "--data-dir", str(data), check=False)
