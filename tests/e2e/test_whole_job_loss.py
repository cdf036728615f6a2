"""Every rank of a job killed, and again once it trains again: it resumes from memory both times.

A 2-replica job of ``examples/train_mlp.py --schedule`` (a warmup + cosine LR schedule,
clipping, an EMA and a counter stepped after each commit) on two agents of one slot each
(one rank per node: each node holds its own rank's snapshots and its buddy's replicas;
more ranks per node would hold more shards of the same kind, each rank a torch process
of seconds of CPU, and prove nothing more), with health's default cordoning, snapshots
every step. Once step 40 is reported every rank is frozen and then SIGKILLed (pids from
the agents' manifests); once the job trains again in a later generation, every process
of the job is killed the same way a second time. However health saw the deaths (one
crash first, then the others, over several generations), the job must restore the newest
step its nodes' memory holds each time and end ``finished``, bitwise equal to the script
alone: parameters, EMA, schedule and counter, and every step's loss. Killing every rank
alike is no evidence against any node: none is cordoned.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_cli import next_of
from test_elastic import (  # the e2e helpers of the elastic tests: same cluster, same job
    FaultFreeRuns,
    Watch,
    check_run,
    kill_every_rank,
    progressed,
    run_job,
    watched_cluster,
    without_lost_work,
    write_records,
)

from phalanx.bus.kv import TypedKV
from phalanx.runtime import record
from phalanx.schemas import subjects
from phalanx.schemas.messages import CheckpointPolicy, NodeRecord, ReplicaRange

pytestmark = pytest.mark.timeout(360)
# Paced (run_job) until the second loss's replacements train: the kills come at step 40
# and a few steps later, and more steps after them would prove nothing more.
STEPS = 150
KILL_AFTER = 40
SCHEDULE = ["--schedule"]
REPLICAS = 2  # on 2 agents x 1 slot


@pytest.fixture(scope="module")
def reference(fault_free_runs: FaultFreeRuns) -> dict:
    return fault_free_runs(STEPS, SCHEDULE)


async def test_every_rank_killed_twice_the_job_resumes_from_memory_each_time(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Two nodes: a replacement generation's nodes then hold every shard (their own and
    # the buddy's replicas). With a third node, replacements there held a part only; the
    # members cannot fetch shards from outside their generation yet (issue 24's note).
    async with watched_cluster(tmp_path_factory.mktemp("cluster"), "--slots-per-agent", "1",
                               agents=2, cordon=True) as cluster:
        cluster_dir, bus, _ = cluster
        killed: list[list[int]] = []
        reached: list[int] = []  # a step reported before each kill

        async def kill_twice(job_id: str, watch: Watch) -> None:
            await progressed(watch, job_id, KILL_AFTER)
            reached.append(KILL_AFTER)
            first = kill_every_rank(cluster_dir)
            assert len(first) == REPLICAS, first
            killed.append(first)
            # Trains again: a rank of a later generation reports steps past the kill.
            last = await next_of(watch.progress, lambda p: p.job_id == job_id
                                 and p.generation > 0 and p.step > KILL_AFTER + 3, 180)
            reached.append(last.step)
            second = kill_every_rank(cluster_dir)
            assert second and not set(second) & set(first), (first, second)
            killed.append(second)
            await next_of(watch.progress, lambda p: p.job_id == job_id
                          and p.generation > last.generation, 180)

        rec, _ = await run_job(
            cluster, data_dir, tmp_path, "twice", kill_twice, steps=STEPS, args=SCHEDULE,
            spec={"checkpoint": CheckpointPolicy(memory_every_steps=1),
                  "replicas": ReplicaRange(min=2, max=REPLICAS)})
        nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
        entries, _ = await nodes.entries()
        cordoned = [e.value.node.node_id for e in entries if e.value.cordoned]
    assert cordoned == [], "killing every rank alike is no evidence against a node"
    records = record.read(rec)
    restores = sorted((line["t"], line["step"], line["tier"]) for lines in records.values()
                      for line in lines if line["kind"] == "restore")
    # Two whole-job losses, each restored from the nodes' memory: at least the step before
    # one reported before the kill (a rank a step behind was frozen before its snapshot).
    steps = sorted({step for _, step, tier in restores if tier == "memory"})
    assert len(steps) == 2 and all(step >= before - 1 for step, before
                                   in zip(steps, reached, strict=True)), (restores, reached)
    # A generation whose members' nodes held none of the step (replacements started on the
    # third node first) went on from what they held, saying so, and was superseded by one
    # that restored the step: the memory tier is always the last word.
    last_memory = max(t for t, _, tier in restores if tier == "memory")
    assert all(tier == "memory" or t < last_memory for t, _, tier in restores), restores
    # What the dead ranks committed after the step restored from is trained again.
    kept = write_records(without_lost_work(records, STEPS), tmp_path / "rec-kept")
    check_run(kept, tmp_path / "final.pt", reference)
