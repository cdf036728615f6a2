"""Path 1 end to end: a sharded optimizer (ZeroRedundancyOptimizer) under the session.

A 4-replica job of ``examples/train_mlp.py --sharded-optimizer`` on a local cluster
(2 agents x 2 slots): each rank holds AdamW's state for its partition of the
parameters only, and after every committed step (``checkpoint.memory_every_steps:
1``) snapshots its share of the replicated state and its partition's entries into
its agent's shared memory. One rank SIGKILLs itself in step 10's update, right
after posting the broadcasts of the parameters it owns (its agent alive): the step
is torn (the survivors may hold some owners' new parameters and not others') and
the dead rank's partition exists in no process any more, so the three survivors
restore the newest step complete in the nodes' memory (the dead rank's entries
from its node's store), re-partitioned over three. Then a replacement joins: the
three hand the consolidated state over in their group before switching, the
joiner receives it, and the four re-partition it. The job must end with parameters
and every step's loss equal to the fault-free run of the same script alone
(deterministic mode), every sample once per epoch, and no step committed before
the fault trained again but the one in flight when it hit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from e2e_cli import next_of
from test_elastic import (  # the e2e helpers of the elastic tests: same cluster, same job
    FAULT_STEP,
    LONG_PACE_S,
    LONG_STEPS,
    FaultFreeRuns,
    Watch,
    check_run,
    run_job,
    watched_cluster,
)

from phalanx.runtime import record
from phalanx.schemas import subjects
from phalanx.schemas.messages import CheckpointPolicy, Generation, GenerationReason

pytestmark = pytest.mark.timeout(420)
SHARDED = ["--sharded-optimizer"]
KILL_AT = FAULT_STEP


@pytest.fixture(scope="module")
def reference(fault_free_runs: FaultFreeRuns) -> dict:
    return fault_free_runs(LONG_STEPS, SHARDED)


async def test_a_rank_of_a_sharded_optimizer_killed_its_partition_comes_back_repartitioned(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    async with watched_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        _, bus, _ = cluster
        changes: asyncio.Queue[Generation] = asyncio.Queue()

        async def kill(job_id: str, watch: Watch) -> None:
            await bus.subscribe(subjects.job_generation(job_id), Generation,
                                lambda g, _: changes.put(g))
            join = await next_of(changes, lambda g: g.reason is GenerationReason.JOIN, 180)
            await next_of(watch.progress, lambda p: p.job_id == job_id
                          and p.generation >= join.generation, 120)

        rec, generations = await run_job(
            cluster, data_dir, tmp_path, "zero", kill, steps=LONG_STEPS, args=SHARDED,
            pace_s=LONG_PACE_S, env={"PHALANX_CHAOS_KILL": f"r1-0:{KILL_AT}:update"},
            spec={"checkpoint": CheckpointPolicy(memory_every_steps=1)})
    reasons = [(g.reason, g.world_size) for g in generations]
    assert reasons[:3] == [(GenerationReason.START, 4), (GenerationReason.FAULT, 3),
                           (GenerationReason.JOIN, 4)], reasons
    fault, join = generations[1], generations[2]
    records = record.read(rec)
    assert [line["step"] for line in records["r1-0"] if line["kind"] == "chaos"] == [KILL_AT]
    restores = [(replica, line) for replica, lines in records.items() for line in lines
                if line["kind"] == "restore"]
    # Every survivor, and only in the fault's generation, restored one step from memory.
    assert sorted(r for r, _ in restores) == ["r0-0", "r2-0", "r3-0"], restores
    assert {line["generation"] for _, line in restores} == {fault.generation}
    assert all(line["tier"] == "memory" and line["corrupt"] == [] for _, line in restores)
    (restored,) = {line["step"] for _, line in restores}
    # Nothing older than the step in flight: the survivors' last commit before the fault
    # (the dead rank's snapshot of it may not have been written) at most.
    reached = max(line["step"] + 1 for replica in ("r0-0", "r2-0", "r3-0")
                  for line in records[replica]
                  if line["kind"] == "commit" and line["generation"] == 0)
    assert reached - 1 <= restored <= reached and restored >= KILL_AT, (restored, reached)
    # The joiner received the consolidated state the members handed over at the switch.
    adopt = [line for line in records["r1-1"] if line["kind"] == "adopt"]
    assert [line["generation"] for line in adopt] == [join.generation]
    assert adopt[0]["step"] > restored and adopt[0]["state_bytes"] > 0
    check_run(rec, tmp_path / "final.pt", reference)
